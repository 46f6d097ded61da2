"""What verification checks of Gemma4's towers, on HF's side: the processor, the media prompts
and HF's full model called as a user calls it (run and compared in llmexport/verification/towers.py).

HF side of a media prompt: ``Gemma4ForConditionalGeneration.forward`` on what ``Gemma4Processor``
returns for the prompt text with its media placeholders and the original image or clip (ids with
the placeholders expanded, ``mm_token_type_ids``, pixel values and patch positions, audio
features and mask). The merge of soft tokens, the PLE rule at media slots and the attention mask
over media spans (``use_bidirectional_attention``) are therefore HF's own, so no difference in any
of them can pass. Greedy steps recompute the whole sequence (no cache), with zero
``mm_token_type_ids`` for generated tokens, which is what HF's ``generate`` does after prefill.

Runtime side: the same text with media tags, the media prepared by ``save_image_for_runtime`` /
``save_audio_for_runtime`` (the one call per medium that gives HF's pixels / frames).

A generated media-token id ends the comparison at that step (``TowerCheck.stop_ids``): the runtime
embeds it as text, HF as padding (``Gemma4Model.forward``), and HF's forward then needs features for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from llmexport.media.audio import save_audio_for_runtime
from llmexport.media.image import save_image_for_runtime
from llmexport.models.tower_check import TowerCheck

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


def processor_inputs(processor, text: str, images=None, audio=None) -> dict[str, torch.Tensor]:
    """HF's inputs for ``text``, which carries the processor's placeholders
    (``processor.image_token``/``audio_token``), and its images (one list per text) or clips."""
    inputs = processor(text=[text], images=None if images is None else [images],
                       audio=audio, add_special_tokens=False, return_tensors="pt")
    return dict(inputs)


class FullModel:
    """All-position logits [seq, vocab] of HF's full model for ``inputs`` (``processor_inputs``)
    followed by generated tokens. The image tower's output of the first call is handed back on
    later calls (``mm_encoder_outputs``, HF's own reuse); audio features are recomputed."""

    def __init__(self, model: nn.Module, inputs: dict[str, torch.Tensor]):
        self.model, self.inputs = model, inputs
        self.media: dict[str, Any] = {k: inputs[k] for k in _MEDIA_KEYS if k in inputs}
        self.encoded: dict[str, Any] | None = None

    @property
    def ids(self) -> list[int]:
        return self.inputs["input_ids"][0].tolist()

    def __call__(self, ids: list[int], first: int = 0) -> torch.Tensor:
        n = self.inputs["input_ids"].shape[1]
        if ids[:n] != self.ids:
            raise ValueError("ids must extend the prompt's ids")
        types = torch.cat([self.inputs["mm_token_type_ids"][0], torch.zeros(len(ids) - n, dtype=torch.long)])
        media = dict(self.media)
        if self.encoded is not None:
            media.pop("pixel_values")
            media.pop("image_position_ids")
            media["mm_encoder_outputs"] = dict(self.encoded)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             mm_token_type_ids=types.view(1, -1), use_cache=False,
                             logits_to_keep=torch.arange(first, len(ids)), **media)
        if "pixel_values" in self.media and self.encoded is None:
            self.encoded = {"image": out.image_outputs}
        return out.logits[0].float()


def media_prompt(processor, kind: str, medium: Any, tail: str) -> tuple[dict[str, torch.Tensor], Callable[[Path], str]]:
    """The prompt ``PROMPT_HEAD + medium + tail`` for one image or clip (``kind`` "images" or
    "audio"): HF's inputs, and the runtime's text once the medium is saved into a folder."""
    savers: dict[str, tuple[Callable[[Any, Path], str], str, str]] = {
        "images": (save_image_for_runtime, processor.image_token, "png"),
        "audio": (save_audio_for_runtime, processor.audio_token, "wav")}
    save, placeholder, suffix = savers[kind]

    def runtime_text(folder: Path) -> str:
        return PROMPT_HEAD + save(medium, folder / f"{kind}.{suffix}") + tail

    return processor_inputs(processor, PROMPT_HEAD + placeholder + tail, **{kind: [medium]}), runtime_text


def tower_check(arch, processor, **fields: Any) -> TowerCheck:
    """A Gemma4 tower's ``TowerCheck``: prompts on HF's full model, ended by a generated media
    token, one BOS from the processor's tokenizer."""
    return TowerCheck(prompt_logits=lambda model, prompt: FullModel(model, prompt.inputs),
                      stop_ids=frozenset(arch.media_token_ids()), bos_id=processor.tokenizer.bos_token_id, **fields)
