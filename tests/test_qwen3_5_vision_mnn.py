"""Qwen3.5 multimodal exports in MNN: ``visual.mnn`` (16/8/4-bit tower linears, 8 through the
command line) alone against HF's ``get_image_features`` carrying the stored weights, image prompts
through the runtime's ``<img>`` path (a square and a taller than wide image, 16 greedy steps)
against HF's full model, a wrong output scale caught, and ``--verify`` on the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from families import parametrize
from helpers import assert_media_conversation, cli_verified_visual, image_conversation, tower_exports, tower_report

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
    # the media conversation: the chat path on an image turn (prefilled in one call) and two text
    # turns (a recurrent export: the kept history replayed in one call, then the new text with a
    # text position table) against HF's full model with the image on the same ids
    assert_media_conversation("qwen3_5 q8", visual)


def _whole_history_positions(tower, prompt, turn):
    """What the text graph would use in a chat turn whose prefill after the kept cache read the
    whole history's M-RoPE table (the image's 2-D positions near its head) from its head, moved on
    by ``all_seq_len`` (omni.cpp ``Omni::gen_position_ids``), after the graph's correction
    ``hf_relative_positions``; decode steps at ``all_seq_len``."""
    from llmexport.models.qwen_vl.mrope import hf_relative_positions, runtime_positions

    grid = prompt.inputs["image_grid_thw"][0].tolist()
    start = turn.ids.index(tower.ids["vision_start_token_id"])
    soft = grid[1] * grid[2] // 4
    table = runtime_positions([start, (grid[1] // 2, grid[2] // 2), len(turn.ids) - start - soft - 2])
    calls = [(0, turn.kept), (turn.kept, len(turn.ids))] if turn.kept else [(0, len(turn.ids))]
    parts = [hf_relative_positions(table[:, :end - first] + first) for first, end in calls]
    parts += [torch.full((3, 1), float(len(turn.ids) + i)) for i in range(len(turn.answer) - 1)]
    return torch.cat(parts, 1).long()


@pytest.mark.slow
def test_whole_history_positions_would_move_the_image_conversation(checkpoint, exported):
    """The media conversation of ``--verify`` (test above) is not vacuous about the later turns'
    positions: HF fed the positions that the whole history's M-RoPE table would give the later
    turns' prefills (a runtime reading it from its head) differs visibly from HF's own, on the
    runtime's chat turns."""
    tower, prompt, run, oracle = image_conversation(checkpoint, exported(16))  # 96x64: taller than wide
    logits = tower.check().prompt_logits(oracle, prompt)
    moved = []
    for turn in run.turns[1:]:
        context = turn.ids + turn.answer[:-1]
        types = torch.zeros(len(context), dtype=torch.int32)
        types[:len(prompt.ids)] = prompt.inputs["mm_token_type_ids"][0]
        positions = _whole_history_positions(tower, prompt, turn).view(3, 1, -1)
        with torch.no_grad():
            whole = oracle(input_ids=torch.tensor([context]), pixel_values=prompt.inputs["pixel_values"],
                           image_grid_thw=prompt.inputs["image_grid_thw"], mm_token_type_ids=types.view(1, -1),
                           use_cache=False, logits_to_keep=torch.arange(len(turn.ids) - 1, len(context)),
                           position_ids=positions).logits[0].float()
        moved.append(float((whole - logits(context, len(turn.ids) - 1)).abs().max()))
    print(f"\nqwen3_5 image conversation, HF on the whole history's table vs HF, per later turn: {moved}")
    assert len(moved) == 2 and all(m > 0.05 for m in moved)
