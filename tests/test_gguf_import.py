"""GGUF files made by llama.cpp's own tools (tests/gguf_fixtures.py) opened as the HF checkpoints they
were converted from (llmexport.source.importers.gguf): the config, every tensor (q/k rows put back),
the tokenizer, chat template and stop ids equal the checkpoint's; transformers' own GGUF loader
reads the same weights; the plan says which linears keep llama.cpp's integers and why the others do
not; hostile files are one-line InputErrors naming the file."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from gguf_fixtures import GEMMA4_VARIANTS, OUR_MIX, READS_AS, VARIANTS, gguf_views, has_llama_cpp, rewritten
from tokenizers import Tokenizer

from llmexport.api import plan
from llmexport.errors import InputError
from llmexport.options import ExportOptions
from llmexport.quant.scheme import QuantMethod
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.hub import resolve_source
from llmexport.source.importers.gguf.config import _llama3_factors, llama3_parameters
from llmexport.source.loading import open_architecture
from llmexport.tiny.tokenizer import TRAINING_CORPUS


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory):
    yield from gguf_views(tmp_path_factory)

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "tie_word_embeddings", "rope_parameters", "rms_norm_eps",
               "max_position_embeddings", "model_type", "architectures", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
#: a family's own config keys, compared too
_GEMMA_KEYS = ("layer_types", "sliding_window", "final_logit_softcapping", "hidden_activation", "attention_bias")
FAMILY_KEYS = {"gemma3": _GEMMA_KEYS + ("query_pre_attn_scalar",),
               "gemma4": _GEMMA_KEYS + ("num_kv_shared_layers", "use_double_wide_mlp", "hidden_size_per_layer_input",
                                        "vocab_size_per_layer_input", "attention_k_eq_v", "enable_moe_block",
                                        "top_k_experts")}
#: (family, variant) of every file read back: each family's, and Gemma4's 26B-A4B-style (MoE, K=V) and 31B-style
#: (K=V) files (tests/gguf_fixtures.py GEMMA4_VARIANTS)
GEMMA4_FILES = [pytest.param("gemma4", v, id=v) for v in GEMMA4_VARIANTS]
FILES = [pytest.param(family, None, id=family) for family in sorted(VARIANTS)] + GEMMA4_FILES
GEMMA_FILES = [pytest.param(family, None, id=family) for family in ("gemma3", "gemma4")] + GEMMA4_FILES


def _opened(path) -> Checkpoint:
    return Checkpoint.open(resolve_source(path).folder)


#: families whose file keeps their config in other terms (Phi3Config has no head_dim; LFM2's MLP width
#: comes back adjusted, its layer kinds from the kv head counts): their families' parsed arguments
#: are compared instead of config keys (and their logits, test_file_computes_the_checkpoint)
OWN_TERMS = ("phi3", "lfm2", "lfm2_moe")


@pytest.mark.parametrize(("family", "variant"), FILES)
def test_f32_file_is_the_checkpoint_it_was_converted_from(ggufs, family, variant):
    path, hf = ggufs(family, "f32", variant)
    ours, source = _opened(path), Checkpoint.open(hf)
    assert set(ours.weights.names()) == set(source.weights.names())
    for name in source.weights.names():
        assert torch.equal(ours.weights.tensor(name), source.weights.tensor(name).float()), name
    if family in OWN_TERMS:
        assert open_architecture(ours).args == open_architecture(source).args
        assert ours.config["rope_parameters"] == source.config["rope_parameters"]
        return
    keys = CONFIG_KEYS + FAMILY_KEYS.get(family, ())
    expected = {k: source.config.get(k) for k in keys}
    if "num_local_experts" in source.config:  # transformers 5 saves num_experts under its attribute_map name
        expected["num_experts"] = source.config["num_local_experts"]
    if family in READS_AS:  # Mistral is written as arch llama (test_file_computes_the_checkpoint)
        expected["model_type"], hf_class = READS_AS[family]
        expected["architectures"] = [hf_class]
    assert {k: ours.config.get(k) for k in keys} == expected
    if "attention_bias" in ours.config:  # Qwen2's class always has q/k/v biases: its key is not read
        assert ours.config["attention_bias"] == source.config["attention_bias"]
    if family in ("llama", "mistral"):  # llama.cpp permuted q/k rows: reading them as stored would be wrong
        from gguf import GGUFReader

        raw = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
        q = source.weights.tensor("model.layers.0.self_attn.q_proj.weight").float().numpy()
        assert not np.array_equal(raw["blk.0.attn_q.weight"], q)
        rope = "llama3" if family == "llama" else "default"  # llama3: from the rope_freqs tensor
        assert ours.config["rope_parameters"]["rope_type"] == rope
    if family == "gemma4":  # the full layers' head size and KV heads: transformers 5 saves them per layer
        from transformers import AutoConfig

        assert AutoConfig.for_model(**ours.config).to_dict()["per_layer_config"] == source.config["per_layer_config"]
    if family == "gemma3":  # the file holds 1 + weight (bf16 widened to fp32 first: the undo is exact)
        from gguf import GGUFReader

        raw = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
        gamma = source.weights.tensor("model.layers.0.pre_feedforward_layernorm.weight").float().numpy()
        assert np.array_equal(raw["blk.0.ffn_norm.weight"], gamma + 1) and not np.array_equal(gamma + 1, gamma)


#: (family, tiny variant or None for VARIANTS') -> the tensor the guard changes (a final norm's gamma;
#: LFM2's: a conv kernel)
GUARDED = {("mistral", None): "model.norm.weight", ("phi3", None): "model.norm.weight",
           ("phi3", "phi3.5"): "model.norm.weight", ("lfm2", None): "model.layers.0.conv.conv.weight",
           ("lfm2", "lfm2-dense-idxs"): "model.layers.1.conv.conv.weight",
           ("lfm2_moe", None): "model.layers.2.conv.conv.weight"}


@pytest.mark.parametrize(("family", "variant"), list(GUARDED), ids=lambda v: str(v or "-"))
def test_file_computes_the_checkpoint(ggufs, family, variant, tmp_path):
    """The HF model of the config read back, carrying the file's tensors, gives the checkpoint's logits:
    convert_hf_to_gguf.py writes a MistralForCausalLM as arch ``llama`` (no sliding window kept: for a
    Mistral without one the Llama read back is the model); Phi-3's fused qkv / gate_up, partial rotary
    and longrope factors (Phi-3.5-like: full rotary, untied); LFM2's layer kinds, squeezed conv kernels
    and adjusted MLP width (and attention first, conv kernel 4, untied); LFM2-MoE's stacked experts,
    router and selection bias."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path, hf = ggufs(family, "f32", variant)
    ours = _opened(path)
    if variant is not None:  # the other variants' arguments are compared in test_f32_file_is_the_checkpoint...
        assert open_architecture(ours).args == open_architecture(Checkpoint.open(hf)).args
    # the read-back checkpoint as a folder: transformers stacks per-expert tensors as its classes want them
    (tmp_path / "config.json").write_text(json.dumps(ours.config))
    save_file({n: ours.weights.tensor(n).contiguous() for n in ours.weights.names()}, tmp_path / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == ours.config["architectures"][0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert getattr(reference.config, "sliding_window", None) is None
    _assert_same_logits(model, reference, ours.config["vocab_size"], GUARDED[family, variant])


def _assert_same_logits(model, reference, vocab: int, guard: str) -> None:
    """``model`` gives ``reference``'s logits, and one changed value of the tensor ``guard`` shows."""
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
        model.get_parameter(guard).view(-1)[0] += 1.0  # not vacuous
        assert float((model(ids).logits - want).abs().max()) > 1e-2


def _read_back_model(ours: Checkpoint, **changes):
    """The HF model of the config read back (``changes`` made), carrying the weights read back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**ours.config, **changes}), dtype=torch.float32)
    missing, unexpected = model.load_state_dict({n: ours.weights.tensor(n) for n in ours.weights.names()}, strict=False)
    tied = ["lm_head.weight"] if ours.config["tie_word_embeddings"] else []
    assert not unexpected and not [n for n in missing if not n.endswith("inv_freq") and n not in tied], missing
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize(("family", "variant"), GEMMA_FILES)
def test_gemma_file_computes_the_checkpoint(ggufs, family, variant):
    """The model read back (built from its config, the weights loaded) gives the checkpoint's logits.
    Gemma3: llama.cpp's sliding pattern, attention scale and sliding RoPE base, recovered as its
    runtime derives them, and the norms' +1 taken off are the checkpoint's (tests/gguf_fixtures.py
    GEMMA3_GGUF), over a prompt longer than the sliding window. Gemma4: its layer pattern, head
    sizes, MLP widths, shared KV layers, PLE and the full layers' partial rotation (from
    ``rope_freqs``) read back; 26B-A4B's experts (HF's stacked tensors), router scales and MoE norms,
    K=V full layers with their own KV head count; 31B's K=V with an untied head."""
    from transformers import AutoModelForCausalLM

    path, hf = ggufs(family, "f32", variant)
    ours = _opened(path)
    model = _read_back_model(ours)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(reference).__name__ == ours.config["architectures"][0]
    assert getattr(reference.config, "sliding_window", None) == ours.config.get("sliding_window")
    _assert_same_logits(model, reference, ours.config["vocab_size"], "model.norm.weight")


@pytest.mark.skipif(not has_llama_cpp(), reason="llama-cpp-python (llama.cpp's runtime) is not installed")
@pytest.mark.parametrize(("family", "variant"), GEMMA_FILES)
def test_gemma_file_reads_back_as_the_model_llama_cpp_runs(ggufs, family, variant):
    """llama.cpp's own logits on the Gemma f32 files are those of the config read back, and not those
    of a config that differs in one key: Gemma3's attention scale (transformers' GGUF loader's
    query_pre_attn_scalar 256), layer pattern, full-layer RoPE scaling; Gemma4's sliding window,
    the full layers' partial rotation and (26B-A4B) the number of experts each token takes."""
    import llama_cpp

    path, _ = ggufs(family, "f32", variant)
    ours = _opened(path)
    ids = torch.randint(3, ours.config["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    f32 = llama_cpp.GGML_TYPE_F32  # an fp32 KV cache
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False,
                          type_k=f32, type_v=f32)
    llm.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(llm.scores[:ids.shape[1]]))

    def gap(**changes) -> float:
        with torch.no_grad():
            return float((_read_back_model(ours, **changes)(ids).logits[0] - theirs).abs().max())

    base = gap()  # llama.cpp's kernels: the gap grows along the prompt, to 0.007 (Gemma3), 0.04 (Gemma4 E2B-style)
    assert base < 0.1
    rope = ours.config["rope_parameters"]
    if family == "gemma3":
        full = {"rope_type": "default", "rope_theta": 1e6}
        others = [dict(query_pre_attn_scalar=256), dict(layer_types=["full_attention"] * 6)]
    else:
        full = {**rope["full_attention"], "partial_rotary_factor": 1.0}
        others = [dict(sliding_window=4096)] + ([dict(top_k_experts=1)] if ours.config["enable_moe_block"] else [])
    others.append(dict(rope_parameters={**rope, "full_attention": full}))
    # each other config at least 10x farther (the 3-layer 26B-A4B-style file's partial rotation: 0.49 vs 0.002)
    assert min(gap(**changes) for changes in others) > max(0.3, 10 * base)


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_tokenizer_template_and_stop_ids_are_the_checkpoints(ggufs, family):
    path, hf = ggufs("llama" if family == "llama" else family, "q8_0")
    folder = resolve_source(path).folder
    ours, theirs = Tokenizer.from_file(str(folder / "tokenizer.json")), Tokenizer.from_file(str(hf / "tokenizer.json"))
    texts = [line for line in TRAINING_CORPUS.split("\n") if line][:60]
    texts += ["<|im_start|>user\nhi<|im_end|>", "  two  spaces\n\nand 12345 digits", "naïve café"]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special).ids == \
                theirs.encode(text, add_special_tokens=special).ids, text
    assert ours.get_vocab() == theirs.get_vocab()
    template = (hf / "chat_template.jinja").read_text() if (hf / "chat_template.jinja").exists() else \
        json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == template
    eos = json.loads((hf / "generation_config.json").read_text())["eos_token_id"]
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    # Phi-3's generation_config also stops on <|assistant|>, which llama.cpp's end-of-generation set leaves out
    unkept = {theirs.token_to_id("<|assistant|>")} if family == "phi3" else set()
    assert set(eos if isinstance(eos, list) else [eos]) - unkept <= set(stops)


#: config values transformers' GGUF loader does not read from the file (passed to from_pretrained)
LOADER_MISSES = {"qwen3_moe": ("moe_intermediate_size",)}
#: families whose config transformers' loader cannot build from the file, given ours: Gemma4 (its per-layer
#: feed_forward_length fails the int check of intermediate_size; head_dim, the layer pattern, PLE width and
#: shared KV layers are not read)
LOADER_CONFIG = ("gemma4",)
#: tensors the loader does not map, left at their init (family or variant -> name endings): Gemma4's
#: ``layer_output_scale`` (``layer_scalar``); of a 26B-A4B-style file also its experts (``ffn_gate_up_exps``,
#: ``ffn_down_exps``) and router scales (``ffn_gate_inp.scale``, ``ffn_down_exps.scale``): transformers 5.25
#: loads such a file with a warning as a model whose MoE is random
LOADER_DROPS = {"gemma4": (".layer_scalar",),
                "gemma4-26b-a4b": (".layer_scalar", ".router.scale", ".router.per_expert_scale",
                                   ".experts.gate_up_proj", ".experts.down_proj")}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _loader_tensor(state: dict[str, torch.Tensor], name: str, width: int) -> torch.Tensor:
    """``name`` in transformers' state dict: an expert's rows of its stacked ``gate_up_proj`` /
    ``down_proj`` (Qwen3MoeExperts: gate before up)."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return state[name]
    prefix, e, part = match.group(1), int(match.group(2)), match.group(3)
    if part == "down":
        return state[f"{prefix}.down_proj"][e]
    rows = slice(0, width) if part == "gate" else slice(width, 2 * width)
    return state[f"{prefix}.gate_up_proj"][e, rows]


@pytest.mark.parametrize(("family", "variant"), [
    pytest.param(family, None, id=family)
    for family in ("llama", "mistral", "qwen2", "qwen3_moe", "phi3", "lfm2", "gemma3", "gemma4")] + [
    pytest.param("gemma4", "gemma4-26b-a4b", id="gemma4-26b-a4b")])
def test_transformers_gguf_loader_reads_the_same_weights(ggufs, family, variant):
    """transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``) dequantizes with
    gguf-py, undoes llama.cpp's permutation and stacks the experts: its model carries exactly our weights,
    but for the tensors it does not map (``LOADER_DROPS``)."""
    from transformers import AutoModelForCausalLM

    path, _ = ggufs(family, "q8_0", variant)
    ours = _opened(path)
    from transformers import AutoConfig

    missed: dict = {key: ours.config[key] for key in LOADER_MISSES.get(family, ())}
    if family in LOADER_CONFIG:
        missed["config"] = AutoConfig.for_model(**ours.config)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **missed)
    assert model.config.model_type == ours.config["model_type"]
    state = model.state_dict()
    dropped = [name for name in ours.weights.names() if name.endswith(LOADER_DROPS.get(variant or family, ()))]
    for name in set(ours.weights.names()) - set(dropped):
        loaded = _loader_tensor(state, name, ours.config.get("moe_intermediate_size") or 0)
        assert torch.equal(loaded, ours.weights.tensor(name)), name
    assert all(not torch.equal(state[name], ours.weights.tensor(name)) for name in dropped)
    assert len(ours.weights.names()) >= len([n for n in state if not n.endswith("inv_freq")]) - 1  # tied lm_head


def test_plan_keeps_the_integers_and_says_why_not(ggufs):
    q8, _ = ggufs("llama", "q8_0")
    kept = plan(q8, ExportOptions())
    assert kept.prequantized is not None and kept.prequantized.format == "gguf"
    assert all(linear.method is QuantMethod.STORED and linear.bits == 8 for linear in kept.linears)
    assert kept.prequantized.transcoded == len(kept.linears) == 4 * 7 + 1
    table = kept.prequantized.tables["embedding"]  # the untied token table keeps its Q8_0 integers too
    assert (table.stored, table.bits, table.block, table.kept) == ("Q8_0", 8, 32, True)
    q41, _ = ggufs("llama", "Q4_1")
    asym = plan(q41, ExportOptions())
    assert all(linear.method is QuantMethod.STORED and linear.bits == 4 and not linear.sym for linear in asym.linears)
    f16, _ = ggufs("llama", "f16")
    floats = plan(f16, ExportOptions()).prequantized
    assert floats is not None and floats.transcoded == 0
    assert {e.reason for e in floats.quantized_from_float} == {
        "F16 in the GGUF file: quantized by the export's options"}
    asked = plan(q8, ExportOptions(requantize=True)).prequantized
    assert asked is not None and {e.reason for e in asked.requantized} == {"requantize requested"}
    assert {e.stored for e in asked.requantized} == {"Q8_0"}


def test_stacked_experts_keep_each_experts_blocks(ggufs):
    """Qwen3-MoE's ``ffn_{gate,up,down}_exps`` ([experts, out, in], Q8_0) become one kept record per
    expert, each holding its own rows' blocks: expert e's scales are the ``d`` of the file's slice e."""
    from gguf import GGUFReader

    path, _ = ggufs("qwen3_moe", "q8_0")
    planned = plan(path, ExportOptions())
    experts = [linear for linear in planned.linears if ".mlp.experts." in linear.name]
    assert len(experts) == 4 * 8 * 3 and planned.prequantized is not None
    assert all(linear.method is QuantMethod.STORED and linear.bits == 8 for linear in experts)
    stored = [linear for linear in planned.linears if linear.method is QuantMethod.STORED]
    assert planned.prequantized.transcoded == len(stored) >= len(experts)
    raw = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    weights = _opened(path).weights
    for e in (0, 5):
        blocks = raw["blk.2.ffn_up_exps.weight"][e].reshape(32, -1, 34)  # moe width 32, Q8_0 blocks of 34 bytes
        stored = weights.prequantized(f"model.layers.2.mlp.experts.{e}.up_proj.weight")
        assert np.array_equal(stored.scales.numpy(), blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert not torch.equal(weights.tensor("model.layers.2.mlp.experts.0.up_proj.weight"),
                           weights.tensor("model.layers.2.mlp.experts.5.up_proj.weight"))


def test_llama3_rope_is_read_from_the_rope_freqs_tensor():
    for dim, theta, factor, original in ((128, 500000.0, 8.0, 8192), (64, 500000.0, 32.0, 8192), (16, 5e5, 8.0, 8192)):
        freqs = _llama3_factors(theta, dim, factor, 1.0, 4.0, original)
        params = llama3_parameters(freqs, theta, dim, "f")
        assert np.array_equal(_llama3_factors(theta, dim, params["factor"], params["low_freq_factor"],
                                              params["high_freq_factor"], params["original_max_position_embeddings"]),
                              freqs)
        assert params["factor"] == factor
    with pytest.raises(InputError, match="no llama3 scaling"):
        llama3_parameters(np.linspace(1, 3, 8, dtype=np.float32) ** math.pi, 5e5, 16, "f")


def test_phi3_rope_is_read_from_the_file(ggufs):
    """Phi-3's RoPE from the file's keys and factor tensors: longrope with the converter's own attention
    factor adds none (transformers derives the same), another one is kept; a file without factor
    tensors (Phi-3-mini-4k) is default RoPE, still partial when ``rope.dimension_count`` says so."""
    from llmexport.source.importers.gguf.config import Metadata, hf_config
    from llmexport.source.importers.gguf.file import GgufFile
    from llmexport.source.importers.gguf.folder import read_config

    path, hf = ggufs("phi3", "f32")
    file = GgufFile(path)
    assert read_config(file)["rope_parameters"] == Checkpoint.open(hf).config["rope_parameters"]
    shapes = {name: t.shape for name, t in file.tensors.items()}
    extras = {name: file.tensors[name].data for name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    scaled = hf_config(Metadata({**file.metadata, "phi3.rope.scaling.attn_factor": 1.5}, "f"), shapes, extras)
    assert scaled["rope_parameters"]["attention_factor"] == 1.5
    plain = hf_config(Metadata(file.metadata, "f"), shapes, {})
    assert plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    assert plain["sliding_window"] is None
    windowed = hf_config(Metadata({**file.metadata, "phi3.attention.sliding_window": 2047}, "f"), shapes, {})
    assert windowed["sliding_window"] == 2047


def test_gemma3_layer_pattern_is_llama_cpps():
    """llama.cpp's sliding layers (``set_swa_pattern``): a period (default 6: every sixth layer full),
    0 for all sliding, one flag per layer, and no sliding window for all full."""
    from llmexport.source.importers.gguf.gemma import layer_types
    from llmexport.source.importers.gguf.metadata import Metadata

    def kinds(**fields) -> str:
        meta = Metadata({f"gemma3.attention.{k}": v for k, v in fields.items()}, "f")
        return "".join(k[0] for k in layer_types(meta, lambda name: f"gemma3.{name}", 7))

    assert kinds(sliding_window=512) == "sssssfs"
    assert kinds(sliding_window=512, sliding_window_pattern=2) == "sfsfsfs"
    assert kinds(sliding_window=512, sliding_window_pattern=0) == "sssssss"
    assert kinds(sliding_window=512, sliding_window_pattern=[True, False] * 3 + [True]) == "sfsfsfs"
    assert kinds() == kinds(sliding_window=0) == "fffffff"


def _patched_type(src, dst) -> None:
    """``src`` with the first tensor's type id set to 99 (no GGML type)."""
    from gguf import GGUFReader

    tensor = GGUFReader(src).tensors[0]
    at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape)
    data = bytearray(src.read_bytes())
    data[at:at + 4] = (99).to_bytes(4, "little")
    dst.write_bytes(bytes(data))


def test_hostile_files_are_one_line_errors(ggufs, tmp_path):
    q8, _ = ggufs("llama", "q8_0")
    f32, _ = ggufs("llama", "f32")
    cases = {}
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + q8.read_bytes()[4:])
    cases["magic.gguf"] = "not a GGUF file"
    (tmp_path / "truncated.gguf").write_bytes(q8.read_bytes()[:q8.stat().st_size // 2])
    cases["truncated.gguf"] = "not a readable GGUF file"
    _patched_type(q8, tmp_path / "type.gguf")
    cases["type.gguf"] = "not a readable GGUF file"
    rewritten(f32, tmp_path / "arch.gguf", metadata={"general.architecture": "mamba"})
    cases["arch.gguf"] = "general.architecture 'mamba' is not supported"
    rewritten(f32, tmp_path / "pre.gguf", metadata={"tokenizer.ggml.pre": "bogus"})
    cases["pre.gguf"] = "tokenizer.ggml.pre 'bogus' is not supported"
    rewritten(f32, tmp_path / "extra.gguf", extra={"blk.0.weird.weight": np.zeros((4, 4), np.float32)})
    cases["extra.gguf"] = "tensor 'blk.0.weird.weight' has no HF counterpart"
    moe, _ = ggufs("qwen3_moe", "f32")
    rewritten(moe, tmp_path / "experts.gguf", metadata={"qwen3moe.expert_count": 4})
    gemma, _ = ggufs("gemma3", "f32")
    rewritten(gemma, tmp_path / "yarn.gguf", metadata={"gemma3.rope.scaling.type": "yarn"})
    cases["yarn.gguf"] = "'gemma3.rope.scaling.type' is 'yarn', expected 'linear' or 'none'"
    rewritten(gemma, tmp_path / "pattern.gguf", metadata={"gemma3.attention.sliding_window_pattern": [True] * 4})
    cases["pattern.gguf"] = "'gemma3.attention.sliding_window_pattern' must list one flag per layer (6)"
    gemma4, _ = ggufs("gemma4", "f32")
    rewritten(gemma4, tmp_path / "moe4.gguf", metadata={"gemma4.expert_count": 8,
                                                        "gemma4.expert_feed_forward_length": 32})
    cases["moe4.gguf"] = "tensor 'blk.0.ffn_gate_inp.weight' is missing (a gemma4 MoE file routes every layer)"
    k_eq_v, _ = ggufs("gemma4", "f32", "gemma4-31b")  # one full layer with attn_v, one without
    rewritten(k_eq_v, tmp_path / "kv.gguf", extra={"blk.2.attn_v.weight": np.zeros((32, 64), np.float32)})
    cases["kv.gguf"] = "tensor 'blk.5.attn_v.weight' is missing, but full layer 2 has one"
    values = {f"blk.{i}.attn_v.weight": np.zeros((32, 64), np.float32) for i in (2, 5)}  # no K=V, own KV heads
    rewritten(k_eq_v, tmp_path / "heads.gguf", extra=values)
    cases["heads.gguf"] = "full layers with other KV heads than the sliding ones have K=V in Gemma4"
    rewritten(gemma4, tmp_path / "widths.gguf", metadata={"gemma4.feed_forward_length": [96] * 7 + [128]})
    cases["widths.gguf"] = "neither one width nor one doubled on the KV-shared layers"
    cases["experts.gguf"] = "tensor 'blk.0.ffn_down_exps.weight' has shape [8, 64, 32], expected [4 experts, out, in]"
    phi3, _ = ggufs("phi3", "f32")  # longrope factors that do not fit the rotated dims
    rewritten(phi3, tmp_path / "longrope.gguf", metadata={"phi3.rope.dimension_count": 8})
    cases["longrope.gguf"] = "tensor 'rope_factors_long.weight' must hold 4 factors"
    lfm2, _ = ggufs("lfm2", "f32")  # no attention layer left
    rewritten(lfm2, tmp_path / "kinds.gguf", metadata={"lfm2.attention.head_count_kv": [0, 0, 0, 0]})
    cases["kinds.gguf"] = "metadata key 'lfm2.attention.head_count_kv' is [0, 0, 0, 0], expected one kv head count"
    for name, message in cases.items():
        with pytest.raises(InputError) as err:
            _opened(tmp_path / name)
        assert message in str(err.value) and name in str(err.value) and "\n" not in str(err.value), name
    two = tmp_path / "two"
    two.mkdir()
    for i in range(2):
        shutil.copy(q8, two / f"m{i}.gguf")
    with pytest.raises(InputError, match="holds 2 GGUF models.*name one with --gguf_file"):
        resolve_source(two)


def test_k_quant_mix_keeps_q4_k_and_q6_k(ggufs):
    """A ``Q4_K_M``-like mix (our packers, tests/gguf_fixtures.py) of the trained tiny Llama: Q4_K
    linears keep their integers as 4-bit asymmetric records of block 32, Q6_K ones as 8-bit
    symmetric records of block 16 (scale ``d * sc``); the planned records hold the file's values."""
    path, _ = ggufs.trained(OUR_MIX)
    planned = plan(path, ExportOptions())
    pre = planned.prequantized
    assert pre is not None and not pre.requantized and not pre.quantized_from_float
    kept = {linear.name: linear for linear in planned.linears if linear.method is QuantMethod.STORED}
    assert len(kept) == pre.transcoded == len(planned.linears)
    last = max(int(n.split(".")[2]) for n in kept if n.startswith("model.layers."))
    q6 = {f"model.layers.{i}.{m}" for i in (0, last) for m in ("self_attn.v_proj", "mlp.down_proj")}
    assert {n for n, k in kept.items() if (k.bits, k.block, k.sym) == (8, 16, True)} == q6
    assert all((k.bits, k.block, k.sym) == (4, 32, False) for n, k in kept.items() if n not in q6)
