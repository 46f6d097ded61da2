"""GPU quantization with CPU fallback, tested on CPU machines by injecting out-of-memory errors
at each point of the accelerator path."""

from __future__ import annotations

import pytest
import torch

from llmexport.quant.device import Accelerator, on_best_device
from llmexport.quant.rtn import quantize_rtn


def _fake_accelerator(fail_on: str | None, fits=lambda t: True):
    calls = {"free": 0}

    def move(t):
        if fail_on == "move":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return t.clone()

    def free():
        calls["free"] += 1

    return Accelerator(move, fits, free), calls


def _quantizer(fail_on: str | None):
    def q(w, bits, block, sym):
        if fail_on == "kernel":
            raise RuntimeError("CUDA error: out of memory")
        return quantize_rtn(w, bits, block, sym)
    return q


W = torch.randn(64, 128)


@pytest.mark.parametrize("fail_on", ["move", "kernel"])
def test_oom_anywhere_on_the_gpu_path_redoes_the_tensor_on_cpu(fail_on):
    accel, calls = _fake_accelerator(fail_on)
    kernel_fails = {"n": 0}

    def q(w, bits, block, sym):
        # the accelerator path fails; the CPU redo succeeds
        if fail_on == "kernel" and kernel_fails["n"] == 0:
            kernel_fails["n"] += 1
            raise RuntimeError("CUDA error: out of memory")
        return quantize_rtn(w, bits, block, sym)

    run = on_best_device(q, accel)
    got = run(W, 4, 64, False)
    want = quantize_rtn(W, 4, 64, False)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    assert run.stats == {"gpu": 0, "cpu": 1, "fallback": 1} and calls["free"] == 1


def test_tensor_too_large_goes_straight_to_cpu():
    accel, calls = _fake_accelerator(None, fits=lambda t: False)
    run = on_best_device(_quantizer(None), accel)
    run(W, 8, 64, True)
    assert run.stats == {"gpu": 0, "cpu": 1, "fallback": 0} and calls["free"] == 0


def test_accelerator_path_used_when_it_fits():
    accel, _ = _fake_accelerator(None)
    run = on_best_device(_quantizer(None), accel)
    run(W, 4, 32, False)
    assert run.stats == {"gpu": 1, "cpu": 0, "fallback": 0}


def test_other_errors_are_not_swallowed():
    accel, _ = _fake_accelerator(None)

    def broken(w, bits, block, sym):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        on_best_device(broken, accel)(W, 4, 64, False)


def test_disabled_means_cpu():
    accel, _ = _fake_accelerator(None)
    run = on_best_device(_quantizer(None), accel, enabled=False)
    run(W, 4, 64, False)
    assert run.stats["cpu"] == 1
