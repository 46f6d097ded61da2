"""Qwen3.5 multimodal (``qwen3_5``): the runtime's image inputs vs HF's processor, the vision tower
(rewrite vs HF's ``get_image_features``, ONNX vs torch), the text graph on the runtime's M-RoPE
positions vs HF's model on image prompts, its runtime keys, and checkpoint problems."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmexport.errors import InputError
from llmexport.media.image import synthetic_image
from llmexport.media.qwen_vl import hf_pixel_values, runtime_pixels, vision_inputs
from llmexport.models.qwen3_5.graph import Qwen3_5Graph
from llmexport.models.qwen_vl.mrope import hf_relative_positions, mrope_cos_sin, runtime_positions
from llmexport.models.qwen_vl.towers import image_features
from llmexport.models.qwen_vl.vision import INPUTS
from llmexport.models.tensor_checks import finite_lookup
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.trace.eager import bind_weights, prompt_inputs

from families import parametrize
from helpers import assert_reference_onnx_matches_eager, edit_checkpoint

SIZES = ((64, 64), (64, 96), (96, 64))  # square, wide, tall


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_5):
    """(path, architecture, tower, tower graph, text graph, HF fp32 model)."""
    from transformers import Qwen3_5ForConditionalGeneration

    path = tiny_qwen3_5("qwen3_5")
    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return (path, arch, tower, bind_weights(tower.build_graph(), tower.linear_weight),
            bind_weights(arch.build_graph(), arch.linear_weight), hf)


def _feeds(tower, image) -> tuple[torch.Tensor, ...]:
    feeds = tower.inputs(image)
    return tuple(torch.from_numpy(feeds[name]) for name in INPUTS)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


# --- the runtime's inputs ----------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_runtime_inputs_equal_hf_processor_and_vision_model(size):
    """What omni.cpp's qwen2VisionProcess feeds (media/qwen_vl.py) is HF's: the processor's
    pixel_values, get_vision_position_ids and the bilinear position-table taps."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    image = synthetic_image(*size, seed=5)
    ours = vision_inputs(runtime_pixels(image), 16, 4)
    pixels, grid = hf_pixel_values(image, 16)
    assert grid == [1, size[0] // 16, size[1] // 16] and ours.soft_tokens == size[0] * size[1] // 1024
    assert np.abs(ours.patches - pixels).max() < 1e-6
    thw = torch.tensor([grid])
    np.testing.assert_array_equal(ours.position_ids.T, get_vision_position_ids(thw, 2).numpy())
    idx, weight = get_vision_interpolation_indices_and_weights(thw, 4, align_corners=True, spatial_merge_size=2)
    np.testing.assert_array_equal(ours.idx_tensor.T, idx.numpy())
    np.testing.assert_allclose(ours.weight_tensor.T, weight.numpy(), atol=1e-7)
    assert not ours.attention_mask.any()


# --- the tower -----------------------------------------------------------------------------------
@parametrize("rewrite", "size", SIZES, "qwen3_5")
def test_tower_rewrite_matches_hf_image_features(tiny, size):
    *_, tower, graph, _, hf = tiny
    image = synthetic_image(*size, seed=1)
    ref = image_features(hf, *hf_pixel_values(image, 16))
    with torch.no_grad():
        out = graph(*_feeds(tower, image))[:, 0]
    assert out.shape == ref.shape == (size[0] * size[1] // 1024, 64)
    print(f"\ntower rewrite {size} vs HF: rel err {_rel(out, ref):.2e}")
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("alter", [
    lambda g: g.pos_embed.copy_(g.pos_embed.flip(0)),  # the learned positions in another order
    lambda g: g.inv_freq.mul_(1.5),  # the axial rotary frequencies
    lambda g: g.blocks[1].norm2.bias.add_(0.05),
    lambda g: g.merger_norm.weight.mul_(1.05),
])
def test_tower_parity_check_detects_a_change(tiny, alter):
    *_, tower, _, _, hf = tiny
    graph = bind_weights(tower.build_graph(), tower.linear_weight)
    image = synthetic_image(96, 64, seed=1)
    with torch.no_grad():
        alter(graph)
        out = graph(*_feeds(tower, image))[:, 0]
    assert _rel(out, image_features(hf, *hf_pixel_values(image, 16))) > 1e-3


@parametrize("onnx", "size", [(128, 64)], "qwen3_5")
def test_tower_onnx_matches_torch(tiny, tmp_path, size):
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    *_, tower, graph, _, _ = tiny
    export_onnx(graph, tower.graph_inputs(), tmp_path / "visual.onnx", for_mnn=False)
    session = ort.InferenceSession(str(tmp_path / "visual.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == INPUTS  # omni.cpp: idx_tensor 4th of 5 -> patch 16
    for image in (synthetic_image(*size, seed=2), synthetic_image(64, 64, seed=3)):  # not the traced size
        feeds = tower.inputs(image)
        (out,) = session.run(None, feeds)
        with torch.no_grad():
            ref = graph(*_feeds(tower, image)).numpy()
        assert out.shape == ref.shape and np.abs(out - ref).max() < 1e-5


# --- the text graph on image prompts ------------------------------------------------------------
def _image_prompt(tower, hf, sizes, seed=0):
    """(ids, the runtime's position_ids, HF's processor outputs, HF's image features) for text,
    then each image of ``sizes`` after some text, then text."""
    torch.manual_seed(seed)
    ids: list[int] = []
    segments: list = []
    pixels, grids = [], []
    t = tower.ids
    for h, w in sizes:
        ids += torch.randint(10, 400, (5,)).tolist() + [t["vision_start_token_id"]]
        values, grid = hf_pixel_values(synthetic_image(h, w, seed=h + w), 16)
        pixels.append(values)
        grids.append(grid)
        ids += [t["image_token_id"]] * (grid[1] * grid[2] // 4) + [t["vision_end_token_id"]]
        segments += [5, (grid[1] // 2, grid[2] // 2)]  # the runtime adds vision start and end
    ids += torch.randint(10, 400, (7,)).tolist()
    segments.append(7)
    features = torch.cat([image_features(hf, p, g) for p, g in zip(pixels, grids)])
    hf_inputs = {"pixel_values": torch.from_numpy(np.concatenate(pixels)), "image_grid_thw": torch.tensor(grids)}
    return torch.tensor(ids), runtime_positions(segments), hf_inputs, features


def _logits(arch, graph, tower, ids, positions, features, rope=None):
    embeds, mask, _, logits_index = prompt_inputs(arch, ids, arch.embedding_table(), None)
    embeds = embeds.clone()
    embeds[ids == tower.ids["image_token_id"], 0] = features  # what Omni::embedding merges
    if rope is not None:
        graph.rope = rope
    with torch.no_grad():
        return graph(embeds, mask, positions, logits_index)[0][0]


def _hf_logits(hf, tower, ids, hf_inputs):
    types = (ids == tower.ids["image_token_id"]).int().view(1, -1)
    with torch.no_grad():
        return hf(input_ids=ids.view(1, -1), mm_token_type_ids=types, use_cache=False, **hf_inputs).logits[0]


PROMPTS = {"square": ((64, 64),), "tall": ((96, 64),), "tall+wide": ((128, 64), (64, 96))}


@parametrize("rewrite", "prompt", sorted(PROMPTS), "qwen3_5")
def test_text_graph_on_runtime_positions_matches_hf(tiny, prompt):
    """The runtime's position_ids (omni.cpp addPositionIds: after a tall image they fall short of
    HF's get_rope_index) through the graph equal HF's model with its own positions."""
    _, arch, tower, _, graph, hf = tiny
    ids, positions, hf_inputs, features = _image_prompt(tower, hf, PROMPTS[prompt])
    ours, ref = _logits(arch, graph, tower, ids, positions, features), _hf_logits(hf, tower, ids, hf_inputs)
    print(f"\n{prompt} image prompt, graph vs HF: max |dlogit| {(ours - ref).abs().max().item():.2e}")
    assert ref.abs().max() > 1.0 and (ours - ref).abs().max().item() < 2e-4


@parametrize("rewrite", "variant", ["qwen3_5-moe"], "qwen3_5_moe")
def test_moe_text_graph_and_tower_match_hf(tiny_qwen3_5, variant):
    """``qwen3_5_moe``: the same tower and positions over the MoE text model."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    path = tiny_qwen3_5(variant)
    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids, positions, hf_inputs, features = _image_prompt(tower, hf, PROMPTS["tall+wide"])
    with torch.no_grad():
        out = bind_weights(tower.build_graph(), tower.linear_weight)(
            *_feeds(tower, synthetic_image(128, 64, seed=128 + 64)))[:, 0]
    assert _rel(out, features[:8]) < 1e-5
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    ours, ref = _logits(arch, graph, tower, ids, positions, features), _hf_logits(hf, tower, ids, hf_inputs)
    print(f"\n{variant} tall+wide image prompt, graph vs HF: max |dlogit| {(ours - ref).abs().max().item():.2e}")
    assert ref.abs().max() > 1.0 and (ours - ref).abs().max().item() < 2e-4


@pytest.mark.parametrize("alter", ["uncorrected", "one_row"])
def test_text_parity_check_detects_wrong_positions(tiny, alter):
    """Feeding the runtime's positions uncorrected, or reading every pair from the t row (1-D
    RoPE), moves the logits of a tall image's prompt visibly."""
    path, arch, tower, _, _, hf = tiny
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    ids, positions, hf_inputs, features = _image_prompt(tower, hf, PROMPTS["tall"])
    rows = torch.zeros_like(graph.pair_rows) if alter == "one_row" else graph.pair_rows
    correct = hf_relative_positions if alter == "one_row" else (lambda p: p.float())
    rope = lambda p: mrope_cos_sin(correct(p), graph.inv_freq, rows)  # noqa: E731
    ours = _logits(arch, graph, tower, ids, positions, features, rope)
    assert (ours - _hf_logits(hf, tower, ids, hf_inputs)).abs().max().item() > 1e-3


def test_positions_are_hfs_up_to_one_shift_that_continues_at_the_count(tiny):
    """hf_relative_positions turns the runtime's prompt positions into HF's get_rope_index minus
    HF's rope_deltas: the runtime's next decode position (the token count) is then HF's; a text
    prefill and a decode step are left as they are."""
    *_, tower, _, _, hf = tiny
    ids, positions, hf_inputs, _ = _image_prompt(tower, hf, PROMPTS["tall+wide"])
    types = (ids == tower.ids["image_token_id"]).int().view(1, -1)
    ref, delta = hf.model.get_rope_index(ids.view(1, -1), types, hf_inputs["image_grid_thw"])
    assert not torch.equal(positions.long(), ref[:, 0])  # the runtime's own fall short after the tall image
    torch.testing.assert_close(hf_relative_positions(positions), (ref[:, 0] - delta).float(), rtol=0, atol=0)
    text = torch.arange(40, 52, dtype=torch.int32).repeat(3, 1)
    for p in (text, text[:, :1]):
        torch.testing.assert_close(hf_relative_positions(p), p.float(), rtol=0, atol=0)


def test_text_prompts_are_unchanged(tiny):
    """A text prompt in the multimodal export (three equal rows) gives the text-only graph's logits."""
    _, arch, _, _, graph, _ = tiny
    ids = torch.randint(10, 400, (19,), generator=torch.Generator().manual_seed(4))
    lookup = finite_lookup(arch.checkpoint.weights, arch.checkpoint.path)
    plain = bind_weights(Qwen3_5Graph(arch.args, arch.names, lookup), arch.linear_weight)
    inputs = prompt_inputs(arch, ids, arch.embedding_table(), None)
    assert inputs[2].shape == (3, 19)
    with torch.no_grad():
        ours = graph(*inputs)[0]
        text = plain(inputs[0], inputs[1], inputs[2][:1], inputs[3])[0]
    assert (ours - text).abs().max().item() < 1e-6


@parametrize("onnx", "seed", [0], "qwen3_5")
def test_text_onnx_matches_eager(tiny, tmp_path, seed):
    _, arch, _, _, graph, _ = tiny
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "llm.onnx")


# --- runtime files and checkpoint problems -------------------------------------------------------
def test_runtime_keys(tiny, tiny_qwen3_5):
    _, arch, tower, *_ = tiny
    config = arch.llm_config() | tower.llm_config()
    assert config["is_mrope"] and config["is_visual"] and config["num_grid_per_side"] == 4
    assert (config["vision_start"], config["vision_end"], config["image_pad"]) == tuple(
        tower.ids[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))
    assert config["image_size"] % 32 == 0
    pixels = np.arange(256.0)  # the runtime's (pixel - mean) * norm is HF's rescale then (x - 0.5) / 0.5
    np.testing.assert_allclose((pixels - config["image_mean"][0]) * config["image_norm"][0],
                               (pixels / 255 - 0.5) / 0.5, atol=1e-12)
    assert arch.graph_inputs(5).args[2].shape == (3, 5)
    text = open_architecture(Checkpoint.open(tiny_qwen3_5("qwen3_5-text")))
    assert "is_mrope" not in text.llm_config() and text.graph_inputs(5).args[2].shape == (1, 5)


@pytest.mark.parametrize("section, key, value, message", [
    ("vision_config", "patch_size", 14, "patch_size"),
    ("vision_config", "spatial_merge_size", 4, "spatial_merge_size"),
    ("vision_config", "num_position_embeddings", 15, "num_position_embeddings"),
    ("vision_config", "hidden_act", "silu", "hidden_act"),
    ("vision_config", "out_hidden_size", 32, "out_hidden_size"),
    ("text_config", "rope_parameters", {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                        "mrope_section": [2, 1]}, "mrope_section"),
])
def test_config_problems_are_input_errors(tiny, tmp_path, section, key, value, message):
    config = json.loads((tiny[0] / "config.json").read_text())
    bad = edit_checkpoint(tiny[0], tmp_path / "bad", config={section: {**config[section], key: value}})
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(bad))


@pytest.mark.parametrize("edit, message", [
    (dict(drop=["model.visual.merger.norm.weight"]), "merger.norm.weight"),
    (dict(reshape={"model.visual.pos_embed.weight": (9, 32)}), "pos_embed"),
])
def test_tensor_problems_are_input_errors(tiny, tmp_path, edit, message):
    bad = edit_checkpoint(tiny[0], tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(bad))


# --- bad images ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such image file"),
    (lambda p: p.write_text("not a picture"), "not an image MNN's runtime decodes"),
    (lambda p: p.write_bytes(_png()[:300]), "the image does not decode"),  # MNN's imread: "Can't open"
    (lambda p: p.write_bytes(_png()), "64x64 pixels, more than the 100"),
])
def test_bad_images_are_one_line_usage_errors(tmp_path, monkeypatch, make, message):
    from llmexport.errors import UsageError
    from llmexport.mnn import export_check

    monkeypatch.setattr(export_check, "MAX_IMAGE_PIXELS", 100 if "more than" in message else 64_000_000)
    path = tmp_path / "image.png"
    make(path)
    export = export_check.RunnableExport(tmp_path, tmp_path / "config.json", "qwen3_5", None, 16, True, False, True)
    with pytest.raises(UsageError, match=message) as error:
        export_check.check_media(f"say <img><hw>64,64</hw>{path}</img>", export)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    export_check.check_media("text only", export)


def _png() -> bytes:
    import io

    buffer = io.BytesIO()
    synthetic_image(64, 64, seed=7).save(buffer, format="PNG")
    return buffer.getvalue()
