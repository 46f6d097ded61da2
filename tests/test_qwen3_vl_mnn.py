"""Qwen3-VL and Qwen3-VL-MoE multimodal exports in MNN, from one ``--verify`` on the command line
each: ``visual.mnn`` and image prompts through the runtime's ``<img>`` path, where the DeepStack
levels reach the text graph as omni.cpp builds them, against HF's full model carrying the stored
weights, and the media conversation (an image turn then two text turns through the chat path)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from families import parametrize
from helpers import assert_media_conversation, cli_verified_visual, media_conversation_check

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
#: one export each, a 4-bit tower: Qwen3-VL 8-bit text in the exact runtime profile, Qwen3-VL-MoE
#: 4-bit text in the fast one (each passes in the other profile too, docs/supported-models.md)
FLAGS = {"qwen3_vl": ("--quant_bit", "8", "--visual_quant_bit", "4", "--runtime_profile", "exact"),
         "qwen3_vl_moe": ("--quant_bit", "4", "--visual_quant_bit", "4", "--runtime_profile", "fast")}


@pytest.fixture(scope="module")
def verified(request, tmp_path_factory):
    """``get(model_type)`` -> (checkpoint, export folder, the report's visual section) of one
    command-line export with ``--verify`` (``FLAGS``), made once."""
    cache: dict[str, tuple] = {}

    def get(model_type: str) -> tuple:
        if model_type not in cache:
            checkpoint = request.getfixturevalue(f"tiny_{model_type}")
            out = tmp_path_factory.mktemp(f"{model_type}-verified") / "out"
            cache[model_type] = checkpoint, out, cli_verified_visual(checkpoint, out, *FLAGS[model_type])
        return cache[model_type]

    return get


@pytest.mark.slow
@parametrize("mnn", "model_type", MODEL_TYPES, lambda model_type: model_type)
def test_cli_verify_visual_mnn_and_image_prompts(verified, model_type):
    """``visual.mnn``'s soft tokens alone vs HF's image features, and the image prompts through
    the runtime's ``<img>`` path (the DeepStack levels reaching the text graph as omni.cpp builds
    them) teacher-forced along HF's 16 greedy steps, HF carrying the stored weights."""
    _, out, visual = verified(model_type)
    assert len(visual["prompts"]) == 2 and all(case["rel_err"] < 1e-5 for case in visual["images"])
    # the 4-bit tower's stored weights are visibly not the checkpoint's: the oracle is what matters
    assert all(case["rel_err_fp32"] > 1e-3 for case in visual["images"])
    for prompt in visual["prompts"]:
        forced = prompt["forced"]
        print(f"\n{model_type} visual q4 image prompt {prompt['label']}: top-1 {forced['top1_agreement']:.0%}, "
              f"max |dlogit| {forced['max_abs_err']:.2e}; vs fp32 HF {prompt['fp32']['max_abs_err']:.2e}")
        assert prompt["ids_match"] and prompt["greedy_mnn"] == prompt["greedy_ref"] and len(prompt["greedy_mnn"]) == 16
        assert forced["top1_agreement"] == 1.0 and forced["max_abs_err"] < 1e-3
    assert_media_conversation(f"{model_type} visual q4", visual)
    config = json.loads((out / "llm_config.json").read_text())
    assert config["has_deepstack"] and config["is_mrope"] and config["is_visual"]


@pytest.mark.slow
def test_visual_mnn_deepstack_output_matches_stored_weights_hf(verified):
    """``visual.mnn``'s second output alone, on the runtime's inputs for a tall image, vs HF's
    DeepStack features (HF carrying the stored weights; fp32 HF reported)."""
    from test_qwen3_vl import hf_features

    from llmexport.media.image import synthetic_image
    from llmexport.mnn.runtime import run_module
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.verification.verify import reference_pair, stored_tensors

    checkpoint, export, _ = verified("qwen3_vl")  # Qwen3-VL-MoE's tower is the same
    arch = open_architecture(Checkpoint.open(checkpoint))
    (tower,) = arch.towers()
    stored, fp32 = reference_pair(arch, stored_tensors(export, arch))
    image = synthetic_image(96, 64, seed=3)
    (out,) = run_module(export / "visual.mnn", [tower.inputs(image)], ["deepstack_embeds"])
    levels = torch.from_numpy(out["deepstack_embeds"])
    ref, ref32 = hf_features(stored, image)[1], hf_features(fp32, image)[1]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    print(f"\nqwen3_vl visual.mnn deepstack 96x64: rel err {rel(levels, ref):.2e} vs stored weights, "
          f"{rel(levels, ref32):.2e} vs fp32")
    assert levels.shape == ref.shape == (2, 6, 64) and rel(levels, ref) < 1e-5 and rel(levels, ref32) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_hf_without_deepstack_fails_the_media_conversation(verified, model_type):
    """Not vacuous: HF without its DeepStack additions fails ``--verify``'s media conversation (an
    image turn then two text turns, whose prefills get the runtime's zeros for DeepStack)."""
    def without_deepstack(check):
        def prompt_logits(model, prompt):
            inner, language = check.prompt_logits(model, prompt), model.model.language_model

            def logits(ids, first=0):
                language._deepstack_process = lambda hidden, *_: hidden
                try:
                    return inner(ids, first)
                finally:
                    del language._deepstack_process

            return logits

        return dataclasses.replace(check, prompt_logits=prompt_logits)

    checkpoint, export, _ = verified(model_type)
    chat, failures = media_conversation_check(checkpoint, export, without_deepstack)
    print(f"\n{model_type} media conversation, HF without DeepStack: max |dlogit| per turn "
          f"{[f'{t.oracle.max_abs_err:.2e}' for t in chat.turns]}")
    assert len(chat.turns) == 3 and any("max abs logit error" in f for f in failures)
