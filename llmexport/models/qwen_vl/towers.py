"""The Qwen vision tower (Qwen3.5's, and Qwen3-VL's with DeepStack) as an exported ``Tower``: its
tensors, runtime keys and what verification checks of it (the graph: vision.py; the runtime's
inputs: media/qwen_vl.py). With ``deepstack`` (Qwen3-VL's tower, models/qwen3_vl/family.py) the
graph has a second output, the DeepStack levels, and the runtime key ``has_deepstack``."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmexport.media.image import synthetic_image
from llmexport.media.qwen_vl import IMAGE_MEAN, IMAGE_NORM, hf_pixel_values, runtime_pixels, vision_inputs
from llmexport.models.gemma4.towers import TextRowTower
from llmexport.models.qwen_vl.vision import INPUTS, QwenVisionGraph, parse_vision_args, vision_constants, vision_linears
from llmexport.models.tensor_checks import Shapes, finite_lookup
from llmexport.models.tower_check import FeatureCase, Measure, PromptCase, PromptLogits, TowerCheck
from llmexport.spec import GraphInputs

#: the token ids the runtime keys name, under Qwen3_5Config's keys
VISION_TOKENS: dict[str, tuple[str, ...]] = {
    "vision_start_token_id": ("vision_start_token_id",), "vision_end_token_id": ("vision_end_token_id",),
    "image_token_id": ("image_token_id",)}
#: the runtime's square when a prompt names no ``<hw>`` (rounded to a multiple of 32 by omni.cpp)
IMAGE_SIZE = 448
FEATURE_BOUND = 1e-3  # max relative error of visual.mnn vs HF image features (stored weights), as Gemma's
#: (height, width) of the tower-alone cases: square, wide, tall
FEATURE_SIZES = ((64, 64), (64, 96), (96, 64))
#: the image prompts: a square image, and a taller than wide one (the runtime's positions differ there)
PROMPT_SIZES = ((64, 64), (96, 64))
PROMPT_HEAD = "<|im_start|>user\n"
QUESTION = "Describe this picture in a few words."  # the user's words after the image
PROMPT_TAIL = QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
TRACE_SIZE = (64, 96)


class QwenVisionTower(TextRowTower):
    """The vision tower of a multimodal ``qwen3_5`` / ``qwen3_5_moe`` checkpoint (Gemma4Tower holds
    the linears' bookkeeping the towers share)."""

    name = "visual"
    #: the tower has Qwen3-VL's DeepStack mergers (vision.py)
    deepstack = False

    def __init__(self, arch, vision_config: dict[str, Any]):
        super().__init__(arch, vision_config, partial(parse_vision_args, deepstack=self.deepstack), vision_linears,
                         VISION_TOKENS, "a vision")

    def expected_tensors(self) -> Shapes:
        return {**vision_constants(self.args), **self.linear_tensors(False)}

    def build_graph(self, token_tail: torch.Tensor | None = None) -> nn.Module:
        if token_tail is not None:
            raise ValueError("Qwen3.5's runtime token rows have no tail")
        return QwenVisionGraph(self.args, self._linears,
                                  finite_lookup(self.checkpoint.weights, self.checkpoint.path)).eval()

    def inputs(self, image) -> dict[str, np.ndarray]:
        """The runtime's inputs for an image kept at its size (media/qwen_vl.py)."""
        return vision_inputs(runtime_pixels(image), self.args.patch, self.args.grid_side).feeds()

    def graph_inputs(self) -> GraphInputs:
        feeds = self.inputs(synthetic_image(*TRACE_SIZE, seed=0))
        axes = {"patches": {0: "patches"}, "position_ids": {1: "patches"},
                "attention_mask": {1: "patches", 2: "patches_k"}, "idx_tensor": {1: "patches"},
                "weight_tensor": {1: "patches"}}
        outputs = ["image_embeds", "deepstack_embeds"] if self.args.deepstack else ["image_embeds"]
        return GraphInputs(tuple(torch.from_numpy(feeds[name]) for name in INPUTS), list(INPUTS), axes, outputs)

    def llm_config(self) -> dict[str, Any]:
        deepstack = {"has_deepstack": True} if self.args.deepstack else {}
        return deepstack | {"is_visual": True, "visual_model": "visual.mnn", "image_size": IMAGE_SIZE,
                "image_mean": [IMAGE_MEAN] * 3, "image_norm": [IMAGE_NORM] * 3,
                "num_grid_per_side": self.args.grid_side,
                "vision_start": self.ids["vision_start_token_id"], "vision_end": self.ids["vision_end_token_id"],
                "image_pad": self.ids["image_token_id"]}

    def check(self) -> TowerCheck:
        """``visual.mnn`` alone on the runtime's inputs for ``FEATURE_SIZES`` synthetic images vs HF's
        image features of its processor's pixel values (stored weights: max relative error <
        ``FEATURE_BOUND``; fp32 weights: reported), and the ``PROMPT_SIZES`` image prompts through
        the runtime (``<img><hw>`` tag) vs HF's full model on the same ids."""
        images = [synthetic_image(h, w, seed=seed) for seed, (h, w) in enumerate(FEATURE_SIZES)]
        cases = tuple(FeatureCase(f"image {h}x{w}", self.inputs(image), {"size": [h, w]})
                      for (h, w), image in zip(FEATURE_SIZES, images))
        hf = [hf_pixel_values(image, self.args.patch) for image in images]
        prompts = tuple(self._prompt(synthetic_image(h, w, seed=10 + i)) for i, (h, w) in enumerate(PROMPT_SIZES))
        return TowerCheck(
            output="image_embeds", cases=cases, cases_key="images", feature_bound=FEATURE_BOUND,
            features=lambda model: [image_features(model, pixels, grid) for pixels, grid in hf],
            measures={"soft_tokens": Measure.ROWS, "rel_err": Measure.REL_ERR, "max_abs_err": Measure.MAX_ABS_ERR,
                      "rel_err_fp32": Measure.REL_ERR_FP32},
            prompts=prompts, prompt_logits=prompt_logits, stop_ids=frozenset(self.ids.values()), bos_id=None)

    def _prompt(self, image) -> PromptCase:
        """``PROMPT_HEAD`` + the image + ``PROMPT_TAIL``: HF's ids are the runtime's layout
        (vision start, the soft tokens as image pads, vision end), with HF's processor outputs and
        ``mm_token_type_ids``."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint.path)
        pixels, grid = hf_pixel_values(image, self.args.patch)
        tokens = grid[1] * grid[2] // 4
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        ids = self.ids
        image_ids = [ids["vision_start_token_id"]] + [ids["image_token_id"]] * tokens + [ids["vision_end_token_id"]]
        input_ids = torch.tensor([encode(PROMPT_HEAD) + image_ids + encode(PROMPT_TAIL)])
        inputs = {"input_ids": input_ids, "pixel_values": torch.from_numpy(pixels),
                  "image_grid_thw": torch.tensor([grid]),
                  "mm_token_type_ids": (input_ids == ids["image_token_id"]).int()}
        h, w = image.height, image.width

        def runtime_text(folder: Path) -> str:
            image.save(folder / "image.png")
            return f"{PROMPT_HEAD}<img><hw>{h},{w}</hw>{folder / 'image.png'}</img>{PROMPT_TAIL}"

        return PromptCase(f"{h}x{w}", f"image prompt {h}x{w}", inputs, runtime_text,
                          {"image": [h, w], "soft_tokens": tokens}, QUESTION)


def image_features(model, pixel_values: np.ndarray, grid: list[int]) -> torch.Tensor:
    """HF's image soft tokens [n, text hidden] (``Qwen3_5Model.get_image_features``)."""
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixel_values), torch.tensor([grid])).pooler_output
    return torch.cat(list(out)).float()


def prompt_logits(model, prompt: PromptCase) -> PromptLogits:
    """HF's ``Qwen3_5ForConditionalGeneration`` on a prompt's processor outputs followed by
    generated ids (``mm_token_type_ids`` 0 for those): positions from its own ``get_rope_index``."""
    n = len(prompt.ids)

    def logits(ids: list[int], first: int = 0) -> torch.Tensor:
        if ids[:n] != prompt.ids:
            raise ValueError("ids must extend the prompt's ids")
        types = torch.cat([prompt.inputs["mm_token_type_ids"][0], torch.zeros(len(ids) - n, dtype=torch.int32)])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), pixel_values=prompt.inputs["pixel_values"],
                        image_grid_thw=prompt.inputs["image_grid_thw"], mm_token_type_ids=types.view(1, -1),
                        use_cache=False, logits_to_keep=torch.arange(first, len(ids)))
        return out.logits[0].float()

    return logits
