"""Hostile or unlucky inputs never destroy or misread the user's data.

Each case must end in one ``llmexport: error:`` line with a documented exit code (2-6), the
checkpoint and ``--dst_path`` unchanged and nothing left beside them. Cases that could hang or
allocate without bound run in a child process with a time limit.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from llmexport.cli import main

from helpers import rewrite_safetensors_header
from hostile import (
    assert_refused,
    copy_model,
    make_old_dst,
    nested_json,
    overlap_offsets,
    poison,
    replace_tensor,
    run_cli,
    snapshot,
    tensor_names,
    write_index,
)

Q = "model.layers.0.self_attn.q_proj.weight"  # text-only checkpoints: prefix "model."
NORM = "model.layers.0.input_layernorm.weight"


def _cli(*args: str, cwd: Path | None = None):
    return CliRunner().invoke(main, list(args))


@pytest.fixture()
def case(tiny_gemma4, tmp_path):
    """``case(shape)`` -> (model copy, old dst) under tmp_path/work, with a snapshot taken later."""
    def make(shape: str = "31b", text_only: bool = True):
        work = tmp_path / "work"
        work.mkdir(exist_ok=True)
        return copy_model(tiny_gemma4(shape, text_only=text_only), work), make_old_dst(work)
    return make


def _export(model: Path, dst: Path, *flags: str):
    return _cli("--path", str(model), "--dst_path", str(dst), *flags)


def _refused(result, work: Path, before, *needles, codes=range(2, 7)):
    assert_refused(result.exit_code, result.output, work, before, needles, codes)


# --- overlapping source and destination ------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "dst_contains_path", "path_contains_dst", "symlink_to_path"])
def test_destination_overlapping_the_checkpoint_is_refused_before_any_work(case, where):
    model, _ = case()
    work = model.parent
    dst = {"same": model, "dst_contains_path": work, "path_contains_dst": model / "mnn",
           "symlink_to_path": work / "link"}[where]
    if where == "symlink_to_path":
        dst.symlink_to(model, target_is_directory=True)
    before = snapshot(work)
    _refused(_export(model, dst), work, before, "--dst_path", "overlaps --path", codes=(2,))


def test_dst_dot_is_refused(case):
    model, _ = case()
    work = model.parent
    before = snapshot(work)
    code, output = run_cli("--path", "model", "--dst_path", ".", "--quiet", cwd=work, timeout=120)
    assert_refused(code, output, work, before, ["--dst_path ."], codes=(2,))


def test_dst_enclosing_the_working_folder_is_refused(case):
    model, old = case()
    inner = old / "sub"
    inner.mkdir()
    work = model.parent
    before = snapshot(work)
    code, output = run_cli("--path", str(model), "--dst_path", "..", "--quiet", cwd=inner, timeout=120)
    assert_refused(code, output, work, before, ["current folder or one of its parents"], codes=(2,))


# --- safetensors index and headers ---------------------------------------------------------------
@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "/tmp/x.safetensors",
                                   "sub/../../outside.safetensors", "model.safetensors/..", ""])
def test_index_shards_outside_the_checkpoint_are_refused(case, shard):
    model, dst = case()
    names = tensor_names(model)
    (model.parent / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    write_index(model, {**{n: "model.safetensors" for n in names[1:]}, names[0]: shard})
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "model.safetensors.index.json", codes=(3,))


def test_index_listing_a_tensor_its_shard_lacks_is_refused(case):
    model, dst = case()
    listed = {n: "model.safetensors" for n in tensor_names(model)}
    write_index(model, {**listed, "model.extra.weight": "model.safetensors"})
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "'model.extra.weight'", "not in its shard", codes=(3,))


def test_shard_holding_a_tensor_the_index_omits_is_refused(case):
    model, dst = case()
    write_index(model, {n: "model.safetensors" for n in tensor_names(model)[1:]})
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "does not list it", codes=(3,))


def test_dangling_shard_symlink_without_index_is_named_as_such(case):
    model, dst = case()
    (model / "model-2.safetensors").symlink_to(model.parent / "gone.safetensors")
    before = snapshot(model.parent)
    result = _export(model, dst)
    _refused(result, model.parent, before, "model-2.safetensors", "broken symbolic link", codes=(3,))
    assert "index" not in result.output


@pytest.mark.parametrize("how", ["all_at_zero", "two_alias"])
def test_overlapping_data_offsets_are_refused(case, how):
    model, dst = case()
    names = tensor_names(model)
    overlap_offsets(model, names if how == "all_at_zero" else [names[3], names[4]])
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "model.safetensors", codes=(3,))


def test_gap_in_data_offsets_is_refused(case):
    model, dst = case()
    def shift_last(header):
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        header[last]["data_offsets"] = [header[last]["data_offsets"][0] + 2, header[last]["data_offsets"][1] + 2]
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data + b"\0\0")
    rewrite_safetensors_header(model / "model.safetensors", shift_last)
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "gap", codes=(3,))


def test_deeply_nested_safetensors_header_is_refused(case):
    model, dst = case()
    raw = ('{"x": ' + nested_json(100_000) + "}").encode()
    body = (model / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", body[:8])
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body[8 + n:])
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "model.safetensors", codes=(3,))


# --- dtypes and values ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype, label", [
    (Q, torch.int64, "I64"), (Q, torch.int32, "I32"), (Q, torch.bool, "BOOL"), (Q, torch.float64, "F64"),
    (NORM, torch.int8, "I8"), ("model.embed_tokens.weight", torch.int16, "I16"), (Q, torch.uint8, "U8"),
])
def test_non_float_tensors_are_refused_not_cast(case, name, dtype, label):
    model, dst = case()
    from safetensors.torch import load_file

    original = load_file(str(model / "model.safetensors"))[name]
    replace_tensor(model, name, (original * 10).to(dtype))
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, repr(name), label, "float", codes=(3,))


@pytest.mark.parametrize("bits", ["16", "8", "4"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_linear_weights_are_refused_at_every_bit_width(case, bits, value):
    model, dst = case()
    poison(model, Q, value, row=3)
    before = snapshot(model.parent)
    _refused(_export(model, dst, "--quant_bit", bits), model.parent, before,
             "model.layers.0.self_attn.q_proj", "NaN or Inf", codes=(3,))


def test_fp16_overflow_is_refused_not_written_as_inf(case):
    model, dst = case()
    poison(model, Q, 1e6)
    before = snapshot(model.parent)
    _refused(_export(model, dst, "--quant_bit", "16"), model.parent, before, "fp16", codes=(3,))


@pytest.mark.parametrize("name", [NORM, "model.norm.weight", "model.layers.2.layer_scalar"])
def test_non_finite_graph_constants_are_refused(case, name):
    model, dst = case()
    poison(model, name, math.nan)
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, repr(name), "NaN", codes=(3,))


@pytest.mark.parametrize("shape, table, bits", [
    ("31b", "model.embed_tokens.weight", "16"), ("31b", "model.embed_tokens.weight", "4"),
    ("e2b", "model.embed_tokens_per_layer.weight", "16"), ("e2b", "model.embed_tokens_per_layer.weight", "8"),
])
def test_non_finite_tables_are_refused(case, shape, table, bits):
    model, dst = case(shape)
    poison(model, table, math.inf, row=7)
    before = snapshot(model.parent)
    _refused(_export(model, dst, "--embed_bit", bits), model.parent, before, repr(table), codes=(3,))


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 1e308), ("rms_norm_eps", -1.0), ("rms_norm_eps", 2.0),
                                        ("final_logit_softcapping", 1e300), ("hidden_size", "64"),
                                        ("num_hidden_layers", True)])
def test_out_of_range_config_values_are_input_errors(case, key, value):
    model, dst = case()
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "config.json", repr(key), codes=(3,))


@pytest.mark.parametrize("text", ['{"model_type": "gemma4_text", "rms_norm_eps": 1e400}',
                                  '{"model_type": "gemma4_text", "rms_norm_eps": NaN}',
                                  '{"model_type": "gemma4_text", "x": Infinity}',
                                  '{"model_type": "gemma4_text", "x": ' + "9" * 5000 + "}",
                                  '{"model_type": "gemma4_text", "x": ' + nested_json(100_000) + "}",
                                  '\udcff'])
def test_non_json_numbers_and_deep_nesting_in_config_are_input_errors(case, text):
    model, dst = case()
    (model / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "config.json", codes=(3,))


# --- files that are not regular files, and sizes --------------------------------------------------------
@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "tokenizer.json"])
def test_fifo_in_place_of_a_file_does_not_hang(case, target):
    model, dst = case()
    (model / target).unlink()
    os.mkfifo(model / target)
    before = snapshot(model.parent)
    code, output = run_cli("--path", str(model), "--dst_path", str(dst), "--quiet", timeout=120)
    assert_refused(code, output, model.parent, before, [target, "FIFO"], codes=(3,))


def test_config_linked_to_dev_zero_does_not_allocate_without_bound(case):
    model, dst = case()
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    before = snapshot(model.parent)
    code, output = run_cli("--path", str(model), "--dst_path", str(dst), "--quiet", timeout=120)
    assert_refused(code, output, model.parent, before, ["config.json", "regular file"], codes=(3,))


def test_config_that_is_a_folder_is_an_input_error(case):
    model, dst = case()
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "config.json", "folder", codes=(3,))


def test_unreadable_config_is_an_input_error(case, monkeypatch):
    model, dst = case()
    real_open = os.open

    def deny(path, *args, **kwargs):
        if str(path).endswith("config.json") and "generation" not in str(path) and "tokenizer" not in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "config.json", "Permission denied", codes=(3,))


def test_huge_config_is_refused_by_size(case):
    model, dst = case()
    config = json.loads((model / "config.json").read_text())
    config["padding"] = "x" * (17 << 20)
    (model / "config.json").write_text(json.dumps(config))
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, "config.json", "MiB", codes=(3,))


# --- counts the config claims ---------------------------------------------------------------------
def test_huge_expert_count_is_checked_against_the_tensors_first(case):
    model, dst = case("26b-a4b")
    config = json.loads((model / "config.json").read_text())
    config["num_experts"] = 10 ** 9
    (model / "config.json").write_text(json.dumps(config))
    before = snapshot(model.parent)
    code, output = run_cli("--path", str(model), "--dst_path", str(dst), "--quiet", timeout=120)
    assert_refused(code, output, model.parent, before, ["num_experts"], codes=(3,))


def test_huge_layer_count_with_kv_sharing_is_refused_quickly(case):
    model, dst = case("e2b")
    config = json.loads((model / "config.json").read_text())
    n = 100_000
    config.update(num_hidden_layers=n, num_kv_shared_layers=n // 2,
                  layer_types=["sliding_attention", "full_attention"] * (n // 2))
    (model / "config.json").write_text(json.dumps(config))
    before = snapshot(model.parent)
    code, output = run_cli("--path", str(model), "--dst_path", str(dst), "--quiet", timeout=120)
    assert_refused(code, output, model.parent, before, ["num_hidden_layers"], codes=(3,))


def test_kv_sharing_map_of_many_layers_is_linear():
    """50k shared layers of 100k: the map of sources is computed in one pass (the quadratic
    version took minutes); checked on the function directly, bounded by the hang guard."""
    from llmexport.models.gemma4.args import _kv_sources

    n = 100_000
    types = ["sliding_attention", "full_attention"] * (n // 2)
    sources, stores = _kv_sources(types, n // 2, "config.json")
    assert sources[n // 2] == n // 2 - 2 and sources[-1] == n // 2 - 1 and stores == {n // 2 - 2, n // 2 - 1}


def test_tokenizer_vocab_id_far_beyond_the_vocabulary_is_an_input_error(case):
    model, dst = case()
    tj = json.loads((model / "tokenizer.json").read_text())
    piece = next(iter(tj["model"]["vocab"]))
    tj["model"]["vocab"][piece] = 3_000_000_000
    (model / "tokenizer.json").write_text(json.dumps(tj))
    before = snapshot(model.parent)
    code, output = run_cli("--path", str(model), "--dst_path", str(dst), "--quiet", timeout=120)
    assert_refused(code, output, model.parent, before, ["tokenizer.json", "contiguous"], codes=(3,))


# --- tokenizer files: named, and checked before the heavy work -------------------------------------------
@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", "{broken"), ("tokenizer_config.json", "[1, 2"),
    ("generation_config.json", "{\"eos_token_id\": "),
    ("generation_config.json", "{\"eos_token_id\": \"x\"}"), ("tokenizer.json", "{\"model\": 5}"),
    ("tokenizer.json", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}"),
])
def test_broken_tokenizer_files_are_named_before_any_heavy_stage(case, monkeypatch, name, content):
    from llmexport.trace import onnx_export

    def no_onnx(*args, **kwargs):
        raise AssertionError("the ONNX stage ran before the tokenizer was checked")

    monkeypatch.setattr(onnx_export, "export_onnx", no_onnx)
    model, dst = case()
    (model / name).write_text(content)
    before = snapshot(model.parent)
    _refused(_export(model, dst), model.parent, before, name, codes=(3,))


# --- output folder hygiene ---------------------------------------------------------------------------------
def test_failed_export_removes_the_parent_folders_it_created(case):
    model, _ = case()
    (model / "config.json").write_text("{}")
    work = model.parent
    before = snapshot(work)
    result = _export(model, work / "a" / "b" / "c" / "out")
    _refused(result, work, before, codes=(3,))
    assert not (work / "a").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_exported_folder_follows_the_umask(case, umask):
    model, _ = case()
    old = os.umask(umask)
    try:
        result = _export(model, model.parent / "out", "--export", "onnx", "--quiet")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert (model.parent / "out").stat().st_mode & 0o777 == 0o777 & ~umask


def test_quiet_does_not_change_the_manifest(case):
    model, _ = case()
    out_a, out_b = model.parent / "a", model.parent / "b"
    assert _export(model, out_a, "--quant_bit", "8").exit_code == 0
    assert _export(model, out_b, "--quant_bit", "8", "--quiet").exit_code == 0
    assert (out_a / "manifest.json").read_bytes() == (out_b / "manifest.json").read_bytes()


def test_a_failure_while_the_token_table_is_written_stops_its_thread_and_leaves_nothing(case, monkeypatch):
    """The token table is written on a thread of its own while the graph converts
    (llmexport/targets/token_table_writer.py): a conversion that fails meanwhile cancels it, and
    the staging folder is removed only after it has stopped."""
    import threading

    from llmexport.mnn import convert, embeddings

    started = threading.Event()
    real_write = embeddings.write_embedding_table

    def slow_rows(fileobj, table, *args, **kwargs):
        def rows():
            for chunk in table:
                started.set()
                yield chunk
                threading.Event().wait(0.05)
        return real_write(fileobj, rows(), *args, **kwargs)

    def failing_convert(*args, **kwargs):
        assert started.wait(30), "the table writer never started"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(embeddings, "write_embedding_table", slow_rows)
    monkeypatch.setattr(convert, "onnx_to_mnn", failing_convert)
    model, dst = case("e2b")
    before = snapshot(model.parent)
    _refused(_export(model, dst, "--quiet"), model.parent, before, "No space left", codes=(6,))
    assert not [t for t in threading.enumerate() if t.name.startswith("llmexport-table")]
