"""Qwen3-VL multimodal exports in MNN: ``visual.mnn`` (both outputs through the runtime) and image
prompts through the runtime's ``<img>`` path, where the DeepStack levels reach the text graph as
omni.cpp builds them, against HF's full model carrying the stored weights; an image conversation
through the chat path; ``--verify`` on the command line."""

from __future__ import annotations

import json

import pytest
import torch

from families import parametrize
from helpers import cli_verified_visual, image_conversation, tower_exports, tower_report


@pytest.fixture(scope="module")
def exported(tiny_qwen3_vl, tmp_path_factory):
    return tower_exports(tiny_qwen3_vl, tmp_path_factory.mktemp)


@pytest.mark.slow
@parametrize("mnn", "bits", [16], "qwen3_vl")
def test_visual_mnn_and_image_prompts_match_stored_weights_hf(tiny_qwen3_vl, exported, bits):
    report = tower_report(tiny_qwen3_vl, exported(bits))
    assert report.passed, report.failures
    assert all(case["rel_err"] < 1e-5 for case in report.cases)
    for prompt in report.prompts:  # teacher-forced along HF's 16 greedy steps
        forced = prompt.forced
        print(f"\nqwen3_vl q{bits} image prompt {prompt.label}: top-1 {forced.top1_agreement:.0%}, max |dlogit| "
              f"{forced.max_abs_err:.2e}; vs fp32 HF {prompt.fp32.max_abs_err:.2e}")
        assert prompt.ids_match and prompt.greedy_match and len(prompt.greedy_mnn) == 16
        assert forced.top1_agreement == 1.0 and forced.max_abs_err < 1e-3
    config = json.loads((exported(bits) / "llm_config.json").read_text())
    assert config["has_deepstack"] and config["is_mrope"] and config["is_visual"]


@pytest.mark.slow
def test_an_image_conversation_matches_stored_weights_hf(tiny_qwen3_vl, exported):
    """An image turn then two text turns through the runtime's chat path (the text turns' prefills
    get the runtime's zeros for DeepStack) against HF's full model with the image on the same ids.
    Not vacuous: HF without its DeepStack additions differs visibly."""
    tower, prompt, run, oracle = image_conversation(tiny_qwen3_vl, exported(16))
    language = oracle.model.language_model
    errors = []
    for turn in run.turns:
        context = turn.ids + turn.answer[:-1]
        assert context[:len(prompt.ids)] == prompt.ids
        types = torch.zeros(len(context), dtype=torch.int32)
        types[:len(prompt.ids)] = prompt.inputs["mm_token_type_ids"][0]
        inputs = dict(input_ids=torch.tensor([context]), pixel_values=prompt.inputs["pixel_values"],
                      image_grid_thw=prompt.inputs["image_grid_thw"], mm_token_type_ids=types.view(1, -1),
                      use_cache=False, logits_to_keep=torch.arange(len(turn.ids) - 1, len(context)))
        with torch.no_grad():
            hf = oracle(**inputs).logits[0].float().numpy()
            language._deepstack_process = lambda hidden, *_: hidden
            try:
                plain = oracle(**inputs).logits[0].float().numpy()
            finally:
                del language._deepstack_process
        assert (turn.logits.argmax(-1) == hf.argmax(-1)).all()
        errors.append((float(abs(turn.logits - hf).max()), float(abs(plain - hf).max())))
    print(f"\nqwen3_vl image conversation, max |dlogit| per turn (MNN vs HF; HF without DeepStack vs HF): {errors}")
    assert all(err < 1e-3 for err, _ in errors) and all(moved > 0.05 for _, moved in errors)


@pytest.mark.slow
def test_cli_verify_on_qwen3_vl(tiny_qwen3_vl, tmp_path):
    visual = cli_verified_visual(tiny_qwen3_vl, tmp_path / "out", "--quant_bit", "8", "--runtime_profile", "exact")
    assert len(visual["prompts"]) == 2 and all(case["rel_err"] < 1e-5 for case in visual["images"])
    for prompt in visual["prompts"]:
        print(f"\nqwen3_vl q8 image prompt {prompt['label']}: forced {prompt['forced']['top1_agreement']:.0%} top-1, "
              f"max |dlogit| {prompt['forced']['max_abs_err']:.2e}; vs fp32 HF {prompt['fp32']['max_abs_err']:.2e}")
        assert prompt["ids_match"] and prompt["greedy_mnn"] == prompt["greedy_ref"]
        assert prompt["forced"]["top1_agreement"] == 1.0
