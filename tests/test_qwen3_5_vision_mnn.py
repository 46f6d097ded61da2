"""Qwen3.5 multimodal exports in MNN: ``visual.mnn`` (16/8/4-bit tower linears, 8 through the
command line) alone against HF's ``get_image_features`` carrying the stored weights, image prompts
through the runtime's ``<img>`` path (a square and a taller than wide image, 16 greedy steps)
against HF's full model, a wrong output scale caught, and ``--verify`` on the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from families import parametrize
from helpers import cli_verified_visual, tower_exports, tower_report

BITS = (16, 4)  # 8 bits: the command line export below


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen3_5):
    return tiny_qwen3_5("qwen3_5")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return tower_exports(checkpoint, tmp_path_factory.mktemp)


@pytest.mark.slow
@parametrize("mnn", "bits", BITS, "qwen3_5")
def test_visual_mnn_and_image_prompts_match_stored_weights_hf(checkpoint, exported, bits):
    report = tower_report(checkpoint, exported(bits))
    assert report.passed, report.failures
    for case in report.cases:
        print(f"\nqwen3_5 visual q{bits} image {case['size']}: rel err {case['rel_err']:.2e} vs stored weights, "
              f"{case['rel_err_fp32']:.2e} vs fp32")
        assert case["soft_tokens"] == case["size"][0] * case["size"][1] // 1024
        assert case["rel_err"] < 1e-5
        if bits == 4:  # the stored weights are visibly not the checkpoint's: the oracle is what matters
            assert case["rel_err_fp32"] > 1e-3
    for prompt in report.prompts:  # the runtime's <img> path vs HF's model, teacher-forced on 16 greedy steps
        forced = prompt.forced
        print(f"qwen3_5 q{bits} image prompt {prompt.label}: top-1 {forced.top1_agreement:.0%}, max |dlogit| "
              f"{forced.max_abs_err:.2e}; vs fp32 HF {prompt.fp32.max_abs_err:.2e}")
        assert prompt.ids_match and prompt.greedy_match and len(prompt.greedy_mnn) == 16
        assert forced.top1_agreement == 1.0 and forced.max_abs_err < 1e-3
    config = json.loads((exported(bits) / "llm_config.json").read_text())
    assert config["is_visual"] and config["is_mrope"] and config["num_grid_per_side"] == 4


@pytest.mark.slow
def test_a_wrong_output_scale_fails(checkpoint, exported):
    report = tower_report(checkpoint, exported(16), lambda c: dataclasses.replace(c, output_scale=1.01), media=False)
    assert not report.passed and "relative error" in report.failures[0]


@pytest.mark.slow
def test_cli_verify_on_qwen3_5_multimodal(checkpoint, tmp_path):
    visual = cli_verified_visual(checkpoint, tmp_path / "out", "--quant_bit", "8")
    assert len(visual["prompts"]) == 2 and all(case["rel_err"] < 1e-5 for case in visual["images"])
    for prompt in visual["prompts"]:
        print(f"\nqwen3_5 q8 image prompt {prompt['label']}: greedy mnn {prompt['greedy_mnn']} vs hf "
              f"{prompt['greedy_ref']}, forced {prompt['forced']['top1_agreement']:.0%} top-1, max |dlogit| "
              f"{prompt['forced']['max_abs_err']:.2e}; vs fp32 HF {prompt['fp32']['max_abs_err']:.2e}")
        assert prompt["ids_match"] and prompt["greedy_mnn"] == prompt["greedy_ref"] and prompt["bos_count"] == 0
        assert prompt["forced"]["top1_agreement"] == 1.0
