"""Stage 3 (vision): visual.mnn and image+text prompts in MNN's runtime vs HF's full model carrying
the exported weights, for a text hidden size of 1536 (the runtime's hard-coded image scale) and of
64, with and without bidirectional attention over image spans."""

from __future__ import annotations

import json

import PIL  # noqa: E402,F401  (pillow is a dependency)
import pytest

from llmexport import ExportOptions, export
from llmexport.media.image import processed_size, runtime_size, save_image_for_runtime, synthetic_image
from llmexport.mnn.runtime import run_media_prompt
from llmexport.models.gemma4.family import Gemma4
from llmexport.quant.scheme import QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.tokenizer import SPECIAL_TOKENS
from llmexport.verification.towers import verify_tower
from llmexport.verification.verify import reference_pair, stored_tensors, summary_line, verify_export

# name -> (tiny checkpoint, text overrides, text bits, visual bits)
BIDIRECTIONAL = {"use_bidirectional_attention": "vision"}
CASES = {"vision-1536": ("vision-1536", {}, 4, 8), "vision-64": ("vision-64", {}, 16, 16),
         "vision-64-bidirectional": ("vision-64", BIDIRECTIONAL, 16, 8)}
# square, wide, tall and thin, a photo's aspect ratio, tiny: through save_image_for_runtime
HELPER_SIZES = ((300, 300), (200, 640), (1000, 40), (1080, 1920), (20, 30))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(case):
        name, overrides, _, _ = CASES[case]
        if case not in cache:
            cache[case] = build_tiny_multimodal(tmp_path_factory.mktemp(case), name, text_overrides=overrides)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            _, _, text_bits, visual_bits = CASES[case]
            out = tmp_path_factory.mktemp(f"{case}-export") / "out"
            options = ExportOptions(quant=QuantScheme(text_bits, 64), visual_quant_bit=visual_bits)
            export(checkpoints(case), out, options)
            cache[case] = (checkpoints(case), out)
        return cache[case]

    return get


def _tower_report(path, out, **kwargs):
    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    return verify_tower(tower, out, *reference_pair(arch, stored_tensors(out, arch)), tower.check(**kwargs))


@pytest.mark.slow
def test_hidden_1536_tower_and_prompt_agree_with_stored_weights_hf(exported):
    _check(_tower_report(*exported("vision-1536")), "vision-1536")


@pytest.mark.slow
def test_hidden_64_verify_covers_images(exported):
    """``--verify`` (verify_export) runs the text checks and the vision tower's."""
    path, out = exported("vision-64")
    report = verify_export(out, path, steps=16)
    assert report.passed, report.failures
    _check(report.towers["visual"], "vision-64")
    assert json.loads((out / "verify.json").read_text())["towers"]["visual"]["passed"]
    assert "visual ok (prompt vs HF: top-1 100%" in summary_line(report)


@pytest.mark.slow
def test_bidirectional_image_attention_is_exported(exported):
    """use_bidirectional_attention "vision": the runtime agrees with HF's full model, whose mask
    lets the image's soft tokens attend to each other both ways."""
    path, out = exported("vision-64-bidirectional")
    report = verify_export(out, path, steps=16)
    assert report.passed, report.failures
    assert report.towers["visual"].notes["marks_images"]
    _check(report.towers["visual"], "vision-64 bidirectional")


@pytest.mark.slow
@pytest.mark.parametrize("case,marks", [("vision-64-bidirectional", False), ("vision-64", True)])
def test_a_wrong_image_mask_fails_verification(checkpoints, tmp_path, monkeypatch, case, marks):
    """A causal graph for a bidirectional checkpoint, and a bidirectional graph for a causal one:
    the media prompt, checked against HF's full model, must fail."""
    monkeypatch.setattr(Gemma4, "marks_images", property(lambda self: marks))
    path = checkpoints(case)
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64), visual_quant_bit=16))
    report = verify_export(out, path, steps=16)
    (prompt,) = report.towers["visual"].prompts
    print(f"\n{case} exported with marks={marks}: {summary_line(report)}")
    assert not report.passed and not prompt.greedy_match
    assert any(f.startswith("visual: image prompt") for f in report.failures)
    assert "visual FAILED" in summary_line(report) and summary_line(report).startswith("FAIL")


@pytest.mark.slow
def test_image_helper_gives_hfs_answer_for_any_size(exported):
    """``save_image_for_runtime`` (processed size + <hw>) makes the runtime agree with HF's full
    model given the original image, for several sizes and aspect ratios."""
    path, out = exported("vision-64")
    report = _tower_report(path, out, prompt_sizes=HELPER_SIZES)
    for prompt in report.prompts:
        forced, info = prompt.forced, prompt.info
        assert forced is not None
        print(f"\nimage {info['image']} -> {info['processed']} ({info['soft_tokens']} tokens): greedy "
              f"{'match' if prompt.greedy_match else 'DIFFERS'}, top-1 {forced.top1_agreement:.0%}, "
              f"max |dlogit| {forced.max_abs_err:.2e}")
        assert prompt.ids_match and prompt.greedy_match and forced.top1_agreement == 1.0
    assert report.passed, report.failures


@pytest.mark.slow
def test_plain_image_tag_and_persisting_hw(exported, tmp_path):
    """Without <hw> the runtime resizes to ``image_size`` (768) for the first image, and keeps the
    size of the last processed image for later ones: token counts show both."""
    _, out = exported("vision-64")
    image = synthetic_image(200, 640, seed=3)
    image.save(tmp_path / "plain.png")
    fragment = save_image_for_runtime(image, tmp_path / "prepared.png")
    run = run_media_prompt(out, f"<bos>a<img>{tmp_path / 'plain.png'}</img>b{fragment}c<img>{tmp_path / 'plain.png'}"
                                f"</img>d", [], 1)
    counts = _image_token_counts(run.ids)
    h, w = processed_size(200, 640)
    assert counts == [(768 // 48) ** 2, (h // 48) * (w // 48), (h // 48) * (w // 48)]
    assert runtime_size(768, 768) == (768, 768) and counts[0] != counts[1]


def _image_token_counts(ids):
    boi, eoi, image = (SPECIAL_TOKENS[k][1] for k in ("boi", "eoi", "image"))
    counts, n = [], None
    for token in ids:
        if token == boi:
            n = 0
        elif token == image and n is not None:
            n += 1
        elif token == eoi and n is not None:
            counts.append(n)
            n = None
    return counts


def _check(report, name):
    assert report.cases_key == "images"
    for image in report.cases:
        print(f"\n{name} image {image['size']} -> {image['processed']} ({image['soft_tokens']} tokens): "
              f"rel err {image['rel_err']:.2e} vs stored weights, {image['rel_err_fp32']:.2e} vs fp32")
        assert image["rel_err"] < 1e-3
    for prompt in report.prompts:
        forced, fp32 = prompt.forced, prompt.fp32
        assert forced is not None and fp32 is not None
        print(f"{name} image prompt ({prompt.prompt_tokens} tokens, image {prompt.info['image']} -> "
              f"{prompt.info['processed']}): greedy {'match' if prompt.greedy_match else 'DIFFERS'}, top-1 "
              f"{forced.top1_agreement:.0%}, max |dlogit| {forced.max_abs_err:.2e}; vs fp32: top-1 "
              f"{fp32.top1_agreement:.0%}")
        assert prompt.ids_match and prompt.bos_count == 1
        assert prompt.greedy_match and len(prompt.greedy_mnn) == len(prompt.greedy_ref)
        assert forced.top1_agreement == 1.0
    assert report.passed, report.failures


@pytest.mark.slow
def test_export_folder_holds_the_vision_files(exported):
    _, out = exported("vision-64")
    assert {"visual.mnn", "visual.mnn.weight"} <= {p.name for p in out.iterdir()}
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["is_visual"] and llm_config["image_pad"] == 9 and llm_config["visual_model"] == "visual.mnn"
    config = json.loads((out / "config.json").read_text())
    assert config["mllm"]["precision"] == "normal" and config["mllm"]["memory"] == "normal"
