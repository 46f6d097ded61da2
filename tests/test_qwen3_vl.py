"""Qwen3-VL (``qwen3_vl``) and Qwen3-VL-MoE (``qwen3_vl_moe``): the vision tower with its
DeepStack levels (rewrite vs HF's ``get_image_features``, ONNX vs torch; the same tower in both),
the text graph on the runtime's M-RoPE positions and DeepStack input vs HF's model on image
prompts and text prompts (both model types; Qwen3-VL-MoE's expert stacks stored transposed as
released, or as transformers saves them), runtime keys, config and tensor problems."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmexport.errors import InputError
from llmexport.media.image import synthetic_image
from llmexport.media.qwen_vl import hf_pixel_values
from llmexport.models.qwen_vl.mrope import runtime_positions
from llmexport.models.qwen_vl.vision import INPUTS
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.trace.eager import bind_weights, prompt_inputs

from families import parametrize
from helpers import edit_checkpoint

SIZES = ((64, 96), (96, 64))  # wide, tall
#: images of the text tests: a tall one then a wide one, with text around them
PROMPT_SIZES = ((128, 64), (64, 96))


MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def _load(path):
    """(path, architecture, tower, tower graph, text graph, HF fp32 model)."""
    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    hf = arch.reference_loader().from_pretrained(path, dtype=torch.float32).eval()
    return (path, arch, tower, bind_weights(tower.build_graph(), tower.linear_weight),
            bind_weights(arch.build_graph(), arch.linear_weight), hf)


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_vl, tiny_qwen3_vl_moe):
    """model type -> ``_load`` of its tiny checkpoint."""
    return {"qwen3_vl": _load(tiny_qwen3_vl), "qwen3_vl_moe": _load(tiny_qwen3_vl_moe)}


@pytest.fixture(scope="module")
def tiny(loaded):
    return loaded["qwen3_vl"]


def hf_features(hf, image) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's soft tokens [n, hidden] and DeepStack levels [levels, n, hidden] of ``image``."""
    pixels, grid = hf_pixel_values(image, 16)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.from_numpy(pixels), torch.tensor([grid]))
    return torch.cat(list(out.pooler_output)), torch.stack([torch.cat(list(level)) for level in out.deepstack_features])


def _tower(tower, graph, image) -> tuple[torch.Tensor, torch.Tensor]:
    feeds = tower.inputs(image)
    with torch.no_grad():
        embeds, levels = graph(*(torch.from_numpy(feeds[name]) for name in INPUTS))
    return embeds[:, 0], levels


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


# --- the tower -----------------------------------------------------------------------------------
@parametrize("rewrite", "size", SIZES, "qwen3_vl")
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tower_rewrite_matches_hf_image_features_and_deepstack(loaded, size, model_type):
    *_, tower, graph, _, hf = loaded[model_type]
    image = synthetic_image(*size, seed=1)
    (ref, ref_levels), (out, levels) = hf_features(hf, image), _tower(tower, graph, image)
    assert out.shape == ref.shape == (size[0] * size[1] // 1024, 64)
    assert levels.shape == ref_levels.shape == (2, *ref.shape)
    print(f"\n{model_type} tower {size} vs HF: rel err {_rel(out, ref):.2e}, deepstack {_rel(levels, ref_levels):.2e}")
    assert _rel(out, ref) < 1e-5 and _rel(levels, ref_levels) < 1e-5


@pytest.mark.parametrize("alter", [
    lambda g: g.deepstack[0].norm.weight.mul_(1.05),  # the post-shuffle norm of level 0
    lambda g: g.deepstack[1].norm.bias.add_(0.05),
])
def test_deepstack_parity_check_detects_a_change(tiny, alter):
    *_, tower, _, _, hf = tiny
    graph = bind_weights(tower.build_graph(), tower.linear_weight)
    image = synthetic_image(96, 64, seed=1)
    with torch.no_grad():
        alter(graph)
    assert _rel(_tower(tower, graph, image)[1], hf_features(hf, image)[1]) > 1e-3


@parametrize("onnx", "size", [(128, 64)], "qwen3_vl")
def test_tower_onnx_matches_torch(tiny, tmp_path, size):
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    *_, tower, graph, _, _ = tiny
    export_onnx(graph, tower.graph_inputs(), tmp_path / "visual.onnx", for_mnn=False)
    session = ort.InferenceSession(str(tmp_path / "visual.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == INPUTS
    assert [o.name for o in session.get_outputs()] == ["image_embeds", "deepstack_embeds"]
    image = synthetic_image(*size, seed=2)  # not the traced size
    embeds, levels = session.run(None, tower.inputs(image))
    out, ref_levels = _tower(tower, graph, image)
    assert np.abs(embeds[:, 0] - out.numpy()).max() < 1e-5 and np.abs(levels - ref_levels.numpy()).max() < 1e-5


# --- the text graph ------------------------------------------------------------------------------
def _image_prompt(tower, hf, sizes=PROMPT_SIZES):
    """(ids, the runtime's position_ids, HF's processor outputs, soft tokens, DeepStack levels)."""
    torch.manual_seed(0)
    ids: list[int] = []
    segments: list = []
    pixels, grids, features, levels = [], [], [], []
    t = tower.ids
    for h, w in sizes:
        image = synthetic_image(h, w, seed=h + w)
        values, grid = hf_pixel_values(image, 16)
        pixels.append(values)
        grids.append(grid)
        soft, deep = hf_features(hf, image)
        features.append(soft)
        levels.append(deep)
        ids += torch.randint(10, 400, (5,)).tolist() + [t["vision_start_token_id"]]
        ids += [t["image_token_id"]] * soft.shape[0] + [t["vision_end_token_id"]]
        segments += [5, (grid[1] // 2, grid[2] // 2)]  # the runtime adds vision start and end
    ids += torch.randint(10, 400, (7,)).tolist()
    segments.append(7)
    hf_inputs = {"pixel_values": torch.from_numpy(np.concatenate(pixels)), "image_grid_thw": torch.tensor(grids)}
    return torch.tensor(ids), runtime_positions(segments), hf_inputs, torch.cat(features), torch.cat(levels, 1)


def _runtime_logits(arch, graph, tower, prompt, deepstack=True):
    """The graph on what omni.cpp's Omni::embedding builds: the soft tokens in the embeddings, the
    DeepStack levels at the image tokens and zeros elsewhere (``deepstack`` False: no fifth input)."""
    ids, positions, _, features, levels = prompt
    embeds, mask, _, logits_index = prompt_inputs(arch, ids, arch.embedding_table(), None)
    embeds = embeds.clone()
    image = ids == tower.ids["image_token_id"]
    embeds[image, 0] = features
    extra = torch.zeros(levels.shape[0], ids.numel(), embeds.shape[-1])
    extra[:, image] = levels
    with torch.no_grad():
        return graph(embeds, mask, positions, logits_index, *([extra] if deepstack else []))[0][0]


def _hf_logits(hf, tower, prompt):
    ids, _, hf_inputs, *_ = prompt
    types = (ids == tower.ids["image_token_id"]).int().view(1, -1)
    with torch.no_grad():
        return hf(input_ids=ids.view(1, -1), mm_token_type_ids=types, use_cache=False, **hf_inputs).logits[0]


@parametrize("rewrite", "model_type", MODEL_TYPES, lambda model_type: model_type)
def test_text_graph_with_deepstack_matches_hf_on_image_prompts(loaded, model_type):
    """A tall then a wide image: the runtime's positions and DeepStack input through the graph
    equal HF's model; the same prompt without the DeepStack levels differs visibly."""
    _, arch, tower, _, graph, hf = loaded[model_type]
    prompt = _image_prompt(tower, hf)
    ours, ref = _runtime_logits(arch, graph, tower, prompt), _hf_logits(hf, tower, prompt)
    without = _runtime_logits(arch, graph, tower, prompt, deepstack=False)
    print(f"\n{model_type} image prompt, graph vs HF: max |dlogit| {(ours - ref).abs().max().item():.2e}; "
          f"without DeepStack {(without - ref).abs().max().item():.2e}")
    assert ref.abs().max() > 1.0 and (ours - ref).abs().max().item() < 2e-4
    assert (without - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_text_prompts_match_hf_with_the_runtimes_zeros(loaded, model_type):
    """A text prompt (three equal rows) with the runtime's decode-step zeros [3, 1, 1], or no
    fifth input, gives HF's text logits."""
    _, arch, _, _, graph, hf = loaded[model_type]
    ids = torch.randint(10, 400, (19,), generator=torch.Generator().manual_seed(4))
    inputs = prompt_inputs(arch, ids, arch.embedding_table(), None)
    assert inputs[2].shape == (3, 19)
    with torch.no_grad():
        zeros = graph(*inputs, torch.zeros(3, 1, 1))[0][0]
        plain = graph(*inputs)[0][0]
    ref = arch.reference_logits(hf, ids)
    assert torch.equal(zeros, plain) and (plain - ref).abs().max().item() < 1e-4


@parametrize("onnx", "model_type", MODEL_TYPES, lambda model_type: model_type)
def test_text_onnx_matches_eager(loaded, tmp_path, model_type):
    """The standard-op ONNX at other lengths than traced: an image prompt with its DeepStack
    levels, and a decode-shaped step with the runtime's zeros [3, 1, 1]."""
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    _, arch, tower, _, graph, hf = loaded[model_type]
    export_onnx(graph, arch.graph_inputs(3), tmp_path / "llm.onnx", for_mnn=False)
    session = ort.InferenceSession(str(tmp_path / "llm.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()][-1] == "deepstack_embeds"
    ids, positions, _, features, levels = _image_prompt(tower, hf, PROMPT_SIZES[:1])
    embeds, mask, _, index = prompt_inputs(arch, ids, arch.embedding_table(), None)
    extra = torch.zeros(2, ids.numel(), 64)
    extra[:, ids == tower.ids["image_token_id"]] = levels
    step = prompt_inputs(arch, ids[:1], arch.embedding_table(), None)
    for args in ((embeds, mask, positions, index, extra), (*step, torch.zeros(3, 1, 1))):
        got = session.run(["logits"], {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})[0]
        with torch.no_grad():
            want = graph(*args)[0].numpy()
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4


# --- runtime keys and checkpoint problems ---------------------------------------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_runtime_keys(loaded, model_type):
    _, arch, tower, *_ = loaded[model_type]
    config = arch.llm_config() | tower.llm_config()
    assert config["is_mrope"] and config["is_visual"] and config["has_deepstack"] and config["num_grid_per_side"] == 4
    assert [len(a.shape) for a in arch.graph_inputs(5).args] == [3, 4, 2, 1, 3]
    assert arch.graph_inputs(5).args[2].shape == (3, 5) and tower.graph_inputs().output_names[1] == "deepstack_embeds"


@pytest.mark.parametrize("section, key, value, message", [
    ("vision_config", "deepstack_visual_indexes", [0, 1, 2, 0], "deepstack_visual_indexes"),
    ("vision_config", "deepstack_visual_indexes", [0, 3], "below depth 3"),
    ("vision_config", "patch_size", 14, "patch_size"),
    ("text_config", "rope_parameters", {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2]},
     "mrope_section"),
])
def test_config_problems_are_input_errors(tiny, tmp_path, section, key, value, message):
    config = json.loads((tiny[0] / "config.json").read_text())
    bad = edit_checkpoint(tiny[0], tmp_path / "bad", config={section: {**config[section], key: value}})
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(bad))


def test_a_missing_deepstack_tensor_is_an_input_error(tiny, tmp_path):
    bad = edit_checkpoint(tiny[0], tmp_path / "bad", drop=["model.visual.deepstack_merger_list.1.norm.bias"])
    with pytest.raises(InputError, match="deepstack_merger_list.1.norm.bias"):
        open_architecture(Checkpoint.open(bad))


def test_a_tied_head_matches_hf(tmp_path):
    """The released 2B and 4B tie the head to the embeddings (the outer config's
    ``tie_word_embeddings``): no ``lm_head`` tensor, the graph's head reads the table."""
    from transformers import Qwen3VLForConditionalGeneration

    from llmexport.tiny.qwen3_vl import build_tiny_qwen3_vl

    path = build_tiny_qwen3_vl(tmp_path / "tied", tie=True, seed=1)
    arch = open_architecture(Checkpoint.open(path))
    assert arch.args.tie_embeddings and "lm_head.weight" not in arch.checkpoint.weights.names()
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(10, 400, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = bind_weights(arch.build_graph(), arch.linear_weight)(*prompt_inputs(arch, ids, arch.embedding_table(),
                                                                                   None))[0][0]
    assert (ours - arch.reference_logits(hf, ids)).abs().max().item() < 1e-4


# --- Qwen3-VL-MoE's routed experts ----------------------------------------------------------------
def _text_error(arch, graph, hf, seed=4) -> float:
    ids = torch.randint(10, 400, (19,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = graph(*prompt_inputs(arch, ids, arch.embedding_table(), None))[0][0]
    return (ours - arch.reference_logits(hf, ids)).abs().max().item()


def test_moe_stacks_in_transformers_saved_layout_match_hf(loaded, tmp_path):
    """The released checkpoint's stacks are [E, in, out] (read transposed); what transformers'
    save_pretrained writes, [E, out, in], is read as it is; both give HF's logits."""
    from llmexport.tiny.qwen3_vl import build_tiny_qwen3_vl

    released = loaded["qwen3_vl_moe"][1]
    assert released.names.transposed == {"moe.expert.gate_up", "moe.expert.down"}
    path = build_tiny_qwen3_vl(tmp_path / "saved", moe=True, released=False)
    _, arch, _, _, graph, hf = _load(path)
    assert not arch.names.transposed and arch.args.moe.normalize
    assert [layer.sparse for layer in arch.args.layers] == [True, False, True]  # mlp_only_layers [1]
    assert _text_error(arch, graph, hf) < 1e-4


def test_moe_parity_check_detects_an_expert_change(loaded):
    """Layer 0's experts' down rows scaled by 1.02: the text logits move visibly."""
    _, arch, _, _, _, hf = loaded["qwen3_vl_moe"]
    down = {arch.names.name("moe.expert.down", layer=0, expert=e) for e in range(arch.args.moe.num_experts)}

    def altered(name):
        weight, bias = arch.linear_weight(name)
        return (weight * 1.02 if name in down else weight), bias

    assert _text_error(arch, bind_weights(arch.build_graph(), altered), hf) > 1e-3


def test_moe_router_always_renormalises(tiny_qwen3_vl_moe, tmp_path):
    """Qwen3VLMoeTextTopKRouter renormalises the top-k weights whatever config.json says."""
    config = json.loads((tiny_qwen3_vl_moe / "config.json").read_text())
    bad = edit_checkpoint(tiny_qwen3_vl_moe, tmp_path / "cfg",
                          config={"text_config": {**config["text_config"], "norm_topk_prob": False}})
    assert open_architecture(Checkpoint.open(bad)).args.moe.normalize


@pytest.mark.parametrize("stack, shape", [("gate_up_proj", (6, 64, 40)), ("down_proj", (5, 24, 64))])
def test_a_stack_of_the_wrong_shape_is_an_input_error(tiny_qwen3_vl_moe, tmp_path, stack, shape):
    name = f"model.language_model.layers.2.mlp.experts.{stack}"
    bad = edit_checkpoint(tiny_qwen3_vl_moe, tmp_path / "bad", reshape={name: shape})
    with pytest.raises(InputError, match=name):
        open_architecture(Checkpoint.open(bad))
