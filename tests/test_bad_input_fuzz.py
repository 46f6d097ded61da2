"""Property: whatever is wrong in config.json or a safetensors header, only llmexport's typed,
one-line errors come out — never a traceback."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.errors import LlmExportError
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                 st.text(max_size=6), st.lists(st.integers(-1, 4), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
#: FUZZ_EXAMPLES=N runs N random examples (else a fixed, derandomized 60)
FUZZ_SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None,
                         derandomize=not os.environ.get("FUZZ_EXAMPLES"),
                         suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "layer_types", "per_layer_config", "num_kv_shared_layers", "rope_parameters",
             "vocab_size", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "sliding_window",
             "attention_k_eq_v", "enable_moe_block", "num_experts", "top_k_experts", "final_logit_softcapping",
             "rms_norm_eps", "tie_word_embeddings", "use_double_wide_mlp", "hidden_activation", "pad_token_id"]
HEADER_FIELDS = ["dtype", "shape", "data_offsets"]


def _run(path) -> None:
    try:
        arch = open_architecture(Checkpoint.open(path))
        arch.build_graph()
        arch.linears()
    except LlmExportError as exc:
        message = str(exc)
        assert message and "Traceback" not in message


@FUZZ_SETTINGS
@given(key=st.sampled_from(TEXT_KEYS + ["model_type", "text_config"]), value=JUNK, delete=st.booleans())
def test_mutated_config_gives_typed_errors(tiny_gemma4, tmp_path_factory, key, value, delete):
    path = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_gemma4("e2b"), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    target = config if key in ("model_type", "text_config") else config["text_config"]
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    (path / "config.json").write_text(json.dumps(config))
    _run(path)


@FUZZ_SETTINGS
@given(index=st.integers(0, 200), field=st.sampled_from(HEADER_FIELDS), value=JUNK, truncate=st.integers(0, 3))
def test_mutated_safetensors_header_gives_typed_errors(tiny_gemma4, tmp_path_factory, index, field, value, truncate):
    path = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_gemma4("31b"), path, dirs_exist_ok=True)
    file = path / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    header[names[index % len(names)]][field] = value
    raw = json.dumps(header).encode()
    body = data[8 + n:]
    body = body[: len(body) - truncate * 1000] if truncate else body
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    _run(path)


# --- generated instances of the hostile classes (tests/test_hostile_inputs.py has one of each) -----------
from pathlib import Path  # noqa: E402

from helpers import rewrite_safetensors_header  # noqa: E402
from hostile import (  # noqa: E402
    assert_refused,
    copy_model,
    make_old_dst,
    nested_json,
    poison,
    snapshot,
    tensor_names,
    write_index,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 40))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("FUZZ_EXAMPLES"),
                suppress_health_check=[HealthCheck.function_scoped_fixture])
SAME_SIZE_NON_FLOAT = {1: ["I8", "U8", "BOOL"], 2: ["I16"], 4: ["I32", "U32"], 8: ["I64", "F64"]}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
ESCAPING_SHARDS = st.one_of(
    st.builds(lambda n, name: "../" * n + name, st.integers(1, 4),
              st.sampled_from(["x.safetensors", "model.safetensors"])),
    st.builds(lambda name: "/" + name, st.sampled_from(["etc/passwd", "dev/zero", "tmp/model.safetensors"])),
    st.builds(lambda a, n: f"{a}/" + "../" * n + "model.safetensors", st.sampled_from(["sub", "a/b"]),
              st.integers(2, 4)),
    st.sampled_from(["", "..", ".", "a\\..\\..\\model.safetensors", "model.bin", "model.safetensors\x00.txt"]),
)


def _refuses_plan(path, *needles) -> None:
    """The input checks every export runs first (``plan`` = --dry-run) refuse the checkpoint."""
    from llmexport import plan
    from llmexport.errors import InputError

    try:
        plan(path)
    except InputError as exc:
        message = str(exc)
        assert len(message.splitlines()) == 1 and "Traceback" not in message
        for needle in needles:
            assert needle in message, (needle, message)
        return
    raise AssertionError("the hostile checkpoint was accepted")


def _header(model: Path) -> dict:
    data = (model / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


@FUZZ
@given(picks=st.lists(st.integers(0, 10_000), min_size=2, max_size=6, unique=True), shift=st.integers(0, 7))
def test_generated_overlapping_offsets_are_refused(tiny_gemma4, tmp_path_factory, picks, shift):
    model = copy_model(tiny_gemma4("31b", text_only=True), tmp_path_factory.mktemp("fuzz"))
    names = tensor_names(model)
    chosen = [names[i % len(names)] for i in picks]
    target = _header(model)[chosen[0]]["data_offsets"]

    def alias(header):
        for name in dict.fromkeys(chosen[1:]):  # every chosen tensor starts inside the first one's bytes
            if name == chosen[0]:
                continue
            size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            begin = target[0] + min(shift * 2, max(0, target[1] - target[0] - 2))
            header[name]["data_offsets"] = [begin, begin + size]

    rewrite_safetensors_header(model / "model.safetensors", alias)
    _refuses_plan(model, "model.safetensors")


@FUZZ
@given(pick=st.integers(0, 10_000), choice=st.integers(0, 2))
def test_generated_non_float_dtypes_are_refused(tiny_gemma4, tmp_path_factory, pick, choice):
    model = copy_model(tiny_gemma4("e2b", text_only=True), tmp_path_factory.mktemp("fuzz"))
    names = tensor_names(model)
    name = names[pick % len(names)]
    stored = _header(model)[name]["dtype"]
    options = SAME_SIZE_NON_FLOAT[ITEMSIZE[stored]]
    dtype = options[choice % len(options)]
    rewrite_safetensors_header(model / "model.safetensors", lambda h: h[name].__setitem__("dtype", dtype))
    _refuses_plan(model, repr(name), dtype)


@FUZZ
@given(pick=st.integers(0, 10_000), shard=ESCAPING_SHARDS)
def test_generated_escaping_index_shards_are_refused(tiny_gemma4, tmp_path_factory, pick, shard):
    model = copy_model(tiny_gemma4("31b", text_only=True), tmp_path_factory.mktemp("fuzz"))
    names = tensor_names(model)
    (model.parent / "x.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[pick % len(names)]] = shard
    write_index(model, weight_map)
    _refuses_plan(model, "model.safetensors.index.json")


@FUZZ
@given(pick=st.integers(0, 10_000), drop=st.booleans(), extra=st.text(min_size=1, max_size=12))
def test_generated_index_header_disagreements_are_refused(tiny_gemma4, tmp_path_factory, pick, drop, extra):
    model = copy_model(tiny_gemma4("31b", text_only=True), tmp_path_factory.mktemp("fuzz"))
    names = tensor_names(model)
    weight_map = {n: "model.safetensors" for n in names}
    if drop:
        del weight_map[names[pick % len(names)]]
    else:
        weight_map["extra." + extra] = "model.safetensors"
    write_index(model, weight_map)
    _refuses_plan(model)


@FUZZ
@given(depth=st.integers(1_500, 150_000), where=st.sampled_from(["config", "header", "tokenizer", "index"]))
def test_generated_deep_nesting_is_refused(tiny_gemma4, tmp_path_factory, depth, where):
    model = copy_model(tiny_gemma4("31b", text_only=True), tmp_path_factory.mktemp("fuzz"))
    deep = nested_json(depth)
    if where == "config":
        config = (model / "config.json").read_text().rstrip().rstrip("}")
        (model / "config.json").write_text(config + ', "deep": ' + deep + "}")
    elif where == "tokenizer":
        (model / "tokenizer_config.json").write_text('{"deep": ' + deep + "}")
    elif where == "index":
        (model / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
    else:
        raw = ('{"deep": ' + deep + "}").encode()
        body = (model / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", body[:8])
        (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body[8 + n:])
    _refuses_plan(model)


NAN_EXAMPLES = max(4, EXAMPLES // 5)


@settings(max_examples=NAN_EXAMPLES, deadline=None, derandomize=not os.environ.get("FUZZ_EXAMPLES"),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(["e2b", "31b", "26b-a4b"]), pick=st.integers(0, 10_000), row=st.integers(0, 40),
       value=st.sampled_from([math.nan, math.inf, -math.inf]), bits=st.sampled_from(["4", "8", "16"]),
       embed_bits=st.sampled_from(["4", "8", "16"]))
def test_generated_non_finite_values_anywhere_are_refused_by_name(tiny_gemma4, tmp_path_factory, shape, pick, row,
                                                                  value, bits, embed_bits):
    from click.testing import CliRunner

    from llmexport.cli import main

    work = tmp_path_factory.mktemp("fuzz")
    model = copy_model(tiny_gemma4(shape, text_only=True), work)
    dst = make_old_dst(work)
    names = tensor_names(model)
    name = names[pick % len(names)]
    poison(model, name, value, row=row)
    before = snapshot(work)
    result = CliRunner().invoke(main, ["--path", str(model), "--dst_path", str(dst), "--quant_bit", bits,
                                       "--embed_bit", embed_bits])
    assert_refused(result.exit_code, result.output, work, before, [repr(name)], codes=(3,))


@FUZZ
@given(relation=st.sampled_from(["same", "ancestor", "descendant"]), depth=st.integers(1, 3),
       spelling=st.sampled_from(["absolute", "dotted", "trailing_slash", "symlink"]))
def test_generated_overlapping_destinations_are_refused(tiny_gemma4, tmp_path_factory, relation, depth, spelling):
    from click.testing import CliRunner

    from llmexport.cli import main

    work = tmp_path_factory.mktemp("fuzz")
    model = copy_model(tiny_gemma4("31b", text_only=True), work / "a" / "b" / "c")
    if relation == "same":
        dst = model
    elif relation == "ancestor":
        dst = model.parents[depth - 1]
    else:
        dst = model.joinpath(*["sub"] * depth)
    if spelling == "dotted":
        dst = Path(str(dst.parent / "." / ".." / dst.parent.name / dst.name))
    elif spelling == "symlink":
        (work / "link").symlink_to(dst, target_is_directory=True)
        dst = work / "link"
    text = str(dst) + ("/" if spelling == "trailing_slash" else "")
    before = snapshot(work)
    result = CliRunner().invoke(main, ["--path", str(model), "--dst_path", text])
    assert_refused(result.exit_code, result.output, work, before, ["overlaps --path"], codes=(2,))


@FUZZ
@given(shape=st.sampled_from(["e2b", "26b-a4b"]),
       key=st.sampled_from(["num_hidden_layers", "num_experts", "num_kv_shared_layers", "vocab_size", "hidden_size",
                            "top_k_experts", "hidden_size_per_layer_input", "head_dim", "num_attention_heads"]),
       value=st.one_of(st.integers(10 ** 6, 10 ** 12), st.integers(-10 ** 12, -1), st.just(10 ** 30)))
def test_generated_huge_counts_fail_fast_with_typed_errors(tiny_gemma4, tmp_path_factory, shape, key, value):
    model = copy_model(tiny_gemma4(shape, text_only=True), tmp_path_factory.mktemp("fuzz"))
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    if shape == "e2b" and key in ("num_experts", "top_k_experts"):
        from llmexport import plan

        plan(model)  # a MoE size without a MoE block is ignored, as transformers ignores it
        return
    _refuses_plan(model)  # named: config.json's key, or the tensor whose shape disagrees with it
