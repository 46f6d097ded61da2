"""Qwen3-VL multimodal exports in MNN, from one ``--verify`` on the command line: ``visual.mnn``
and image prompts through the runtime's ``<img>`` path, where the DeepStack levels reach the text
graph as omni.cpp builds them, against HF's full model carrying the stored weights, and the media
conversation (an image turn then two text turns through the chat path)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from families import parametrize
from helpers import assert_media_conversation, cli_verified_visual, media_conversation_check


@pytest.fixture(scope="module")
def verified(tiny_qwen3_vl, tmp_path_factory):
    """One command-line export with ``--verify`` (8-bit text, a 4-bit tower, the exact runtime
    profile; the fast profile passes too, docs/supported-models.md): (export folder, the report's
    visual section)."""
    out = tmp_path_factory.mktemp("qwen3_vl-verified") / "out"
    return out, cli_verified_visual(tiny_qwen3_vl, out, "--quant_bit", "8", "--visual_quant_bit", "4",
                                    "--runtime_profile", "exact")


@pytest.mark.slow
@parametrize("mnn", "bits", [4], "qwen3_vl")
def test_cli_verify_visual_mnn_and_image_prompts(verified, bits):
    """``visual.mnn``'s soft tokens alone vs HF's image features, and the image prompts through
    the runtime's ``<img>`` path (the DeepStack levels reaching the text graph as omni.cpp builds
    them) teacher-forced along HF's 16 greedy steps, HF carrying the stored weights."""
    out, visual = verified
    assert len(visual["prompts"]) == 2 and all(case["rel_err"] < 1e-5 for case in visual["images"])
    # the 4-bit tower's stored weights are visibly not the checkpoint's: the oracle is what matters
    assert all(case["rel_err_fp32"] > 1e-3 for case in visual["images"])
    for prompt in visual["prompts"]:
        forced = prompt["forced"]
        print(f"\nqwen3_vl visual q{bits} image prompt {prompt['label']}: top-1 {forced['top1_agreement']:.0%}, "
              f"max |dlogit| {forced['max_abs_err']:.2e}; vs fp32 HF {prompt['fp32']['max_abs_err']:.2e}")
        assert prompt["ids_match"] and prompt["greedy_mnn"] == prompt["greedy_ref"] and len(prompt["greedy_mnn"]) == 16
        assert forced["top1_agreement"] == 1.0 and forced["max_abs_err"] < 1e-3
    assert_media_conversation(f"qwen3_vl visual q{bits}", visual)
    config = json.loads((out / "llm_config.json").read_text())
    assert config["has_deepstack"] and config["is_mrope"] and config["is_visual"]


@pytest.mark.slow
def test_visual_mnn_deepstack_output_matches_stored_weights_hf(tiny_qwen3_vl, verified):
    """``visual.mnn``'s second output alone, on the runtime's inputs for a tall image, vs HF's
    DeepStack features (HF carrying the stored weights; fp32 HF reported)."""
    from test_qwen3_vl import hf_features

    from llmexport.media.image import synthetic_image
    from llmexport.mnn.runtime import run_module
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.verification.verify import reference_pair, stored_tensors

    arch = open_architecture(Checkpoint.open(tiny_qwen3_vl))
    (tower,) = arch.towers()
    stored, fp32 = reference_pair(arch, stored_tensors(verified[0], arch))
    image = synthetic_image(96, 64, seed=3)
    (out,) = run_module(verified[0] / "visual.mnn", [tower.inputs(image)], ["deepstack_embeds"])
    levels = torch.from_numpy(out["deepstack_embeds"])
    ref, ref32 = hf_features(stored, image)[1], hf_features(fp32, image)[1]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    print(f"\nqwen3_vl visual.mnn deepstack 96x64: rel err {rel(levels, ref):.2e} vs stored weights, "
          f"{rel(levels, ref32):.2e} vs fp32")
    assert levels.shape == ref.shape == (2, 6, 64) and rel(levels, ref) < 1e-5 and rel(levels, ref32) > 1e-3


@pytest.mark.slow
def test_hf_without_deepstack_fails_the_media_conversation(tiny_qwen3_vl, verified):
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

    chat, failures = media_conversation_check(tiny_qwen3_vl, verified[0], without_deepstack)
    print(f"\nqwen3_vl media conversation, HF without DeepStack: max |dlogit| per turn "
          f"{[f'{t.oracle.max_abs_err:.2e}' for t in chat.turns]}")
    assert len(chat.turns) == 3 and any("max abs logit error" in f for f in failures)
