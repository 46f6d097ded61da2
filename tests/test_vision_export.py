"""Stage 3 (vision): visual.mnn and image+text prompts in MNN's runtime vs HF carrying the exported
weights, for a text hidden size of 1536 (the runtime's hard-coded image scale) and of 64."""

from __future__ import annotations

import json

import pytest

from llmexport import ExportOptions, export
from llmexport.checkpoint import Checkpoint
from llmexport.mnn.readback import read_stored
from llmexport.models import architecture_for
from llmexport.quant.scheme import QuantScheme
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.verification import verify_export

import PIL  # noqa: E402,F401  (pillow is a dependency)
# name -> (text bits, visual bits)
CASES = {"vision-1536": (4, 8), "vision-64": (16, 16)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = build_tiny_multimodal(tmp_path_factory.mktemp(name), name)
            text_bits, visual_bits = CASES[name]
            out = tmp_path_factory.mktemp(f"{name}-export") / "out"
            export(path, out, ExportOptions(quant=QuantScheme(text_bits, 64), visual_quant_bit=visual_bits))
            cache[name] = (path, out)
        return cache[name]

    return get


def _tower_report(path, out):
    arch = architecture_for(Checkpoint.open(path))
    (tower,) = arch.towers()
    return tower.verify(out, read_stored(out, arch))


@pytest.mark.slow
def test_hidden_1536_tower_and_prompt_agree_with_stored_weights_hf(exported):
    path, out = exported("vision-1536")
    report = _tower_report(path, out)
    _check(report, "vision-1536")


@pytest.mark.slow
def test_hidden_64_verify_covers_images(exported):
    """``--verify`` (verify_export) runs the text checks and the vision tower's."""
    path, out = exported("vision-64")
    report = verify_export(out, path, steps=16)
    assert report["passed"], report["failures"]
    _check(report["towers"]["visual"], "vision-64")
    assert json.loads((out / "verify.json").read_text())["towers"]["visual"]["passed"]


def _check(report, name):
    for image in report["images"]:
        print(f"\n{name} image {image['size']} -> {image['processed']} ({image['soft_tokens']} tokens): "
              f"rel err {image['rel_err']:.2e} vs stored weights, {image['rel_err_fp32']:.2e} vs fp32")
        assert image["rel_err"] < 1e-3
    prompt = report["prompt"]
    forced = prompt["forced"]
    print(f"{name} image prompt ({prompt['prompt_tokens']} tokens, image {prompt['image_size']}): greedy "
          f"{'match' if prompt['greedy_match'] else 'DIFFERS'}, top-1 {forced['top1_agreement']:.0%}, "
          f"max |dlogit| {forced['max_abs_err']:.2e}; vs fp32: top-1 {prompt['fp32']['top1_agreement']:.0%}")
    assert prompt["ids_match"] and prompt["bos_count"] == 1
    assert prompt["greedy_match"] and len(prompt["greedy_mnn"]) == 16
    assert forced["top1_agreement"] == 1.0
    assert report["passed"], report["failures"]


@pytest.mark.slow
def test_export_folder_holds_the_vision_files(exported):
    _, out = exported("vision-64")
    assert {"visual.mnn", "visual.mnn.weight"} <= {p.name for p in out.iterdir()}
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["is_visual"] and llm_config["image_pad"] == 9 and llm_config["visual_model"] == "visual.mnn"
    config = json.loads((out / "config.json").read_text())
    assert config["mllm"]["precision"] == "normal" and config["mllm"]["memory"] == "normal"
