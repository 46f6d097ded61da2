"""Quantize on the GPU when there is one, on the CPU otherwise, and survive running out of memory.

``on_best_device(quantizer)`` wraps a pure quantizer: a tensor that fits in the GPU's free memory
(with headroom for the work buffers) is quantized there; an out-of-memory error raised anywhere
on that path (the copy, the kernels, the copy back) frees the cache and redoes that one tensor on
the CPU; tensors too large for the GPU go straight to the CPU. Results always come back on the CPU.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from llmexport.spec import QuantizedTensor, Quantizer

log = logging.getLogger(__name__)

# Work buffers of the quantizers (fp32 copy, levels, scales, HQQ iterates) relative to the input.
_HEADROOM = 6.0


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _to_cpu(qt: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(qt.q.cpu(), qt.scale.cpu(), None if qt.zero is None else qt.zero.cpu(), qt.bits, qt.block)


@dataclass
class Accelerator:
    """Where "on the GPU" means: moving a tensor there, whether it fits, freeing the cache."""

    move: Callable[[torch.Tensor], torch.Tensor]
    fits: Callable[[torch.Tensor], bool]
    free_cache: Callable[[], None]


def cuda_accelerator() -> Accelerator | None:
    if not torch.cuda.is_available():
        return None

    def fits(weight: torch.Tensor) -> bool:
        free, _ = torch.cuda.mem_get_info()
        return weight.numel() * 4 * _HEADROOM < free

    return Accelerator(lambda t: t.to("cuda", non_blocking=True), fits, torch.cuda.empty_cache)


def on_best_device(quantizer: Quantizer, accelerator: Accelerator | None = None, enabled: bool = True) -> Quantizer:
    """``quantizer`` run on the accelerator (CUDA by default, when present and the tensor fits),
    redone on the CPU after an out-of-memory error. ``run.stats`` counts where tensors went."""
    accel = None if not enabled else accelerator if accelerator is not None else cuda_accelerator()
    stats = {"gpu": 0, "cpu": 0, "fallback": 0}
    lock = threading.Lock()  # the writers call this from several quantization workers at once

    def count(key: str) -> None:
        with lock:
            stats[key] += 1

    def run(weight: torch.Tensor, bits: int, block: int, sym: bool) -> QuantizedTensor:
        if accel is not None and accel.fits(weight):
            try:
                result = _to_cpu(quantizer(accel.move(weight), bits, block, sym))
                count("gpu")
                return result
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                count("fallback")
                log.warning("GPU out of memory quantizing a %s tensor; redoing it on the CPU", tuple(weight.shape))
                accel.free_cache()
        count("cpu")
        return quantizer(weight.cpu(), bits, block, sym)

    run.stats = stats  # type: ignore[attr-defined]
    return run
