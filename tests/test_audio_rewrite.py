"""Stages 1-2 (audio): gather-based chunked attention vs HF's unfold-based one, the whole tower
rewrite vs HF eager, and its ONNX via onnxruntime vs torch at lengths other than the traced one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmexport.errors import InputError
from llmexport.media.audio import log_mel, samples_for_tokens, synthetic_clip
from llmexport.models.gemma4.audio import (
    AUDIO_TOKENS,
    audio_features,
    chunked_attention,
    parse_audio_args,
    relative_position_table,
    window_mask,
)
from llmexport.models.gemma4.towers import token_ids
from llmexport.models.gemma4.vision import VISION_TOKENS
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import AUDIO_SMALL, build_tiny_multimodal
from llmexport.trace.eager import bind_weights

# encoder lengths: shorter than a chunk, not a multiple of it, several chunks
ATTENTION_CASES = [  # (chunk, context_left, context_right)
    (4, 5, 0),  # the tiny checkpoint's
    (12, 13, 0),  # the released checkpoints'
    (4, 6, 2),  # with right context
]


def _hf_attention(chunk, left, right, seed=0):
    from transformers import Gemma4AudioConfig
    from transformers.models.gemma4 import modeling_gemma4 as hf

    config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               subsampling_conv_channels=[128, 8], attention_chunk_size=chunk,
                               attention_context_left=left, attention_context_right=right)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = hf.Gemma4AudioAttention(config, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return config, attn, hf.Gemma4AudioRelPositionalEncoding(config), hf.Gemma4AudioModel(config)


@pytest.mark.parametrize("chunk,left,right", ATTENTION_CASES)
def test_gather_attention_equals_hf_unfold_attention(chunk, left, right):
    config, attn, rel_pos, model = _hf_attention(chunk, left, right)
    args = parse_audio_args(config.to_dict(), 64, "cfg")
    table, window = relative_position_table(args, attn.relative_k_proj.weight), window_mask(args)
    for length in (chunk - 1, 2 * chunk + 1, 5 * chunk + 2):
        x = torch.randn(1, length, 32)
        dist = torch.arange(length).view(-1, 1) - torch.arange(length).view(1, -1)
        allowed = ((dist >= 0) & (dist < left - 1)) | ((dist < 0) & (-dist < right))
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).view(1, 1, length, length)
        with torch.no_grad():
            ref, _ = attn(x, rel_pos(x), model._convert_4d_mask_to_blocked_5d(mask))
            q = attn.q_proj(x).view(length, 2, 16) * attn.q_scale * torch.nn.functional.softplus(attn.per_dim_scale)
            k = attn.k_proj(x).view(length, 2, 16) * attn.k_scale
            v = attn.v_proj(x).view(length, 2, 16)
            out = attn.post(chunked_attention(q, k, v, table, window, args).view(1, length, 32))
        err = (out - ref).abs().max().item()
        print(f"\nchunk {chunk} left {left} right {right}, {length} frames: gather vs unfold max abs err {err:.2e} "
              f"(|ref| max {ref.abs().max().item():.1f})")
        assert err < 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    path = build_tiny_multimodal(tmp_path_factory.mktemp("audio"), "audio-64")
    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, arch, tower, bind_weights(tower.build_graph(), tower.linear_weight), hf


def _features(samples):
    features, mask = log_mel(synthetic_clip(samples, seed=samples))
    return torch.from_numpy(features)[None], torch.from_numpy(mask)[None]


@pytest.mark.parametrize("tokens", [3, 9, 22])
def test_rewrite_matches_hf_audio_features(tiny, tokens):
    _, _, tower, graph, hf = tiny
    features, mask = _features(samples_for_tokens(tokens))
    ref = audio_features(hf, features, mask)
    with torch.no_grad():
        out = graph(features[:, mask[0]])[0]
    err = (out - ref).abs().max().item()
    print(f"\n{tokens} tokens ({int(mask.sum())} frames): rewrite vs HF eager max abs err {err:.2e}")
    assert out.shape == ref.shape == (tokens, 64) and err < 1e-5


def test_onnx_matches_torch_at_other_lengths(tiny, tmp_path):
    import onnxruntime as ort

    from llmexport.trace.onnx_export import export_onnx

    _, _, tower, graph, _ = tiny
    assert tower.graph_inputs().args[0].shape[1] == 37
    export_onnx(graph, tower.graph_inputs(), tmp_path / "audio.onnx", for_mnn=False)
    session = ort.InferenceSession(str(tmp_path / "audio.onnx"))
    for tokens in (3, 9, 22):
        features, mask = _features(samples_for_tokens(tokens))
        x = features[:, mask[0]]
        out = session.run(None, {"input_features": x.numpy()})[0]
        with torch.no_grad():
            ref = graph(x).numpy()
        assert out.shape == ref.shape and float(np.abs(out - ref).max()) < 1e-5


def test_mnn_graph_is_gather_based(tiny, tmp_path):
    import onnx

    from llmexport.trace.onnx_export import export_onnx

    _, _, tower, _, _ = tiny
    export_onnx(tower.build_graph(), tower.graph_inputs(), tmp_path / "audio.onnx", for_mnn=True)
    graph = onnx.load(str(tmp_path / "audio.onnx")).graph
    ops = {node.op_type for node in graph.node}
    assert "Gather" in ops and "Linear" in ops
    assert not ops & {"NonZero", "Compress", "Loop", "If", "SequenceConstruct"}
    # The only padding left is the causal convolution's fixed left pad: no pad depends on the input.
    dynamic = {i.name for i in graph.input}
    for node in graph.node:  # nodes are topologically sorted
        if any(name in dynamic for name in node.input):
            dynamic.update(node.output)
    pads = [node for node in graph.node if node.op_type == "Pad"]
    assert len(pads) == tower.args.layers and not any(node.input[1] in dynamic for node in pads)
    assert [i.name for i in graph.input] == ["input_features"] and [o.name for o in graph.output] == ["audio_embeds"]


def test_llm_config_names_the_tower_and_its_tokens(tiny):
    _, _, tower, _, _ = tiny
    config = tower.llm_config()
    assert config["is_audio"] is True and config["audio_type"] == "usm" and config["audio_model"] == "audio.mnn"
    assert (config["audio_start"], config["audio_end"], config["audio_pad"]) == (10, 11, 12)
    assert tower.linears()[-2].bias  # output_proj carries a bias


def test_audio_config_errors_are_loud():
    parse_audio_args(AUDIO_SMALL, 64, "cfg")
    with pytest.raises(InputError, match="channels"):
        parse_audio_args(dict(AUDIO_SMALL, subsampling_conv_channels=[64, 8]), 64, "cfg")
    with pytest.raises(InputError, match="hidden_act"):
        parse_audio_args(dict(AUDIO_SMALL, hidden_act="gelu"), 64, "cfg")
    with pytest.raises(InputError, match="multiple"):
        parse_audio_args(dict(AUDIO_SMALL, num_attention_heads=3), 64, "cfg")


@pytest.mark.parametrize("keys,what", [(AUDIO_TOKENS, "an audio"), (VISION_TOKENS, "a vision")])
def test_media_token_ids_take_either_spelling_and_a_missing_one_is_loud(keys, what):
    """Both towers read their runtime's token ids the same way: the first spelling set (transformers
    writes ``eoa_token_index``, older configs ``eoa_token_id``); a missing id names them all."""
    spellings = [key for alternatives in keys.values() for key in alternatives]
    last = {name: alternatives[-1] for name, alternatives in keys.items()}
    assert token_ids({key: 40 + i for i, key in enumerate(spellings)}, keys, what) == {
        name: 40 + spellings.index(alternatives[0]) for name, alternatives in keys.items()}
    assert token_ids({key: 7 for key in last.values()}, keys, what) == {name: 7 for name in keys}
    firsts = [alternatives[0] for alternatives in keys.values()]
    for missing in keys:
        config = {key: 3 for name, alternatives in keys.items() if name != missing for key in alternatives}
        config.update({alternative: None for alternative in keys[missing]})
        needs = f"^cfg: {what} checkpoint needs {firsts[0]}, {firsts[1]} and {firsts[2]}$"
        with pytest.raises(InputError, match=needs):
            token_ids(config, keys, f"cfg: {what} checkpoint")
