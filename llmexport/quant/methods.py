"""The quantizers, keyed by ``QuantMethod``: the one place a scheme's method becomes a function.

A quantizer is a pure function ``(weight [oc, ic], bits, block, sym) -> QuantizedTensor``
(llmexport.spec.Quantizer). Each method registers one here; ``quantizers(use_gpu)`` gives the set
an export runs with (each wrapped to run on the GPU when there is one, llmexport.quant.device),
which the pipeline hands to the writers: a writer never chooses a quantizer itself.
``QuantMethod.STORED`` has none: such a record carries its source's own integers
(llmexport.quant.transcode).
"""

from __future__ import annotations

from typing import Mapping

from llmexport.quant.device import on_best_device
from llmexport.quant.hqq import quantize_hqq
from llmexport.quant.rtn import quantize_rtn
from llmexport.quant.scheme import QuantMethod
from llmexport.spec import Quantizer

#: method -> its quantizer (a calibrated method adds its entry here)
QUANTIZERS: Mapping[QuantMethod, Quantizer] = {
    QuantMethod.RTN: quantize_rtn,
    QuantMethod.HQQ: quantize_hqq,
}


def quantizer_for(method: QuantMethod | str) -> Quantizer:
    """The quantizer of a ``QuantScheme.method`` (ValueError for a method without one)."""
    method = QuantMethod(method)
    if method not in QUANTIZERS:
        raise ValueError(f"quantization method {method.value!r} has no quantizer "
                         f"(quantizers: {', '.join(m.value for m in QUANTIZERS)})")
    return QUANTIZERS[method]


def quantizers(use_gpu: bool) -> dict[QuantMethod, Quantizer]:
    """Every registered quantizer, each on the best device (``use_gpu=False``: always the CPU)."""
    return {method: on_best_device(quantize, enabled=use_gpu) for method, quantize in QUANTIZERS.items()}
