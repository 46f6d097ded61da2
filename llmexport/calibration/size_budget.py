"""``--target_bpw``: every text linear's scheme chosen by measured sensitivity per byte.

What the budget counts, the candidates and the allocation are llmexport.quant.budget's; this
module measures each candidate's loss (the sensitivity) and hands llmexport.planning.schemes the choice.

**Sensitivity: a measured KLD.** The loss of a linear at a candidate scheme is the mean KLD of the
next-token distribution of HF's reference model in fp32 with that one linear replaced by what its
record would decode to (the base method's rounding at the candidate's bits and block) from the
unchanged fp32 model, over every position of a token sequence. The reference streams its
weights from the checkpoint one block at a time (llmexport.reference.streamed), so memory is that
of ``--verify``'s reference plus the fp32 log-probabilities of the scored positions.

* with ``--calib_data``: up to ``CALIBRATED_WINDOWS`` windows of ``--calib_seq_len`` tokens spread
  over the user's text as GPTQ's are (its ``--calib_samples`` when fewer), joined into one
  sequence as calibration joins them;
* without it (data-free): ``DATA_FREE_TOKENS`` token ids drawn uniformly from the vocabulary with
  a fixed seed. No text is needed, and the model's own
  layers decide what matters: a linear whose error reaches the logits unattenuated (the lm_head)
  scores high, one whose error the residual stream and the norms absorb scores low. What it
  misses: the activations only real text produces (outlier channels, long-range attention), so a
  linear that matters on text but not on noise is under-rated; and being measured one linear at
  a time, interactions between linears' errors (assumed additive).

A cheaper proxy was tried first and dropped: the output error ``||W - Q||^2`` (or ``tr((W - Q) H
(W - Q)^T)`` with the calibration Hessian) ranks linears by how badly their weights round, in each
linear's own units; on the trained Llama of bench/quality.py it ranked the first layer's
``down_proj`` highest, while the lm_head alone carries ~90% of uniform 4-bit's KLD there
(docs/quantization.md). The measured KLD costs one forward of the model over the windows per
candidate of every linear (3 per linear at the default scheme), and is what the budget
spends bytes on.

Linears the measurement cannot replace (an expert row or a slice of a stacked parameter, no
``nn.Linear`` of the reference holding the export's exact weight) are not candidates: they keep
the base scheme and count as fixed bytes.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Mapping, cast

import torch
from torch import nn

from llmexport.calibration.data import calibration_windows, read_texts
from llmexport.calibration.gptq import reference_linear
from llmexport.errors import UsageError
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.quant.budget import BudgetItem, BudgetSummary, Rung, allocate, budget_bytes, candidate_schemes, summarize
from llmexport.quant.rtn import dequantize
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.reference.streamed import mapped_blocks, streamed_reference
from llmexport.source.checkpoint import CheckpointTensors
from llmexport.spec import LinearSpec, Quantizer

log = logging.getLogger(__name__)

#: the data-free sequence: enough positions that a 4-bit linear's KLD stands out of the noise
DATA_FREE_TOKENS, DATA_FREE_SEED = 512, 0
PROXY_DATA_FREE = f"measured KLD on {DATA_FREE_TOKENS} random tokens (data-free)"
PROXY_CALIBRATED = "measured KLD on the --calib_data windows"
#: calibration windows measured on: each costs one forward per candidate of every linear
CALIBRATED_WINDOWS = 8

#: name -> the estimated loss of each candidate scheme
Losses = dict[str, list[float]]
RecordBytes = Callable[[LinearSpec, QuantScheme], int]


def budget_schemes(arch: Architecture, options: ExportOptions, base_of: Callable[[LinearSpec], QuantScheme],
                   record_bytes: RecordBytes, quantizers: Mapping[QuantMethod, Quantizer]
                   ) -> tuple[BudgetSummary, dict[str, QuantScheme]]:
    """The budget's summary and each chosen text linear's scheme (``base_of``: a linear's scheme
    without a budget; UsageError for a target below what every base scheme takes)."""
    assert options.target_bpw is not None
    specs = list(arch.linears())
    candidates = {spec.name: candidate_schemes(base_of(spec)) for spec in specs}
    candidates = {name: rungs for name, rungs in candidates.items() if len(rungs) > 1}
    weights = sum(spec.out_features * spec.in_features for spec in specs)
    smallest = sum(record_bytes(spec, base_of(spec)) for spec in specs)
    if budget_bytes(options.target_bpw, weights) < smallest:  # refused before the measurement, which takes time
        raise UsageError(f"--target_bpw: {options.target_bpw:g} bits per weight is below the smallest candidate: "
                         f"every linear at --quant_bit {options.quant.bits}, --quant_block {options.quant.block} "
                         f"takes {8 * smallest / weights:.3f}")
    losses, proxy = _losses(arch, options, specs, candidates, quantizers)
    items, fixed_bytes, fixed_weights = [], 0, 0
    for spec in specs:
        if spec.name not in losses:
            fixed_bytes += record_bytes(spec, base_of(spec))
            fixed_weights += spec.out_features * spec.in_features
            continue
        rungs = tuple(Rung(s, s.block_for(spec.in_features), record_bytes(spec, s), loss)
                      for s, loss in zip(candidates[spec.name], losses[spec.name]))
        items.append(BudgetItem(spec.name, spec.out_features * spec.in_features, rungs))
    chosen = allocate(items, budget_bytes(options.target_bpw, weights), fixed_bytes)
    summary = summarize(items, chosen, options.target_bpw, fixed_bytes, fixed_weights, proxy)
    log.info("--target_bpw %g: %.3f bits per weight reached (%d of %d linears upgraded; %s)", options.target_bpw,
             summary.achieved_bpw, sum(1 for i in chosen.values() if i), len(items), proxy)
    return summary, {item.name: item.rungs[chosen[item.name]].scheme for item in items}


def _losses(arch: Architecture, options: ExportOptions, specs: list[LinearSpec],
            candidates: Mapping[str, tuple[QuantScheme, ...]], quantizers: Mapping[QuantMethod, Quantizer]
            ) -> tuple[Losses, str]:
    """Each candidate linear's measured KLD per rung, and the windows it was measured on (module docstring)."""
    ids, proxy = _tokens(arch, options)
    model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights), options.trust_remote_code)
    head = cast(Any, model).get_output_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    losses: Losses = {}
    with mapped_blocks(), torch.no_grad():
        reference = _log_probs(arch, model, ids)
        for spec in specs:
            module = reference_linear(arch, spec, head_name, linears) if spec.name in candidates else None
            if module is None:
                continue
            linear = model.get_submodule(module)
            scores = [_kld(arch, model, linear, spec, s, quantizers, ids, reference) for s in candidates[spec.name]]
            if all(score is not None for score in scores):
                losses[spec.name] = cast(list[float], scores)
            else:
                log.info("--target_bpw: %s keeps the base scheme (its weight is not the reference's parameter)",
                         spec.name)
    return losses, proxy


def _tokens(arch: Architecture, options: ExportOptions) -> tuple[torch.Tensor, str]:
    """The token ids the KLD is measured on: the calibration's windows, else seeded random ids."""
    if options.calibration is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(arch.checkpoint.path)
        calibration = replace(options.calibration, samples=min(options.calibration.samples, CALIBRATED_WINDOWS))
        ids = calibration_windows(tokenizer, read_texts(calibration.data), calibration)
        return ids.reshape(-1), PROXY_CALIBRATED
    generator = torch.Generator().manual_seed(DATA_FREE_SEED)
    return torch.randint(0, arch.describe().vocab_size, (DATA_FREE_TOKENS,), generator=generator), PROXY_DATA_FREE


def _log_probs(arch: Architecture, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return arch.reference_logits(model, ids).double().log_softmax(-1)


def _kld(arch: Architecture, model: nn.Module, linear: nn.Module, spec: LinearSpec, scheme: QuantScheme,
         quantizers: Mapping[QuantMethod, Quantizer], ids: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Mean KLD(reference || the model with ``linear`` at ``scheme``) over every scored position;
    None when the reference's weight is not the export's (a rescaled or fused parameter)."""
    export_weight = arch.linear_weight(spec.name)[0]
    state: dict[str, Any] = {"matches": True}

    def swap(module: nn.Module, _: Any) -> None:
        weight = cast(torch.Tensor, module.weight)
        if not (isinstance(export_weight, torch.Tensor) and torch.equal(export_weight.float(), weight)):
            state["matches"] = False
            return
        state["saved"] = weight.detach().clone()  # residents stay between calls: put them back after
        quantized = quantizers[scheme.method](weight, scheme.bits, scheme.block_for(weight.shape[1]), scheme.sym)
        weight.copy_(dequantize(quantized))

    def restore(module: nn.Module, *_: Any) -> None:
        if "saved" in state:
            cast(torch.Tensor, module.weight).copy_(state.pop("saved"))

    hooks = [linear.register_forward_pre_hook(swap), linear.register_forward_hook(restore, always_call=True)]
    try:
        test = _log_probs(arch, model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return float((reference.exp() * (reference - test)).sum(-1).mean()) if state["matches"] else None
