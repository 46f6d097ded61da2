"""Gemma3 multimodal (``gemma3``): the text decoder read from text_config (rewrite vs HF's
Gemma3ForConditionalGeneration), the SigLIP tower + projector (rewrite vs HF's
``get_image_features``, ONNX vs torch), its runtime keys, and, exported, ``visual.mnn`` in MNN vs
HF carrying the stored weights at 16/8/4 bits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmexport.errors import InputError
from llmexport.models.gemma3_vision import INPUT_NAME, image_features
from llmexport.models.gemma4.media import MEDIA_MARK
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma3 import build_tiny_gemma3
from llmexport.trace.eager import bind_weights, prompt_inputs

from families import parametrize
from helpers import assert_reference_onnx_matches_eager, edit_checkpoint, rewrite_and_reference, rewrite_logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, architecture, tower, its eager graph at output scale 1, HF fp32 eager)."""
    from transformers import Gemma3ForConditionalGeneration

    path = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3-vision"), vision=True)
    arch = open_architecture(Checkpoint.open(path))
    tower = arch.towers()[0]
    graph = bind_weights(tower.build_graph(output_scale=1.0), tower.linear_weight)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, arch, tower, graph, hf


def _images(n=3):
    torch.manual_seed(3)
    return [torch.rand(1, 3, 64, 64) * 2 - 1 for _ in range(n)]


def _ids(n=21):
    torch.manual_seed(1)
    return torch.randint(10, 440, (n,))


@parametrize("rewrite", "seed", [0], "gemma3")
def test_text_decoder_matches_hf_conditional_generation(tiny, seed):
    path, *_ = tiny
    arch, _, ours, ref = rewrite_and_reference(path, _ids())
    assert arch.checkpoint.model_type == "gemma3" and ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4


def test_rewrite_matches_hf_image_features(tiny):
    *_, graph, hf = tiny
    for image in _images():
        ref = image_features(hf, image)
        with torch.no_grad():
            out = graph(image)[:, 0]
        assert out.shape == ref.shape == (16, 64)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        print(f"\ntower rewrite vs HF: max rel err {err:.2e}")
        assert err < 1e-5


@pytest.mark.parametrize("alter", [
    lambda g: g.soft_emb_norm.mul_(1.05),  # the projector's norm is (1 + weight)
    lambda g: g.positions.copy_(g.positions.flip(0)),  # positions in another patch order
    lambda g: g.layers[1].layer_norm2.bias.add_(0.05),
])
def test_tower_parity_check_detects_a_change(tiny, alter):
    *_, tower, _, hf = tiny
    graph = bind_weights(tower.build_graph(output_scale=1.0), tower.linear_weight)
    image = _images(1)[0]
    with torch.no_grad():
        alter(graph)
        out = graph(image)[:, 0]
    ref = image_features(hf, image)
    assert ((out - ref).abs().max() / ref.abs().max()).item() > 1e-3


def test_output_scale_undoes_the_text_graphs_embedding_scale_and_marks(tiny):
    _, arch, tower, graph, _ = tiny
    scaled = bind_weights(tower.build_graph(), tower.linear_weight)
    image = _images(1)[0]
    with torch.no_grad():
        ratio = scaled(image) / graph(image)
    expected = MEDIA_MARK / math.sqrt(arch.args.hidden_size)
    assert torch.allclose(ratio, torch.full_like(ratio, expected), rtol=1e-5)


@parametrize("onnx", "seed", [0], "gemma3")
def test_text_onnx_matches_eager(tiny, tmp_path, seed):
    _, arch, *_ = tiny
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


def test_tower_onnx_matches_torch(tiny, tmp_path):
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    *_, tower, graph, _ = tiny
    export_onnx(graph, tower.graph_inputs(), tmp_path / "visual.onnx", for_mnn=False)
    session = ort.InferenceSession(str(tmp_path / "visual.onnx"))
    assert [i.name for i in session.get_inputs()] == [INPUT_NAME]
    for image in _images(2):  # other images than the traced one
        (out,) = session.run(None, {INPUT_NAME: image.numpy()})
        with torch.no_grad():
            ref = graph(image).numpy()
        assert np.abs(out - ref).max() < 1e-5


def test_llm_config_selects_the_runtimes_default_path(tiny):
    *_, tower, _, _ = tiny
    config = tower.llm_config()
    assert INPUT_NAME not in ("patches", "pixel_values", "input_patches")  # omni.cpp visionProcess
    assert config["image_size"] == 64
    assert (config["vision_start"], config["vision_end"], config["image_pad"]) == (7, 8, 9)
    # the runtime's (pixel - mean) * norm is HF's rescale 1/255 then (x - 0.5) / 0.5
    pixels = np.arange(256.0)
    runtime = (pixels - config["image_mean"][0]) * config["image_norm"][0]
    np.testing.assert_allclose(runtime, (pixels / 255 - 0.5) / 0.5, atol=1e-12)


@pytest.mark.parametrize("edit, message", [
    (dict(config={"mm_tokens_per_image": 15}), "mm_tokens_per_image"),
    (dict(config={"vision_config": {"vision_use_head": True}}), "vision_use_head"),
    (dict(drop=["multi_modal_projector.mm_soft_emb_norm.weight"]), "mm_soft_emb_norm"),
])
def test_checkpoint_problems_are_input_errors(tiny, tmp_path, edit, message):
    path = tiny[0]
    bad = edit_checkpoint(path, tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(bad))


def test_rewrite_logits_of_text_only_prompt_ignore_the_tower(tiny):
    path, arch, *_ = tiny
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert rewrite_logits(arch, graph, _ids(5)).shape == (5, 512)


def test_runtime_preprocessing_equals_hf_processor(tiny, tmp_path):
    """What MNN's ``defaultVisionProcess`` feeds the tower (CV::imread, then CV::resize to
    image_size with BGR2RGB and the exported mean/norm) equals HF's processor's pixel values for
    an image of image_size (no resize)."""
    import MNN.cv as cv

    from llmexport.media.image import synthetic_image
    from llmexport.models.gemma3_vision import hf_pixel_values

    *_, tower, _, _ = tiny
    config, size = tower.llm_config(), tower.args.image_size
    image = synthetic_image(size, size, seed=5)
    image.save(tmp_path / "image.png")
    loaded = cv.imread(str(tmp_path / "image.png"))
    fed = cv.resize(loaded, [size, size], 0, 0, cv.INTER_LINEAR, cv.COLOR_BGR2RGB,
                    config["image_mean"], config["image_norm"])
    runtime = np.asarray(fed.read()).reshape(size, size, 3).transpose(2, 0, 1)
    hf = hf_pixel_values(image, size)[0].numpy()
    print(f"\nruntime vs HF pixel values: max abs err {np.abs(runtime - hf).max():.2e}")
    assert np.abs(runtime - hf).max() < 1e-6
    assert np.abs(runtime - hf_pixel_values(image.transpose(0), size)[0].numpy()).max() > 0.1  # not vacuous


def _image_prompt(arch, tower, graph, tower_graph, image, ids):
    """The text graph's logits for ``ids`` fed as the runtime feeds them: embedding rows, the
    image pad ids' rows replaced by ``tower_graph``'s output rows."""
    embeds, mask, positions, index = prompt_inputs(arch, torch.tensor(ids), arch.embedding_table(), None)
    slots = torch.tensor([i for i, t in enumerate(ids) if t == tower.ids["image_token_id"]])
    with torch.no_grad():
        embeds[slots] = tower_graph(image)
        return graph(embeds, mask, positions, index)[0][0]


def test_image_prompt_through_the_text_graph_matches_hf(tiny):
    """Marked soft tokens in place of the image pads, the runtime's causal + sliding mask: the text
    graph equals HF's full model on input_ids, pixel_values and token_type_ids (bidirectional over
    the image's 16 tokens, longer than the sliding window); without the marks (a causal export)
    it visibly does not."""
    _, arch, tower, _, hf = tiny
    image = _images(1)[0]
    ids = [2, 20, 31, 107, 7] + [9] * 16 + [8, 40, 52, 66, 12]
    types = torch.tensor([[int(t == 9) for t in ids]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=image, token_type_ids=types, use_cache=False).logits[0]
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    marked = bind_weights(tower.build_graph(), tower.linear_weight)
    ours = _image_prompt(arch, tower, graph, marked, image, ids)
    err = (ours - ref).abs().max().item()
    print(f"\nimage prompt, text graph vs HF: max |dlogit| {err:.2e}")
    assert ours.shape == ref.shape and err < 1e-4
    graph.media_spans = False
    causal = _image_prompt(arch, tower, graph, bind_weights(tower.build_graph(output_scale=tower.output_scale
                                                                              / MEDIA_MARK), tower.linear_weight),
                           image, ids)
    assert (causal - ref).abs().max().item() > 1e-2


def test_a_multimodal_checkpoint_without_sliding_layers_is_refused(tiny, tmp_path):
    """Its image runs could only open a one-slice mask, which the runtime's "full" attention does not feed."""
    import json

    path = tiny[0]
    text = json.loads((path / "config.json").read_text())["text_config"]
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    bad = edit_checkpoint(path, tmp_path / "bad", config={"text_config": text})
    with pytest.raises(InputError, match="without sliding layers"):
        open_architecture(Checkpoint.open(bad))
