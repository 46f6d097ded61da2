"""Test data: GGUF files made by llama.cpp's own tools from our tiny checkpoints, cached on disk.

* ``convert_hf_to_gguf.py`` of the llama-cpp-python sdist (tests/real_vocab.py fetches it; its
  ``conversion/`` package and ``gguf-py`` come with it) converts a tiny checkpoint to ``f32``,
  ``f16`` or ``q8_0``. It names a BPE pre-tokenizer by a hash of a released tokenizer's ids, so a
  tokenizer trained in a test is "not recognized": the run names it (``PRE``: ``llama-bpe`` for the
  Llama-3 style tokenizer, ``qwen2`` for the Qwen one), as ``convert_hf_to_gguf_update.py`` would.
* ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1`` files: the ``f32`` file with every 2-D weight quantized by
  gguf-py's ``gguf.quants.quantize`` (llama.cpp's Python reference of ``ggml-quants.c``).
* K-quants (``Q4_K_M``, ``Q6_K``, ...) need llama.cpp's C quantizer: ``llama_cpp.llama_model_quantize``
  when llama-cpp-python is installed (``k_quant``), else the caller skips those cases.

Files live in ``<test data cache>/gguf/`` (tests/real_vocab.py ``cache_dir``), named by the
checkpoint builder, seed, type and the sdist version; a lock keeps parallel workers from racing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from llmexport.tiny.decoders import build_decoder_checkpoint, build_tiny_decoder, variant_config

from real_vocab import SDIST_FILE, cache_dir, sdist_path
from real_vocab import _locked as locked

CONVERT_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
#: the pre-tokenizer name each tiny family's tokenizer stands for (Phi-3's and Gemma's vocabularies are
#: SentencePiece: no pre-tokenizer; the tiny LFM2 tokenizers split text as Qwen's do)
PRE = {"llama": "llama-bpe", "mistral": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3_moe": "qwen2",
       "phi3": "default", "lfm2": "qwen2", "lfm2_moe": "qwen2", "gemma3": "default", "gemma4": "default"}
#: types gguf-py quantizes in Python, with llama.cpp's file type of each (``llama_ftype``)
PY_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9}
PY_TYPES = tuple(PY_FILE_TYPES)
#: llama.cpp's file types (``llama_ftype``) the C quantizer makes
K_FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q4_0": 2, "Q4_1": 3, "IQ4_NL": 25, "Q3_K_M": 12, "Q2_K": 10}


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder):
        yield


def folder() -> Path:
    return cache_dir() / "gguf"


def converter() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` with its packages, extracted from the sdist once."""
    root = folder() / "convert"
    script = root / CONVERT_DIR / "convert_hf_to_gguf.py"
    with _locked(folder()):
        if not script.exists():
            with tarfile.open(sdist_path()) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(CONVERT_DIR) and (
                    m.name == CONVERT_DIR + "convert_hf_to_gguf.py" or m.name.startswith(
                        (CONVERT_DIR + "conversion/", CONVERT_DIR + "gguf-py/")))]
                tar.extractall(root, members=members, filter="data")
    return script


#: the wrapper that runs the converter with the pre-tokenizer named (argv: script, pre, args...)
_RUN = """
import runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, str(__import__('pathlib').Path(script).parent))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name='__main__')
"""


def convert(checkpoint: Path, pre: str, outtype: str, out: Path, *extra: str) -> Path:
    """``convert_hf_to_gguf.py checkpoint --outtype outtype [extra]`` into ``out`` (split into
    ``<out stem>-0000i-of-0000n.gguf`` beside it by ``--split-max-tensors``)."""
    cmd = [sys.executable, "-c", _RUN, str(converter()), pre, str(checkpoint), "--outtype", outtype,
           "--outfile", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not (out.exists() or any(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))):
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


def rewritten(source: Path, out: Path, qtype: str | None = None, metadata: dict | None = None,
              extra: dict[str, np.ndarray] | None = None, mix: dict[str, str] | None = None) -> Path:
    """A copy of ``source`` (an f32 file) with every 2-D weight quantized to ``qtype`` by gguf-py's
    ``gguf.quants.quantize`` (when given; ``mix``: the type of named tensors, K-quants by our
    packers), ``metadata`` values replaced or added and ``extra`` tensors added."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    reader = GGUFReader(source)
    metadata = metadata or {}
    arch = metadata.get("general.architecture", reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, str(arch))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        value = metadata.get(key, field.contents())
        if key == "general.file_type" and qtype is not None:
            value = PY_FILE_TYPES.get(qtype, K_FTYPES.get(qtype, value))
        writer.add_key_value(key, value, field.types[0], sub)
    for key, value in metadata.items():  # keys the file lacks
        if key not in reader.fields and key != "general.architecture":
            add = {list: writer.add_array, bool: writer.add_bool, int: writer.add_uint32,
                   float: writer.add_float32, str: writer.add_string}[type(value)]
            add(key, value)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        chosen = (mix or {}).get(tensor.name) or (qtype if data.ndim == 2 and tensor.name.endswith(".weight")
                                                  and data.shape[1] % 32 == 0 else None)
        if chosen is None:
            writer.add_tensor(tensor.name, data)
        elif chosen in OUR_PACKERS:
            writer.add_tensor(tensor.name, OUR_PACKERS[chosen](data), raw_dtype=GGMLQuantizationType[chosen])
        else:
            kind = GGMLQuantizationType[chosen]
            writer.add_tensor(tensor.name, quantize(data.astype(np.float32), kind), raw_dtype=kind)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def pack_q4_k(rows: np.ndarray) -> np.ndarray:
    """Our own ``Q4_K`` packer, from the block layout (llmexport.source.importers.gguf.blocks): per 32
    values a scale and a min over the sub-block's range, both as 6-bit multiples of the super-block's
    fp16 ``d`` / ``dmin``; llama.cpp's search for better scales is not reproduced (any valid blocks do)."""
    x = rows.astype(np.float32).reshape(rows.shape[0], -1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mins = np.maximum(hi - lo, 1e-8) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 6e-8), np.maximum(dmin.astype(np.float32), 6e-8)
    sc = np.clip(np.rint(scale / d32[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / dmin32[..., None]), 0, 63).astype(np.uint8)
    step, low = (d32[..., None] * sc)[..., None], (dmin32[..., None] * m)[..., None]
    q = np.clip(np.rint((x + low) / step), 0, 15).astype(np.uint8)
    packed = np.zeros((*sc.shape[:-1], 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    runs = q.reshape(*q.shape[:2], 4, 2, 32)
    nibbles = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    block = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, nibbles], -1)
    return block.reshape(rows.shape[0], -1)


def pack_q6_k(rows: np.ndarray) -> np.ndarray:
    """Our own ``Q6_K`` packer: per 16 values an int8 scale times the super-block's fp16 ``d``,
    levels ``q - 32`` of 6 bits (low nibbles in ``ql``, high 2 bits in ``qh``)."""
    x = rows.astype(np.float32).reshape(rows.shape[0], -1, 16, 16)
    amax = np.maximum(np.abs(x).max(-1), 1e-8) / 31
    d = (amax.max(-1) / 127).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 6e-8)
    sc = np.clip(np.rint(amax / d32[..., None]), 1, 127).astype(np.int8)
    q = (np.clip(np.rint(x / (d32[..., None] * sc)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(*q.shape[:2], 2, 4, 32)  # [half, quarter s, i]: value 128 h + 32 s + i
    low = q & 15
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], -1)
    high = q >> 4
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    block = np.concatenate([ql.reshape(*q.shape[:2], 128), qh.reshape(*q.shape[:2], 64), sc.view(np.uint8),
                            d[..., None].view(np.uint8)], -1)
    return block.reshape(rows.shape[0], -1)


#: the type name of ``k_mix``'s files
OUR_MIX = "ours-Q4_K_M"
#: K-quant types packed by our own packers (gguf-py has no Python quantizer for them)
OUR_PACKERS = {"Q4_K": pack_q4_k, "Q6_K": pack_q6_k}


def k_mix(source: Path, out: Path) -> Path:
    """``source`` as a ``Q4_K_M``-like mix made by our packers: Q6_K for ``output.weight`` and the
    first and last layers' ``attn_v`` / ``ffn_down`` (llama.cpp gives some of those more bits), Q4_K
    for every other 2-D weight whose rows hold whole 256-value super-blocks."""
    from gguf import GGUFReader

    tensors = GGUFReader(source).tensors
    last = max(int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk."))
    mix = {}
    for t in tensors:
        if len(t.shape) != 2 or int(t.shape[0]) % 256:
            continue
        wide = t.name == "output.weight" or (t.name.endswith(("attn_v.weight", "ffn_down.weight"))
                                             and int(t.name.split(".")[1]) in (0, last))
        mix[t.name] = "Q6_K" if wide else "Q4_K"
    return rewritten(source, out, metadata={"general.file_type": K_FTYPES["Q4_K_M"]}, mix=mix)


def k_quant(source: Path, ftype: str, out: Path) -> Path:
    """llama.cpp's own quantizer (``llama_model_quantize``) on ``source`` (llama-cpp-python installed)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = K_FTYPES[ftype]
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.exists():
        raise RuntimeError(f"llama_model_quantize {ftype} failed (rc={rc})")
    return out


def has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_file(name: str, build: Callable[[Path], Path], family: str, qtype: str) -> Path:
    """The cached GGUF file of the checkpoint ``build(folder)`` makes (``name`` keys it), of type
    ``qtype``: "f32"/"f16"/"q8_0" (converter), ``PY_TYPES`` (gguf-py), ``OUR_MIX`` (our K-quant
    packers) or ``K_FTYPES`` (llama.cpp's quantizer)."""
    root = folder()
    out = root / f"{name}-{qtype}-{SDIST_FILE.removesuffix('.tar.gz')}.gguf"
    if out.exists():
        return out
    converted = qtype in ("f32", "f16", "q8_0")
    source = None if converted else gguf_file(name, build, family, "f32")  # before the lock: it takes it too
    with _locked(root / name):
        if out.exists():
            return out
        part = out.with_suffix(".part")
        if source is not None:
            if qtype in PY_TYPES:
                rewritten(source, part, qtype)
            elif qtype == OUR_MIX:
                k_mix(source, part)
            else:
                k_quant(source, qtype, part)
        else:
            checkpoint = root / name / "hf"
            if not (checkpoint / "config.json").exists():
                build(checkpoint)
            convert(checkpoint, PRE[family], qtype, part)
        part.replace(out)
    return out


#: family -> the tiny decoder variant converted (qwen2 without sliding layers: GGUF keeps none)
VARIANTS = {"llama": "llama3", "mistral": "mistral-full", "qwen2": "qwen2-tied", "qwen3": "qwen3",
            "qwen3_moe": "qwen3-moe", "phi3": "phi4-mini", "lfm2": "lfm2-dense", "lfm2_moe": "lfm2-moe",
            "gemma3": "gemma3-gguf", "gemma4": "gemma4-gguf"}
#: variants made here only: (tiny decoder variant, config overrides). Mistral without a sliding window
#: (Mistral 7B v0.2/v0.3's config): convert_hf_to_gguf.py writes Mistral as arch ``llama`` and keeps no
#: ``sliding_window``, so only a full-attention Mistral is the model its file describes
OWN_VARIANTS = {"mistral-full": ("mistral", {"sliding_window": None})}
#: family -> (model_type, HF class) its GGUF file reads back as, where that is not the family's own
READS_AS = {"mistral": ("llama", "LlamaForCausalLM")}


def tiny_gguf(family: str, qtype: str, variant: str | None = None) -> Path:
    """The cached GGUF file of ``family``'s tiny checkpoint (``variant``, default ``VARIANTS``), of type ``qtype``."""
    variant = variant or VARIANTS[family]
    return gguf_file(f"tiny-{variant}-s0", lambda out: build_variant(out, variant), family, qtype)


def split_gguf(family: str, qtype: str, max_tensors: int) -> Path:
    """The tiny ``family`` checkpoint as convert_hf_to_gguf.py writes it with ``--split-max-tensors``:
    the first of its parts (``model-00001-of-0000n.gguf``), cached with the others beside it."""
    name = f"tiny-{VARIANTS[family]}-s0"
    tiny_gguf(family, "f32")  # the checkpoint, built and converted once
    parts = folder() / f"{name}-{qtype}-split{max_tensors}-{SDIST_FILE.removesuffix('.tar.gz')}"
    with _locked(folder() / name):
        if not parts.exists():
            staging = parts.with_name(parts.name + ".part")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            convert(folder() / name / "hf", PRE[family], qtype, staging / "model.gguf",
                    "--split-max-tensors", str(max_tensors))
            staging.replace(parts)
    return next(parts.glob("model-00001-of-*.gguf"))


def build_phi3(variant: str) -> Callable[[Path], Path]:
    """The tiny Phi-3 ``variant`` (llmexport.tiny.phi3: ``phi4-mini`` with partial rotary, longrope and
    a tied head; ``phi3.5`` with full rotary and an untied head) with its ``tokenizer.model``."""
    def build(out: Path) -> Path:
        from llmexport.tiny.phi3 import build_tiny_phi3

        build_tiny_phi3(out, variant, seed=0)
        (out / "tokenizer.model").write_bytes(spm_model(out / "tokenizer.json", dummy_prefix=True))
        return out

    return build


def build_lfm2(variant: str) -> Callable[[Path], Path]:
    """The tiny LFM2 ``variant`` (llmexport.tiny.lfm2): ``dense`` (conv, attention, conv, attention; its
    MLP width adjusted by the config), ``dense-idxs`` (attention first, conv kernel 4, untied), ``moe``
    (one dense layer, then sigmoid-routed experts with a selection bias, renormalised: LFM2-8B-A1B's
    router, which llama.cpp's graph assumes)."""
    def build(out: Path) -> Path:
        from llmexport.tiny.lfm2 import build_tiny_lfm2

        return build_tiny_lfm2(out, variant, seed=0)

    return build


#: variants built by their own families' builders
FAMILY_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "phi4-mini": build_phi3("phi4-mini"), "phi3.5": build_phi3("phi3.5"), "lfm2-dense": build_lfm2("dense"),
    "lfm2-dense-idxs": build_lfm2("dense-idxs"), "lfm2-moe": build_lfm2("moe"),
    "gemma3-gguf": lambda out: build_gemma3_for_gguf(out), "gemma4-gguf": lambda out: build_gemma4_for_gguf(out),
    "gemma4-26b-a4b": lambda out: build_gemma4_for_gguf(out, "26b-a4b"),
    "gemma4-31b": lambda out: build_gemma4_for_gguf(out, "31b")}
#: Gemma4's other GGUF files: the 26B-A4B-style MoE (dense MLP beside 8 experts, top 2; K=V full layers with
#: their own KV head count; three layers: its MNN export is the slow part) and the 31B-style dense one (K=V,
#: untied head), llmexport.tiny.gemma4 SHAPES
GEMMA4_VARIANTS = ("gemma4-26b-a4b", "gemma4-31b")


def build_variant(out: Path, variant: str) -> Path:
    """The tiny checkpoint ``variant`` (a tiny decoder variant, one of ``OWN_VARIANTS`` or of
    ``FAMILY_BUILDERS``) in ``out``."""
    if variant in FAMILY_BUILDERS:
        return FAMILY_BUILDERS[variant](out)
    if variant not in OWN_VARIANTS:
        return build_tiny_decoder(out, variant, seed=0)
    base, overrides = OWN_VARIANTS[variant]
    family, config = variant_config(base)
    return build_decoder_checkpoint(out, family, {**config, **overrides}, seed=0)


#: a tiny Gemma3 as llama.cpp runs its GGUF file (src/models/gemma3.cpp, which the file must describe):
#: the sliding pattern is llama.cpp's default five sliding layers to one full (the converter writes no
#: pattern) and the attention scale is head_dim ** -0.5 (llama.cpp assumes query_pre_attn_scalar =
#: head_dim, hidden / heads for the 62-layer 27B); two RoPE bases, linear scaling on the full layers
#: (Gemma 3 4B's), final logit softcapping, tied embeddings, bf16 (as Google's checkpoints)
GEMMA3_GGUF = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1_000_000.0}})


#: the tiny E2B-style Gemma4 (PLE, KV sharing, double-wide MLP on shared layers, proportional RoPE on
#: full layers) with the last two unshared layers sliding then full, as in the released E2B/E4B:
#: llama.cpp (``llama_model::create_memory``) gives a shared layer the KV of layer ``first_shared - 2``
#: (sliding) or ``first_shared - 1`` (full), HF the last unshared layer of its type
_S, _F = "sliding_attention", "full_attention"
GEMMA4_GGUF = dict(layer_types=[_S, _S, _F, _S, _F, _S, _S, _F])


def build_gemma3_for_gguf(out: Path) -> Path:
    """``GEMMA3_GGUF`` with a ``tokenizer.model`` (``spm_model``), as Google's Gemma3 repos have: the
    converter then writes the SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``)."""
    from llmexport.tiny.gemma3 import BASE, build_gemma3_checkpoint

    assert GEMMA3_GGUF["query_pre_attn_scalar"] == BASE["head_dim"]
    build_gemma3_checkpoint(out, {**BASE, **GEMMA3_GGUF}, seed=0)
    (out / "tokenizer.model").write_bytes(spm_model(out / "tokenizer.json", dummy_prefix=False))
    return out


def build_gemma4_for_gguf(out: Path, shape: str = "e2b") -> Path:
    """The tiny Gemma4 ``shape`` (llmexport.tiny.gemma4 SHAPES), text only; the E2B-style one with
    ``GEMMA4_GGUF``'s layer pattern."""
    from llmexport.tiny.gemma4 import SHAPES, build_gemma4_checkpoint, text_config_dict

    overrides = GEMMA4_GGUF if shape == "e2b" else \
        {"layer_types": [_S, _S, _F], "num_hidden_layers": 3} if shape == "26b-a4b" else {}
    return build_gemma4_checkpoint(out, {**text_config_dict(SHAPES[shape]), **overrides}, seed=0, text_only=True)


def spm_model(tokenizer_json: Path, dummy_prefix: bool) -> bytes:
    """The SentencePiece ``tokenizer.model`` of a tiny BPE tokenizer.json with byte fallback and
    spaces as U+2581 (the converters of Phi-3 and Gemma read the vocabulary from it only): each piece
    a merge makes scores minus the rank of the first merge making it, so SentencePiece's
    highest-score-first merging replays the BPE merges; specials are control pieces, ``<0xNN>`` byte
    pieces, pieces no merge makes score -1e9. ``dummy_prefix``: SentencePiece prepends U+2581 to
    the text (Llama-2's and Phi-3's vocabularies) or not (Gemma's)."""
    import json

    from sentencepiece import sentencepiece_model_pb2 as spm

    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        rank.setdefault("".join(m if isinstance(m, list) else m.split(" ", 1)), r)
    proto = spm.ModelProto()
    kinds = spm.ModelProto.SentencePiece
    for piece, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        entry = proto.pieces.add()
        entry.piece = piece
        if piece == data["model"]["unk_token"]:
            entry.type, entry.score = kinds.UNKNOWN, 0.0
        elif idx in special:
            entry.type, entry.score = kinds.CONTROL, 0.0
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            entry.type, entry.score = kinds.BYTE, 0.0
        else:
            entry.type = kinds.NORMAL
            entry.score = -float(rank[piece]) if piece in rank else (0.0 if len(piece) == 1 else -1e9)
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(vocab)
    proto.trainer_spec.unk_id = vocab[data["model"]["unk_token"]]
    for key, text in (("bos_id", "<bos>"), ("eos_id", "<eos>"), ("pad_id", "<pad>")):  # Gemma's; else the defaults
        if text in vocab:
            setattr(proto.trainer_spec, key, vocab[text])
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return proto.SerializeToString()


def gguf_views(tmp_path_factory) -> Iterator[Callable[[str, str], tuple[Path, Path]]]:
    """The body of the test modules' session fixture ``ggufs``: (family, type[, variant]) -> (the cached
    GGUF file, the HF checkpoint it was converted from; ``variant`` default ``VARIANTS[family]``); the
    files' HF views in a session folder."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMEXPORT_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf-views")))

    def get(family: str, qtype: str, variant: str | None = None):
        variant = variant or VARIANTS[family]
        path = tiny_gguf(family, qtype, variant)
        return path, path.parent / f"tiny-{variant}-s0" / "hf"

    def trained(qtype: str):
        """The trained tiny Llama (hidden 256: whole K-quant super-blocks) as a GGUF file of ``qtype``."""
        from llmexport.tiny.trained import trained_checkpoint

        source = trained_checkpoint("llama")
        path = gguf_file(f"trained-{source.name}", lambda out: Path(shutil.copytree(source, out)), "llama", qtype)
        return path, source

    get.trained = trained  # type: ignore[attr-defined]

    yield get
    mp.undo()
