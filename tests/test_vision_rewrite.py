"""Stages 1-2 (vision): the trace-friendly tower vs HF eager, its ONNX via onnxruntime vs torch,
the runtime-scale compensation, and the multimodal PLE rule."""

from __future__ import annotations

import math

import numpy as np
import PIL  # noqa: E402,F401  (pillow is a dependency)
import pytest
import torch

from llmexport.errors import InputError
from llmexport.media.image import preprocess, resize_to_processed, synthetic_image
from llmexport.models.gemma4.tower_checks import PROMPT_HEAD, FullModel, hf_processor, processor_inputs
from llmexport.models.gemma4.vision import RUNTIME_IMAGE_SCALE, image_features, parse_vision_args
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.tokenizer import SPECIAL_TOKENS
from llmexport.trace.eager import bind_weights

CONFIGS = ("vision-64", "vision-1536")
# (size, soft-token budget): square at the default 280, wide and non-multiple-of-48 at 70 (faster)
IMAGES = [((300, 300), 280), ((200, 640), 70), ((317, 451), 70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    cache = {}

    def get(name):
        if name not in cache:
            path = build_tiny_multimodal(tmp_path_factory.mktemp(name), name)
            arch = open_architecture(Checkpoint.open(path))
            hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
            tower = arch.towers()[0]
            graph = bind_weights(tower.build_graph(output_scale=1.0), tower.linear_weight)
            cache[name] = (path, arch, tower, graph, hf)
        return cache[name]

    return get


def _inputs(size, budget):
    p = preprocess(synthetic_image(*size, seed=sum(size)), max_soft_tokens=budget)
    return torch.from_numpy(p.patches)[None], torch.from_numpy(p.positions)[None], p.soft_tokens


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("size,budget", IMAGES)
def test_rewrite_matches_hf_image_features(tiny, name, size, budget):
    _, _, _, graph, hf = tiny(name)
    patches, positions, n = _inputs(size, budget)
    ref = image_features(hf, patches, positions)
    with torch.no_grad():
        out = graph(patches, positions.to(torch.int32))
    assert out.shape[1] == patches.shape[1] // 9
    err = (out[0, :n] - ref).abs().max().item()
    print(f"\n{name} {size} budget {budget}: rewrite vs HF eager max abs err {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_onnx_matches_torch_at_another_patch_count(tiny, name, tmp_path):
    """Traced at 45 patches with a dynamic axis, run at 630: no shape was baked in."""
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    _, _, tower, graph, _ = tiny(name)
    inputs = tower.graph_inputs()
    assert inputs.args[0].shape[1] == 45
    export_onnx(graph, inputs, tmp_path / "visual.onnx", for_mnn=False)
    patches, positions, n = _inputs((317, 451), 70)
    session = ort.InferenceSession(str(tmp_path / "visual.onnx"))
    out = session.run(None, {"input_patches": patches.numpy(),
                             "image_position_ids": positions.numpy().astype(np.int32)})[0]
    with torch.no_grad():
        ref = graph(patches, positions.to(torch.int32)).numpy()
    err = float(np.abs(out - ref).max())
    print(f"\n{name}: onnxruntime vs torch max abs err {err:.2e}")
    assert out.shape == ref.shape and err < 1e-4


def test_mnn_graph_has_no_unfold_or_boolean_indexing(tiny, tmp_path):
    import onnx

    from llmexport.trace.onnx_export import export_onnx

    _, _, tower, _, _ = tiny("vision-64")
    export_onnx(tower.build_graph(), tower.graph_inputs(), tmp_path / "visual.onnx", for_mnn=True)
    ops = {node.op_type for node in onnx.load(str(tmp_path / "visual.onnx")).graph.node}
    assert "Linear" in ops and not ops & {"NonZero", "Compress", "GatherND", "ScatterND", "OneHot", "Loop", "If"}


@pytest.mark.parametrize("name", CONFIGS)
def test_exported_scale_undoes_runtime_image_scale(tiny, name):
    """The runtime multiplies image embeddings by 1/39.25, the text graph by sqrt(hidden): the
    exported tower's output times both is HF's image feature, for any text hidden size."""
    _, arch, tower, graph, hf = tiny(name)
    exported = bind_weights(tower.build_graph(), tower.linear_weight)
    patches, positions, n = _inputs((200, 640), 70)
    with torch.no_grad():
        out = exported(patches, positions.to(torch.int32))[0, :n]
    restored = out * RUNTIME_IMAGE_SCALE * math.sqrt(arch.args.hidden_size)
    ref = image_features(hf, patches, positions)
    assert (restored - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6
    assert tower.args.output_scale == pytest.approx(39.25 / math.sqrt(arch.args.hidden_size))


@pytest.mark.parametrize("name", CONFIGS)
def test_full_model_reference_reuses_the_image_features_exactly(tiny, name):
    """The verification reference (HF's full model on the processor's inputs) hands the image
    tower's output of its first call back on later calls: the logits equal a fresh call's."""
    path, _, _, _, hf = tiny(name)
    processor = hf_processor(path)
    inputs = processor_inputs(processor, PROMPT_HEAD + processor.image_token + "Say something.",
                              images=[synthetic_image(200, 640, seed=5)])
    reference = prompt = FullModel(hf, inputs)
    first = reference(prompt.ids)
    continued = reference(prompt.ids + [300, 301])
    fresh = FullModel(hf, inputs)(prompt.ids + [300, 301])
    assert reference.encoded is not None
    assert torch.equal(continued, fresh)  # the reused features are the recomputed ones, bit for bit
    assert (first - fresh[:len(prompt.ids)]).abs().max() < 1e-5  # causal: later tokens change nothing
    assert prompt.inputs["mm_token_type_ids"][0].tolist().count(1) == prompt.ids.count(SPECIAL_TOKENS["image"][1])


def test_ple_rule_maps_media_tokens_to_pad(tiny):
    _, arch, _, _, _ = tiny("vision-64")
    ids = torch.tensor([2, 9, 9, 12, 13, 7, 8, 300])
    assert arch.ple_lookup_ids(ids).tolist() == [2, 0, 0, 0, 0, 7, 8, 300]


def test_poisoned_media_ple_row_would_show(tiny):
    """The tiny checkpoints poison the image token's PLE row: a lookup at the image id instead of
    the pad id changes the logits by far more than any bound, so the runtime test (which must
    agree with HF) fails if the image token id reaches the PLE lookup."""
    _, arch, _, _, hf = tiny("vision-64")
    patches, positions, n = _inputs((200, 640), 70)
    image = SPECIAL_TOKENS["image"][1]
    ids = [2, 5, 300, SPECIAL_TOKENS["boi"][1]] + [image] * n + [SPECIAL_TOKENS["eoi"][1], 301, 6]
    slots = torch.tensor([i for i, t in enumerate(ids) if t == image])
    features = image_features(hf, patches, positions)
    with torch.no_grad():
        right = hf(input_ids=torch.tensor([ids]), pixel_values=patches, image_position_ids=positions,
                   use_cache=False, logits_to_keep=torch.arange(len(ids))).logits[0]
    lm = hf.model.language_model
    with torch.no_grad():
        wrong_ple = lm.get_per_layer_inputs(torch.tensor([ids]), None)  # image id reaches the lookup
        embeds = lm.embed_tokens(arch.ple_lookup_ids(torch.tensor([ids])))
        embeds[0, slots] = features
        hidden = lm(inputs_embeds=embeds, per_layer_inputs=wrong_ple, use_cache=False).last_hidden_state
        wrong = hf.lm_head(hidden)[0]
        wrong = torch.tanh(wrong / arch.args.final_softcap) * arch.args.final_softcap
    assert (right - wrong).abs().max().item() > 1.0


def test_llm_config_names_the_tower_and_its_tokens(tiny):
    _, arch, tower, _, _ = tiny("vision-64")
    config = tower.llm_config()
    assert config["is_visual"] is True and config["visual_model"] == "visual.mnn"
    assert (config["vision_start"], config["vision_end"], config["image_pad"]) == (7, 8, 9)
    assert config["image_mean"] == [0.0] * 3 and config["image_norm"] == pytest.approx([1 / 255] * 3)
    assert config["image_size"] == 768
    assert tower.runtime_config()["mllm"]["precision"] == "normal"
    assert {spec.name for spec in tower.linears()} >= {"model.vision_tower.patch_embedder.input_proj",
                                                        "model.embed_vision.embedding_projection"}


def test_vision_config_errors_are_loud():
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                position_embedding_size=64)
    parse_vision_args(base, 64, "cfg")
    with pytest.raises(InputError, match="patch"):
        parse_vision_args(dict(base, patch_size=14), 64, "cfg")
    with pytest.raises(InputError, match="head_dim"):
        parse_vision_args(dict(base, head_dim=18), 64, "cfg")
    with pytest.raises(InputError, match="intermediate_size"):
        parse_vision_args({k: v for k, v in base.items() if k != "intermediate_size"}, 64, "cfg")


def test_unmapped_tower_tensor_is_an_error(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, _, _, _, _ = tiny("vision-64")
    copy = tmp_path / "ck"
    shutil.copytree(path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.vision_tower.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match="not mapped"):
        open_architecture(Checkpoint.open(copy))


def test_prompt_image_reaches_runtime_with_hfs_pixels():
    """What the verification gives the runtime: an image already at HF's processed size."""
    image = resize_to_processed(synthetic_image(317, 451, seed=1))
    assert (image.height, image.width) == (672, 912)


def test_converter_external_constants_follow_into_the_rebuilt_weight_file(tmp_path):
    """MNN's converter moves constants above 1024 elements (a vision position table, a norm of a
    hidden size above 1024, an audio convolution) into its own weight file; the rebuilt graph's
    weight file must carry them, at the offsets the graph then names."""
    import io

    from llmexport.mnn.external import rehome_external

    source = tmp_path / "converted.mnn.weight"
    payload_a, payload_b = bytes(range(256)) * 20, bytes(reversed(range(256))) * 8
    source.write_bytes(payload_a + payload_b)
    graph = {"oplists": [
        {"name": "table", "type": "Const", "main": {"external": [0, len(payload_a)], "dims": [1280]}},
        {"name": "linear", "type": "Convolution", "main": {"external": [0, 64, 8, 0, 0]}},
        {"name": "conv", "type": "Convolution", "main": {"external": [len(payload_a), len(payload_b) - 16, 16]}},
        {"name": "small", "type": "Const", "main": {"dims": [4], "float32s": [1.0, 2.0, 3.0, 4.0]}}]}
    out = io.BytesIO(b"L" * 72)  # the linear records already written
    out.seek(0, io.SEEK_END)
    moved = rehome_external(graph, source, out, skip={"linear"})
    data = out.getvalue()
    table, linear, conv = (op["main"]["external"] for op in graph["oplists"][:3])
    assert moved == len(payload_a) + len(payload_b) and linear == [0, 64, 8, 0, 0]
    assert data[table[0]:table[0] + table[1]] == payload_a
    assert data[conv[0]:conv[0] + conv[1] + conv[2]] == payload_b and table[0] == 72
