"""GPTQ and AWQ checkpoints written by hand, from the published formats (test-side; independent of
llmexport's reader in llmexport/source/importers/gptq_awq).

* a word stream: each row's values, value j at bit offset ``j * bits`` of a little-endian stream
  of 32-bit words (low bits first, a value crossing a word boundary split over both words);
* GPTQ: ``qweight`` [in * bits / 32, out] streams along the inputs, ``qzeros`` [groups, out * bits / 32]
  along the outputs (v1: ``zero - 1``, masked to ``bits``), ``scales`` fp16 [groups, out], ``g_idx`` [in];
* AWQ gemm: ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] hold, in slot j of each word,
  column ``8k + (0, 2, 4, 6, 1, 3, 5, 7)[j]``.

``quantize`` is a plain round-to-nearest per (row, group); ``dequantize`` the formats' map
``scale * (q - zero)`` in fp64, rounded once to fp32 (the exact value when it is representable).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_SLOT_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


def word_stream(values: np.ndarray, bits: int) -> np.ndarray:
    """``[rows, n]`` unsigned values -> int32 ``[rows, n * bits / 32]``, one stream per row."""
    rows, n = values.shape
    assert n * bits % 32 == 0 and values.min(initial=0) >= 0 and values.max(initial=0) < (1 << bits)
    words = np.zeros((rows, n * bits // 32), dtype=np.uint64)
    for j in range(n):
        word, shift = divmod(j * bits, 32)
        v = values[:, j].astype(np.uint64)
        words[:, word] |= (v << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:  # the high bits continue at the bottom of the next word
            words[:, word + 1] |= v >> np.uint64(32 - shift)
    return words.astype(np.uint32).view(np.int32)


def quantize(w: torch.Tensor, bits: int, groups: torch.Tensor, sym: bool):
    """RTN per (row, group): (q [out, in], zeros [out, ngroups], scales fp16 [out, ngroups])."""
    w = w.double()
    out, ngroups, top = w.shape[0], int(groups.max()) + 1, (1 << bits) - 1
    scales, zeros = torch.zeros(out, ngroups, dtype=torch.float16), torch.zeros(out, ngroups, dtype=torch.int64)
    for g in range(ngroups):
        part = w[:, groups == g]
        if sym:
            s = (part.abs().amax(1) / (top // 2)).clamp_min(1e-6)
            z = torch.full((out,), 1 << (bits - 1), dtype=torch.int64)
        else:
            lo, hi = part.amin(1).clamp_max(0), part.amax(1).clamp_min(0)
            s = ((hi - lo) / top).clamp_min(1e-6)
            z = torch.round(-lo / s.half().double()).long().clamp(0, top)
        scales[:, g], zeros[:, g] = s.half(), z
    sc, zc = scales.double()[:, groups], zeros[:, groups]
    q = torch.clamp(torch.round(w / sc) + zc, 0, top).long()
    return q, zeros, scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return (scales.double()[:, groups] * (q - zeros[:, groups]).double()).float()


def read_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """The zeros GPTQ v1's kernels read back: ``zero - 1`` is stored in ``bits`` bits and 1 added on
    reading, so a zero of 0 comes back as ``2^bits``."""
    return ((zeros - 1) & ((1 << bits) - 1)) + 1


def gptq_tensors(q, zeros, scales, bits: int, groups: torch.Tensor, v1: bool = True) -> dict[str, torch.Tensor]:
    stored_zeros = (zeros - 1) & ((1 << bits) - 1) if v1 else zeros
    return {"qweight": torch.from_numpy(word_stream(q.numpy(), bits).T.copy()),
            "qzeros": torch.from_numpy(word_stream(stored_zeros.t().numpy(), bits)),
            "scales": scales.t().contiguous(), "g_idx": groups.to(torch.int32)}


def awq_tensors(q, zeros, scales) -> dict[str, torch.Tensor]:
    def slots(columns: torch.Tensor) -> np.ndarray:  # [rows, out]: columns into AWQ's slot order
        rows, out = columns.shape
        order = (np.arange(out) // 8 * 8).reshape(-1, 8) + np.array(AWQ_SLOT_COLUMN)
        return columns.numpy()[:, order.reshape(-1)]

    return {"qweight": torch.from_numpy(word_stream(slots(q.t()), 4)),
            "qzeros": torch.from_numpy(word_stream(slots(zeros.t()), 4)), "scales": scales.t().contiguous()}


def group_indices(in_features: int, group: int, act_order: bool, seed: int = 0) -> torch.Tensor:
    """Each input's group: runs of ``group`` (-1: one group), or act-order's: the inputs taken in
    a random (importance) order, every ``group`` of them one group."""
    size = in_features if group == -1 else group
    runs = torch.arange(in_features) // size
    if not act_order:
        return runs
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(in_features, dtype=torch.long)
    groups[perm] = runs
    return groups


def quantize_checkpoint(hf: Path, out: Path, method: str, bits: int = 4, group: int = 32, sym: bool = False,
                        act_order: bool = False, v1: bool = True, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """``hf``'s decoder linears (``*_proj``, and ``lm_head`` when asked, as GPTQModel's ``lm_head``
    option does) packed as GPTQ or AWQ into ``out``; the other tensors kept (fp16). Returns the
    dequantized value of every packed weight, by HF name."""
    from safetensors.torch import load_file, save_file

    tensors, packed, reference = load_file(hf / "model.safetensors"), {}, {}
    for name, tensor in tensors.items():
        stem = name.removesuffix(".weight")
        if not ((name.endswith("_proj.weight") or lm_head and name == "lm_head.weight") and tensor.dim() == 2):
            packed[name] = tensor.half() if tensor.is_floating_point() else tensor
            continue
        groups = group_indices(tensor.shape[1], group, act_order, seed=len(reference))
        q, zeros, scales = quantize(tensor.float(), bits, groups, sym)
        reference[name] = dequantize(q, read_zeros(zeros, bits) if method == "gptq" and v1 else zeros, scales, groups)
        parts = gptq_tensors(q, zeros, scales, bits, groups, v1) if method == "gptq" else awq_tensors(q, zeros, scales)
        packed.update({f"{stem}.{leaf}": value for leaf, value in parts.items()})
    shutil.copytree(hf, out)
    save_file(packed, out / "model.safetensors")
    config = json.loads((hf / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"} if method == "gptq" else
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return reference
