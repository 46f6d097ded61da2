"""Records from integers another tool quantized: MLX's affine map in MNN's asymmetric convention."""

from __future__ import annotations

import logging

import torch

from llmexport.spec import Prequantized, QuantizedTensor

log = logging.getLogger(__name__)


def transcode(weight: Prequantized, bits: int, block: int, sym: bool = False) -> QuantizedTensor:
    """The quantizer of ``QuantMethod.STORED``: a source's integers and affine map in MNN's convention
    (signed level ``q - 2^(bits-1)``, ``zero = biases + 2^(bits-1) * scales``), nothing rounded but
    ``zero`` to fp32 (exact for bf16/fp16 scales; counted and logged otherwise). ``sym``: the
    symmetric record (scales only), for a weight whose every ``zero`` is exactly 0."""
    if (sym and not weight.symmetric) or (bits, block) != (weight.bits, weight.group) or weight.dim() != 2:
        raise ValueError(f"a {weight.info} {list(weight.shape)} weight cannot be stored as "
                         f"{'sym' if sym else 'asym'} {bits}-bit block {block}")
    half = 1 << (bits - 1)
    oc, ic = weight.shape
    q = (weight.levels.to(torch.int16) - half).to(torch.int8).reshape(oc, ic // block, block)
    scale = weight.scales.float()
    if sym:
        return QuantizedTensor(q=q, scale=scale, zero=None, bits=bits, block=block)
    zero = weight.biases.float() + half * scale
    inexact = int((zero.double() != weight.biases.double() + half * weight.scales.double()).sum())
    if inexact:
        log.warning("%d of %d groups: zero = bias + %d * scale rounds in fp32 (decoded values may differ from "
                    "MLX's by one ulp)", inexact, zero.numel(), half)
    return QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)
