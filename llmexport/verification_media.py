"""Media prompts: MNN's runtime through its normal call path vs HF's full model called as a user calls it.

HF side: ``Gemma4ForConditionalGeneration.forward`` on what ``Gemma4Processor`` returns for the
prompt text with its media placeholders and the original image or clip (ids with the
placeholders expanded, ``mm_token_type_ids``, pixel values and patch positions, audio features
and mask). The merge of soft tokens, the PLE rule at media slots and the attention mask over
media spans (``use_bidirectional_attention``) are therefore HF's own, so no difference in any of
them can pass. Greedy steps recompute the whole sequence (no cache), with zero
``mm_token_type_ids`` for generated tokens, which is what HF's ``generate`` does after prefill.

Runtime side: the same text with media tags, the media prepared by ``save_image_for_runtime`` /
``save_audio_for_runtime`` (the one call per medium that gives HF's pixels / frames).

A generated media-token id ends the comparison at that step: the runtime embeds it as text, HF
as padding (``Gemma4Model.forward``), and HF's forward then needs features for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

GREEDY_STEPS = 16
PROMPT_HEAD = "<bos><|turn>user\n"
_MEDIA_KEYS = ("pixel_values", "image_position_ids", "input_features", "input_features_mask")


def hf_processor(path: Path):
    """HF's ``Gemma4Processor`` for the checkpoint at ``path`` (its tokenizer, the PIL image
    processor, the audio feature extractor), without the video processor, whose torchvision
    dependency does not load beside the CPU torch; prompts with images and audio take exactly
    ``Gemma4Processor``'s path."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    class _WithoutVideo(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return _WithoutVideo(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(), tokenizer, None)


@dataclass(frozen=True)
class MediaPrompt:
    """One media+text prompt: HF's processor outputs and the runtime's text with media tags
    (whose files must exist while the prompt is checked)."""

    label: str
    inputs: dict[str, torch.Tensor]
    runtime_text: str

    @property
    def ids(self) -> list[int]:
        return self.inputs["input_ids"][0].tolist()


def media_prompt(processor, label: str, hf_text: str, runtime_text: str, images=None, audio=None) -> MediaPrompt:
    """``hf_text`` carries the processor's placeholders (``processor.image_token``/``audio_token``)."""
    inputs = processor(text=[hf_text], images=None if images is None else [images],
                       audio=audio, add_special_tokens=False, return_tensors="pt")
    return MediaPrompt(label, dict(inputs), runtime_text)


class FullModel:
    """All-position logits [seq, vocab] of HF's full model for ``prompt.inputs`` followed by
    generated tokens. The image tower's output of the first call is handed back on later calls
    (``mm_encoder_outputs``, HF's own reuse); audio features are recomputed."""

    def __init__(self, model, prompt: MediaPrompt):
        self.model, self.prompt = model, prompt
        self.media = {k: prompt.inputs[k] for k in _MEDIA_KEYS if k in prompt.inputs}
        self.encoded: dict[str, Any] | None = None

    def __call__(self, ids: list[int]) -> torch.Tensor:
        prompt = self.prompt.inputs
        n = prompt["input_ids"].shape[1]
        if ids[:n] != self.prompt.ids:
            raise ValueError("ids must extend the prompt's ids")
        types = torch.cat([prompt["mm_token_type_ids"][0], torch.zeros(len(ids) - n, dtype=torch.long)])
        media = dict(self.media)
        if self.encoded is not None:
            media.pop("pixel_values")
            media.pop("image_position_ids")
            media["mm_encoder_outputs"] = dict(self.encoded)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             mm_token_type_ids=types.view(1, -1), use_cache=False,
                             logits_to_keep=torch.arange(len(ids)), **media)
        if "pixel_values" in self.media and self.encoded is None:
            self.encoded = {"image": out.image_outputs}
        return out.logits[0].float()


def reference_greedy(logits_fn: Callable[[list[int]], torch.Tensor], prompt: list[int], steps: int,
                     stop_ids: set[int]) -> tuple[list[int], np.ndarray]:
    """Greedy continuation recomputing the whole sequence each step, and the last-position logits
    of each step (the teacher-forced logits of ``prompt + greedy[:-1]``); stops after a token in
    ``stop_ids`` (media-token ids, see the module docstring)."""
    ids, logits = list(prompt), []
    for _ in range(steps):
        logits.append(logits_fn(ids)[-1].numpy())
        ids.append(int(logits[-1].argmax()))
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt):], np.stack(logits)


def check_prompts(tower, export_dir: Path, stored_text, processor, kind: str, media: list[tuple[str, Any]],
                  tail: str, features: Callable[[Any], list[torch.Tensor]]):
    """One prompt ``PROMPT_HEAD + medium + tail`` per (label, image or clip) of ``media`` (``kind``
    "images" or "audio"), the medium saved for the runtime into a temporary folder, through
    ``check_media_prompts``; returns (prompts, features, fp32 features, reports)."""
    import tempfile

    from llmexport.media.audio import save_audio_for_runtime
    from llmexport.media.image import save_image_for_runtime

    save, placeholder, suffix = {"images": (save_image_for_runtime, processor.image_token, "png"),
                                 "audio": (save_audio_for_runtime, processor.audio_token, "wav")}[kind]
    with tempfile.TemporaryDirectory(prefix="llmexport-media-") as tmp:
        prompts = [media_prompt(processor, label, PROMPT_HEAD + placeholder + tail,
                                PROMPT_HEAD + save(item, Path(tmp) / f"{kind}{i}.{suffix}") + tail, **{kind: [item]})
                   for i, (label, item) in enumerate(media)]
        return (prompts, *check_media_prompts(tower, export_dir, stored_text, prompts,
                                              processor.tokenizer.bos_token_id, features))


def check_media_prompts(tower, export_dir: Path, stored_text, prompts: list[MediaPrompt], bos_id: int,
                        features: Callable[[Any], list[torch.Tensor]]) -> tuple[list, list, list[dict[str, Any]]]:
    """Run ``features`` (the tower-alone references) and each prompt on HF carrying the stored
    weights and on the fp32 HF, then each prompt through MNN's runtime; returns
    (features, fp32 features, one ``compare_prompt`` report per prompt)."""
    from llmexport.mnn.config import EXACT_KERNELS
    from llmexport.mnn.runtime import run_media_prompt
    from llmexport.models.gemma4_towers import reference_passes

    stop = set(tower.arch.media_token_ids())

    def on_oracle(model):
        runs = [reference_greedy(FullModel(model, p), p.ids, GREEDY_STEPS, stop) for p in prompts]
        return features(model), runs

    def on_fp32(model, first):
        forced = [FullModel(model, p)(p.ids + greedy[:-1])[len(p.ids) - 1:].numpy()
                  for p, (greedy, _) in zip(prompts, first[1])]
        return features(model), forced

    (refs, runs), (refs32, forced32) = reference_passes(tower.arch, stored_text, tower.tower_linears(), export_dir,
                                                        tower.name, on_oracle, on_fp32)
    reports = []
    for prompt, (greedy, logits), logits32 in zip(prompts, runs, forced32):
        # the tower and its merging are judged on the exact kernels, whatever profile ships
        run = run_media_prompt(export_dir, prompt.runtime_text, greedy[:-1], len(greedy), config=EXACT_KERNELS)
        report = compare_prompt(run, prompt.ids, greedy, logits, logits32)
        report["label"] = prompt.label
        report["stopped_at_media_token"] = len(greedy) < GREEDY_STEPS
        report["bos_count"] = run.ids.count(bos_id)
        if report["bos_count"] != 1:
            report["failures"].append(f"{report['bos_count']} BOS tokens in the runtime's prompt")
        reports.append(report)
    return refs, refs32, reports


def compare_prompt(run, prompt_ids: list[int], greedy_ref: list[int], ref_logits: np.ndarray,
                   fp32_logits: np.ndarray | None = None) -> dict[str, Any]:
    """Runtime media-prompt run vs HF: token ids, greedy tokens, teacher-forced logits.

    Failures follow the text verification's rule: a teacher-forced top-1 disagreement counts
    unless the oracle's own top-2 margin is below the error measured at that step (a near-tie).
    """
    from llmexport.verification import step_stats, summarize

    report: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "ids_match": run.ids == prompt_ids,
                              "greedy_ref": greedy_ref, "greedy_mnn": run.greedy_ids,
                              "greedy_match": greedy_ref == run.greedy_ids}
    failures = []
    if not report["ids_match"]:
        failures.append(f"runtime prompt ids differ from HF's ({len(run.ids)} vs {len(prompt_ids)} tokens)")
    if report["ids_match"]:
        forced = summarize(step_stats(run.forced_logits, ref_logits))
        report["forced"] = forced
        for i, s in enumerate(forced["per_step"]):
            if not s["top1_match"] and s["ref_top2_margin"] >= s["max_abs_err"]:
                failures.append(f"step {i}: top-1 {s['mnn_top1']} != {s['ref_top1']} "
                                f"(margin {s['ref_top2_margin']:.4f})")
        if fp32_logits is not None:
            report["fp32"] = {k: v for k, v in summarize(step_stats(run.forced_logits, fp32_logits)).items()
                              if k != "per_step"}
    if not report["greedy_match"]:
        failures.append(f"greedy tokens differ: mnn {run.greedy_ids} vs hf {greedy_ref}")
    report["failures"] = failures
    return report


def prompt_summary(name: str, report: dict[str, Any]) -> str:
    """One phrase per tower for the verification summary line."""
    prompts = report.get("prompts", [])
    state = "ok" if report.get("passed") else "FAILED"
    if not prompts:
        return f"{name} {state}"
    if not all(p["ids_match"] for p in prompts):
        return f"{name} {state} (prompt vs HF: token ids DIFFER)"
    top1 = min(p["forced"]["top1_agreement"] for p in prompts)
    err = max(p["forced"]["max_abs_err"] for p in prompts)
    greedy = "greedy match" if all(p["greedy_match"] for p in prompts) else "greedy DIFFERS"
    return f"{name} {state} (prompt vs HF: top-1 {top1:.0%}, {greedy}, max |dlogit| {err:.2e})"
