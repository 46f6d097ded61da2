"""Stage 3 (audio): audio.mnn and audio+text prompts in MNN's runtime vs HF's full model carrying
the exported weights, on a checkpoint with both towers (as E2B/E4B have them), through ``--verify``.
Clips reach the runtime through ``save_audio_for_runtime`` (191 zeros appended), which makes its
filterbank compute HF's frames."""

from __future__ import annotations

import json

import PIL  # noqa: E402,F401  (pillow is a dependency)
import pytest

from llmexport import ExportOptions, export
from llmexport.media.audio import (
    HOP,
    RUNTIME_TAIL,
    audio_tokens,
    hf_frame_count,
    runtime_frame_count,
    samples_for_tokens,
    synthetic_clip,
    write_wav,
)
from llmexport.mnn.runtime import run_media_prompt
from llmexport.models.gemma4.tower_checks import PROMPT_HEAD
from llmexport.quant.scheme import QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.tokenizer import SPECIAL_TOKENS
from llmexport.verification.towers import verify_tower
from llmexport.verification.verify import reference_pair, stored_tensors, summary_line, verify_export

# frames = 1 mod 4 (the runtime's unpadded framing loses a token), samples % 160 in 1..31 (it loses
# two frames), 1 s, and several attention chunks
PROMPT_LENGTHS = (samples_for_tokens(3), 16017, 16000, samples_for_tokens(22) + 100)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = build_tiny_multimodal(tmp_path_factory.mktemp("vision-audio"), "vision-audio-64")
    out = tmp_path_factory.mktemp("vision-audio-export") / "out"
    export(path, out, ExportOptions(quant=QuantScheme(4, 64), audio_quant_bit=8, visual_quant_bit=8))
    return path, out, verify_export(out, path, steps=16)


@pytest.mark.slow
def test_audio_tower_matches_hf_features_for_three_lengths(exported):
    _, _, report = exported
    audio = report.towers["audio"]
    chunk = 4
    assert audio.cases_key == "clips"
    tokens = [clip["tokens"] for clip in audio.cases]
    assert tokens[0] < chunk and tokens[1] % chunk and tokens[2] > 2 * chunk
    for clip in audio.cases:
        print(f"\naudio {clip['samples']} samples, {clip['frames']} frames, {clip['tokens']} tokens: rel err "
              f"{clip['rel_err']:.2e} vs stored weights, {clip['rel_err_fp32']:.2e} vs fp32")
        assert clip["mnn_tokens"] == clip["tokens"] and clip["rel_err"] < 1e-3


@pytest.mark.slow
def test_padded_clips_give_hfs_answer(exported):
    """For each length, the runtime on the padded clip agrees with HF's full model on the clip:
    same ids (so the same token count), greedy tokens and top-1 at every teacher-forced step."""
    path, out, _ = exported
    assert [n % HOP for n in PROMPT_LENGTHS][1] in range(1, 32)
    assert hf_frame_count(PROMPT_LENGTHS[0]) % 4 == 1
    arch = open_architecture(Checkpoint.open(path))
    tower = next(t for t in arch.towers() if t.name == "audio")
    report = verify_tower(tower, out, *reference_pair(arch, stored_tensors(out, arch)),
                          tower.check(prompt_lengths=PROMPT_LENGTHS))
    for prompt in report.prompts:
        forced, info = prompt.forced, prompt.info
        assert forced is not None
        print(f"\naudio prompt {info['samples']} samples: frames HF {info['frames']['hf']}, runtime "
              f"{info['frames']['runtime']} (unpadded {info['frames']['runtime_unpadded']}), {info['tokens']} "
              f"tokens: greedy {'match' if prompt.greedy_match else 'DIFFERS'}, "
              f"top-1 {forced.top1_agreement:.0%}, max |dlogit| {forced.max_abs_err:.2e}")
        assert info["frames"]["hf"] == info["frames"]["runtime"] == hf_frame_count(info["samples"])
        assert prompt.ids_match and prompt.bos_count == 1 and prompt.greedy_match
        assert forced.top1_agreement == 1.0
    assert report.passed, report.failures


@pytest.mark.slow
def test_unpadded_clip_loses_a_token(exported, tmp_path):
    """The defect the helper compensates: a clip given as is yields one frame fewer, and for
    frames = 1 mod 4 one audio token fewer than HF's processor writes."""
    _, out, _ = exported
    n = PROMPT_LENGTHS[0]
    write_wav(tmp_path / "clip.wav", synthetic_clip(n, seed=1))
    run = run_media_prompt(out, f"{PROMPT_HEAD}<audio>{tmp_path / 'clip.wav'}</audio>", [], 1)
    got = run.ids.count(SPECIAL_TOKENS["audio"][1])
    assert got == audio_tokens(runtime_frame_count(n)) == audio_tokens(hf_frame_count(n)) - 1
    assert runtime_frame_count(n + RUNTIME_TAIL) == hf_frame_count(n)


@pytest.mark.slow
def test_verify_passes_with_both_towers(exported):
    _, out, report = exported
    assert report.passed, report.failures
    assert report.towers["visual"].passed and report.towers["audio"].passed
    assert json.loads((out / "verify.json").read_text())["towers"]["audio"]["passed"]
    line = summary_line(report)
    assert "visual ok (prompt vs HF: top-1 100%" in line and "audio ok (prompt vs HF: top-1 100%" in line
    assert "visual media conversation: 3/3 turns, prompt ids 3/3" in line
    assert "audio media conversation: 3/3 turns, prompt ids 3/3" in line
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["is_audio"] and llm_config["is_visual"] and llm_config["audio_type"] == "usm"
    assert (llm_config["audio_start"], llm_config["audio_end"], llm_config["audio_pad"]) == (10, 11, 12)
    assert {"audio.mnn", "audio.mnn.weight", "visual.mnn", "visual.mnn.weight"} <= {p.name for p in out.iterdir()}


PROMPT_KEYS = ["prompt_tokens", "ids_match", "greedy_ref", "greedy_mnn", "greedy_match", "forced", "fp32", "failures",
               "label", "stopped_at_media_token", "bos_count"]
SECTION_LAYOUT = {  # section keys, one case's keys, one prompt's own keys after PROMPT_KEYS
    "visual": (["passed", "failures", "output_scale", "marks_images", "feature_bound", "images", "prompts",
                "conversation"],
               ["size", "processed", "soft_tokens", "rel_err", "max_abs_err", "rel_err_fp32"],
               ["image", "processed", "soft_tokens"]),
    "audio": (["passed", "failures", "feature_bound", "clips", "prompts", "conversation"],
              ["samples", "frames", "tokens", "mnn_tokens", "rel_err", "rel_err_fp32"],
              ["samples", "tokens", "frames"]),
}


@pytest.mark.slow
def test_tower_sections_keep_their_layout(exported):
    """verify.json's tower sections, key by key and in order, as the report has always written them."""
    _, out, _ = exported
    towers = json.loads((out / "verify.json").read_text())["towers"]
    assert list(towers) == ["visual", "audio"]
    for name, (section_keys, case_keys, prompt_keys) in SECTION_LAYOUT.items():
        section = towers[name]
        assert list(section) == section_keys
        cases = section[section_keys[-3]]
        assert len(cases) == 3 and all(list(case) == case_keys for case in cases)
        assert [list(p) for p in section["prompts"]] == [PROMPT_KEYS + prompt_keys]
        assert section["feature_bound"] == 1e-3 and section["failures"] == [] and section["passed"] is True
    visual = towers["visual"]
    assert visual["marks_images"] is False and visual["output_scale"] == pytest.approx(39.25 / 8)
    assert [case["size"] for case in visual["images"]] == [[300, 300], [200, 640], [317, 451]]
    assert visual["prompts"][0]["label"] == "317x451" and visual["prompts"][0]["image"] == [317, 451]
    audio = towers["audio"]
    assert [case["tokens"] for case in audio["clips"]] == [case["mnn_tokens"] for case in audio["clips"]]
    assert list(audio["prompts"][0]["frames"]) == ["hf", "runtime", "runtime_unpadded"]
    assert audio["prompts"][0]["label"] == f"{audio['prompts'][0]['samples']} samples"
    for name, section in towers.items():  # an image / a clip turn, then two text turns, through the chat path
        chat = section["conversation"]
        print(f"\ngemma4 {name} media conversation: max |dlogit| per turn "
              f"{[t['oracle']['max_abs_err'] for t in chat['turns']]}, top-1 {chat['top1_agreement']:.0%}")
        assert len(chat["turns"]) == 3 and all(t["prompt_ids_match"] and t["oracle"]["greedy_match"]
                                               for t in chat["turns"])


def test_summary_line_reports_a_failed_audio_prompt():
    """A disagreement on the audio prompt (HF's framing) makes the summary line FAIL and say so."""
    from llmexport.mnn.config import RuntimeProfile
    from llmexport.results import (
        Bounds,
        LogitStats,
        MediaPromptReport,
        RunComparison,
        StepStats,
        TokenizerCheck,
        TowerReport,
        VerifyReport,
    )
    from llmexport.verification.verify import judge

    text = LogitStats(1.0, 1e-5, 1e-6, (StepStats(1e-5, 1e-6, 1.0, True, 1, 1, 0.0, 0.0),))
    prompt = MediaPromptReport(20, True, (3, 4), (3, 5), ("greedy tokens differ",),
                               LogitStats(0.5, 0.7, 0.1, ()), label="16017 samples")
    towers = {"audio": TowerReport(("audio prompt 16017 samples (HF framing): greedy tokens differ",), 1e-3, "clips",
                                   (), (prompt,))}
    oracle, tokenizer = RunComparison.of(text, [3, 4], [3, 4]), TokenizerCheck(True, 7, ())
    bounds = Bounds("exact", 0.005)
    report = VerifyReport(40, 1, tokenizer, RuntimeProfile.EXACT, oracle, text, bounds,
                          judge(bounds, oracle, tokenizer, towers=towers), towers)
    assert report.failures == ("audio: audio prompt 16017 samples (HF framing): greedy tokens differ",)
    line = summary_line(report)
    assert line.startswith("FAIL") and "audio FAILED (prompt vs HF: top-1 50%, greedy DIFFERS" in line
