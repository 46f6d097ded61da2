"""GPTQ calibration (``--calib_data``): the text linears rounded on the model's own activations.

HF's reference model runs once over the calibration tokens (llmexport.calibration.data: windows
spread over the user's text, joined into one sequence) with its weights streamed from the
checkpoint (llmexport.reference.streamed: one decoder block in memory at a time). Each block runs
twice: first with its checkpoint weights, while forward pre-hooks sum ``H = X^T X`` of the inputs
of its linears; then each linear is rounded by GPTQ with its ``H`` on the export's scheme
(llmexport.quant.gptq, the scheme's method choosing the block grids), the block's weights are
replaced by what the records will decode to, and the block runs again to hand the next block its
input. Later blocks therefore calibrate on the activations of the already-quantized earlier ones,
as GPTQ does, and memory holds one block, its Hessians and the hidden states, whatever the depth.

The lm_head (tied or not) rounds on the final hidden states of every position.
The results are saved to ``folder`` and written by the exporter as they are (``Precomputed``).
Left to the scheme's own method (and listed in ``CalibratedLinears.skipped`` with the reason):
fp16 linears, linears outside the decoder blocks (Gemma4's PLE projection), experts no calibration
token was routed to, routed experts that transformers stacks and other linears that are not one ``nn.Linear`` of
the reference holding exactly the export's weight (stacked, fused or rescaled parameters), and
the towers' linears.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, cast

import torch
from torch import nn

from llmexport.calibration.data import calibration_windows, read_texts
from llmexport.models.base import Architecture
from llmexport.options import Calibration
from llmexport.quant.gptq import ROW_ELEMENTS, gptq
from llmexport.quant.rtn import dequantize
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.reference.streamed import ReferenceLayout, mapped_blocks, streamed_reference
from llmexport.source.checkpoint import CheckpointTensors
from llmexport.spec import LinearRole, LinearSpec, Precomputed, Quantizer

log = logging.getLogger(__name__)


@dataclass
class CalibratedLinears:
    """What calibration produced: a saved result per linear, and why others were left alone."""

    files: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    loss_ratio: dict[str, float] = field(default_factory=dict)  # GPTQ's loss / the base method's
    tokens: int = 0

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def weight(self, name: str) -> Precomputed:
        return Precomputed(torch.load(self.files[name], weights_only=False))

    def summary(self) -> str:
        ratios = sorted(self.loss_ratio.values())
        median = ratios[len(ratios) // 2] if ratios else float("nan")
        return (f"{len(self.files)} linear(s) GPTQ-rounded on {self.tokens} tokens (median calibration loss "
                f"{median:.2f}x the scheme's own), {len(self.skipped)} left to the scheme's method")


def calibrate(arch: Architecture, calibration: Calibration, scheme_of: Callable[[LinearSpec], QuantScheme],
              quantizers: Mapping[QuantMethod, Quantizer], folder: Path,
              trust_remote_code: bool = False) -> CalibratedLinears:
    """GPTQ results for ``arch``'s text linears (module docstring), saved under ``folder``
    (``trust_remote_code``: the family's reference is the checkpoint's own code, K2-Horizon)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(arch.checkpoint.path)
    ids = calibration_windows(tokenizer, read_texts(calibration.data), calibration).reshape(-1)
    folder.mkdir(parents=True, exist_ok=True)
    out = CalibratedLinears(tokens=int(ids.numel()))
    model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights), trust_remote_code)
    head = cast(Any, model).get_output_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    targets = _targets(arch, model, head_name, scheme_of, quantizers, out)
    layout = ReferenceLayout.of(model)
    for module_name, spec in targets.items():
        if layout.block_of(module_name) is None:  # resident (Gemma4's PLE projection): runs once, stays fp
            out.skipped[spec.name] = "outside the decoder blocks"
    for block_name in layout.blocks:
        inside = {ref: spec for ref, spec in targets.items() if ref == block_name or ref.startswith(block_name + ".")}
        if block_name == head_name and inside:
            _calibrate_head(arch, head, inside[head_name], scheme_of, quantizers, folder, out)
        elif inside:
            _calibrate_block(arch, model.get_submodule(block_name), block_name, inside, scheme_of, quantizers,
                             folder, out)
    with mapped_blocks(), torch.no_grad():  # every position reaches the head (which returns no logits here)
        arch.reference_logits(model, ids, first=0)
    for name, reason in out.skipped.items():
        log.debug("calibration: %s left to the scheme's method (%s)", name, reason)
    log.info("calibration: %s", out.summary())
    return out


def _targets(arch: Architecture, model: nn.Module, head_name: str, scheme_of: Callable[[LinearSpec], QuantScheme],
             quantizers: Mapping[QuantMethod, Quantizer], out: CalibratedLinears) -> dict[str, LinearSpec]:
    """Reference module name -> the linear it calibrates (the rest go to ``out.skipped``); the
    lm_head is the reference's output embedding, tied or not."""
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    targets: dict[str, LinearSpec] = {}
    for spec in arch.linears():
        scheme = scheme_of(spec)
        module = reference_linear(arch, spec, head_name, linears)
        if scheme.is_fp16 or scheme.method not in quantizers:
            out.skipped[spec.name] = "not quantized by a calibratable method"
        elif module is None or module in targets:
            out.skipped[spec.name] = "not one nn.Linear of the reference"
        else:
            targets[module] = spec
    return targets


def reference_linear(arch: Architecture, spec: LinearSpec, head_name: str, linears: set[str]) -> str | None:
    """The reference's ``nn.Linear`` (module name, among ``linears``) whose weight is ``spec``'s
    whole weight; None for an expert row, a slice of a stacked parameter or no such module.
    The lm_head is the reference's output embedding (``head_name``), tied or not."""
    source = arch.linear_source(spec.name)
    reference, index = arch.reference_slot(source.weight)
    if spec.role is LinearRole.LM_HEAD:
        return head_name if head_name in linears else None
    module = reference.removesuffix(".weight")
    return None if source.expert is not None or index != () or module not in linears else module


def _calibrate_block(arch: Architecture, block: nn.Module, block_name: str, targets: dict[str, LinearSpec],
                     scheme_of: Callable[[LinearSpec], QuantScheme], quantizers: Mapping[QuantMethod, Quantizer],
                     folder: Path, out: CalibratedLinears) -> None:
    """Make ``block`` run twice per call: once collecting its linears' Hessians, then, after GPTQ
    has replaced their weights, for its output."""
    linears = {name: cast(nn.Linear, block.get_submodule(name[len(block_name) + 1:])) for name in targets}
    original = block.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        hessians: dict[str, torch.Tensor] = {}
        hooks = [linear.register_forward_pre_hook(_accumulate(hessians, name)) for name, linear in linears.items()]
        try:
            original(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        for name, spec in targets.items():
            if name in hessians:
                _round(arch, linears[name], spec, hessians.pop(name), scheme_of(spec), quantizers, folder, out)
            else:  # a routed expert no calibration token chose
                out.skipped[spec.name] = "not reached by the calibration tokens"
        return original(*args, **kwargs)

    block.forward = types.MethodType(forward, block)


def _calibrate_head(arch: Architecture, head: nn.Module, spec: LinearSpec,
                    scheme_of: Callable[[LinearSpec], QuantScheme], quantizers: Mapping[QuantMethod, Quantizer],
                    folder: Path, out: CalibratedLinears) -> None:
    """The lm_head rounds on its input and returns a placeholder: it is the last block, and the
    logits of every calibration position would not fit beside a real vocabulary."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1, x.shape[-1]).double()
        _round(arch, cast(nn.Linear, self), spec, flat.T @ flat, scheme_of(spec), quantizers, folder, out)
        return x.new_zeros(*x.shape[:-1], 1)

    head.forward = types.MethodType(forward, head)


def _accumulate(hessians: dict[str, torch.Tensor], name: str) -> Callable[..., None]:
    """A forward pre-hook adding ``X^T X`` of a linear's input (fp64) to ``hessians[name]``."""
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
        hessians[name] = x.T @ x + hessians[name] if name in hessians else x.T @ x

    return hook


def _round(arch: Architecture, linear: nn.Linear, spec: LinearSpec, hessian: torch.Tensor, scheme: QuantScheme,
           quantizers: Mapping[QuantMethod, Quantizer], folder: Path, out: CalibratedLinears) -> None:
    """GPTQ one linear, save the result, and give the reference what the record decodes to (row
    group by row group: a real lm_head in fp32 is gigabytes)."""
    source = arch.linear_weight(spec.name)[0]
    weight = source.float() if isinstance(source, torch.Tensor) and source.shape == linear.weight.shape else None
    if weight is None or not torch.equal(weight, linear.weight):
        out.skipped[spec.name] = "the export's weight is not the reference's parameter"
        return
    base = quantizers[scheme.method]
    block = scheme.block_for(weight.shape[1])
    rounded = gptq(weight, hessian, scheme.bits, block, scheme.sym, base)
    result = rounded.levels
    out.loss_ratio[spec.name] = rounded.loss / rounded.base_loss if rounded.base_loss > 0 else 1.0
    path = folder / f"{len(out.files):05d}.pt"
    torch.save(result, path)
    out.files[spec.name] = path
    step = max(1, ROW_ELEMENTS // weight.shape[1])
    with torch.no_grad():
        for start in range(0, weight.shape[0], step):
            rows = slice(start, start + step)
            linear.weight[rows] = dequantize(result.rows(rows))
