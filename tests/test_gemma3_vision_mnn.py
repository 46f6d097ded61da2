"""Gemma3 multimodal exports in MNN: ``visual.mnn`` (16/8/4-bit tower linears) run alone against
HF's ``get_image_features`` carrying the stored weights, a wrong output scale caught, and
``--verify`` on the command line (text prompts, the conversation, the tower alone, an image
prompt through the runtime and the media conversation: an image turn then two text turns)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmexport.tiny.gemma3 import build_tiny_gemma3

from families import parametrize
from helpers import (
    assert_media_conversation,
    cli_verified_visual,
    media_conversation_check,
    tower_exports,
    tower_report,
)

BITS = (16, 8, 4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3-vision"), vision=True)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return tower_exports(checkpoint, tmp_path_factory.mktemp)


@pytest.mark.slow
@parametrize("mnn", "bits", BITS, "gemma3")
def test_visual_mnn_matches_stored_weights_hf(checkpoint, exported, bits):
    report = tower_report(checkpoint, exported(bits))
    assert report.passed, report.failures
    for case in report.cases:
        print(f"\ngemma3 visual q{bits} image {case['seed']}: rel err {case['rel_err']:.2e} vs stored weights, "
              f"{case['rel_err_fp32']:.2e} vs fp32")
        assert case["soft_tokens"] == 16
        assert case["rel_err"] < 1e-5
        if bits == 4:  # the stored weights are visibly not the checkpoint's: the oracle is what matters
            assert case["rel_err_fp32"] > 1e-3
    config = json.loads((exported(bits) / "llm_config.json").read_text())
    assert config["is_visual"] and config["image_size"] == 64 and config["image_pad"] == 9


@pytest.mark.slow
def test_a_wrong_output_scale_fails(checkpoint, exported):
    report = tower_report(checkpoint, exported(16),
                          lambda c: dataclasses.replace(c, output_scale=c.output_scale * 1.01))
    assert not report.passed and "relative error" in report.failures[0]


@pytest.mark.slow
def test_cli_verify_on_gemma3_multimodal(checkpoint, tmp_path):
    visual = cli_verified_visual(checkpoint, tmp_path / "out", "--quant_bit", "8")
    (prompt,) = visual["prompts"]  # the image prompt through the runtime's <img> tag vs HF's full model
    print(f"\ngemma3 q8 image prompt: ids match {prompt['ids_match']}, greedy mnn {prompt['greedy_mnn']} vs hf "
          f"{prompt['greedy_ref']}, forced {prompt['forced']['top1_agreement']:.0%} top-1, max |dlogit| "
          f"{prompt['forced']['max_abs_err']:.2e}; vs fp32 HF {prompt['fp32']['max_abs_err']:.2e}")
    assert prompt["ids_match"] and prompt["greedy_mnn"] == prompt["greedy_ref"] and len(prompt["greedy_ref"]) == 16
    assert prompt["forced"]["top1_agreement"] == 1.0 and prompt["forced"]["max_abs_err"] < 1e-3
    assert_media_conversation("gemma3 q8", visual)


@pytest.mark.slow
def test_hf_given_another_image_fails_the_media_conversation(checkpoint, exported):
    """Not vacuous: HF given the conversation's image flipped (the runtime keeps the right one)
    fails ``--verify``'s media conversation (the chat path on an image turn and two text turns)."""
    def flipped(check):
        *rest, prompt = check.prompts
        inputs = {**prompt.inputs, "pixel_values": prompt.inputs["pixel_values"].flip(-1)}
        return dataclasses.replace(check, prompts=(*rest, dataclasses.replace(prompt, inputs=inputs)))

    chat, failures = media_conversation_check(checkpoint, exported(16), flipped)
    print(f"\ngemma3 media conversation, HF on a flipped image: max |dlogit| per turn "
          f"{[f'{t.oracle.max_abs_err:.2e}' for t in chat.turns]}")
    assert len(chat.turns) == 3 and any("max abs logit error" in f for f in failures)
