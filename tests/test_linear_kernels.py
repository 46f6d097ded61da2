"""MNN 3.6.1's CPU kernels on one exported linear (llmexport.mnn.linear_graph), pinned: which
settings change which kernel runs, and what that does to the error (docs/benchmarks.md, "Long
prompts"). Errors are max |error| / max |output| against fp64 of the weights the record decodes to."""

from __future__ import annotations

import numpy as np
import pytest

from llmexport.mnn.linear_graph import linear_model
from llmexport.mnn.runtime import run_module
from llmexport.quant.scheme import QuantScheme


def _case(rows: int, ic: int, oc: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows + ic)
    return (rng.standard_normal((rows, ic)).astype(np.float32),
            (rng.standard_normal((oc, ic)) / np.sqrt(ic)).astype(np.float32))


def _errors(model, x: np.ndarray, used: np.ndarray, settings: list[dict]) -> list[tuple[float, float]]:
    exact = x.astype(np.float64) @ used.astype(np.float64).T
    top = np.abs(exact).max()
    out = []
    for s in settings:
        diff = run_module(model, [{"x": x}], ["y"], thread_num=1, settings=s)[0]["y"].reshape(exact.shape) - exact
        out.append((float(np.abs(diff).max() / top), float(np.sqrt((diff * diff).mean()) / top)))
    return out


def test_dynamic_option_2_quantizes_the_fast_kernels_input_per_block(tmp_path):
    """config.json's ``dynamic_option`` 2 (not written by the export; docs/troubleshooting.md): the
    low-memory int8 kernels err less with the input quantized per weight block; the float kernels
    (memory normal) ignore it."""
    x, w = _case(64, 256, 256)
    used = linear_model(tmp_path / "q4.mnn", w, QuantScheme(bits=4, block=64))
    per_row, per_block, normal, normal_2 = _errors(tmp_path / "q4.mnn", x, used, [
        {"memory": "low", "dynamic_option": 0}, {"memory": "low", "dynamic_option": 2},
        {"memory": "normal", "dynamic_option": 0}, {"memory": "normal", "dynamic_option": 2}])
    assert 1e-3 < per_block[0] < 0.85 * per_row[0] and per_block[1] < 0.85 * per_row[1]
    assert normal == normal_2 and normal[0] < 1e-5


def test_strassen_1x1_errs_more_than_the_tiled_gemm_at_many_rows(tmp_path):
    """Memory normal (and fp16 records under any memory mode) run a 1x1 convolution with MNN's
    Strassen executor, which recurses once the row count makes it pay (StrassenMatmulComputor.cpp);
    the same convolution at stride 2 (identical output on the 1x1 plane) takes the tiled GEMM."""
    x, w = _case(1024, 512, 512)
    strassen = _errors(tmp_path / "s1.mnn", x, linear_model(tmp_path / "s1.mnn", w, QuantScheme(bits=16)),
                       [{"memory": "normal"}])[0]
    tiled = _errors(tmp_path / "s2.mnn", x, linear_model(tmp_path / "s2.mnn", w, QuantScheme(bits=16), strided=True),
                    [{"memory": "normal"}])[0]
    assert tiled[0] < 0.7 * strassen[0] and tiled[1] < 0.7 * strassen[1] and strassen[0] < 1e-5


@pytest.mark.parametrize("scheme", [None, QuantScheme(bits=8, block=64)])
def test_one_linear_graph_computes_the_record(tmp_path, scheme):
    x, w = _case(4, 128, 64)
    used = linear_model(tmp_path / "m.mnn", w, scheme)
    if scheme is None:
        assert used is w
    else:
        assert np.abs(used - w).max() < 0.02 * np.abs(w).max() and not np.array_equal(used, w)
    (error, _), = _errors(tmp_path / "m.mnn", x, used, [{"memory": "normal"}])
    assert error < 1e-5
