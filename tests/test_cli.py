"""The command line: a verified export end to end, and one-line errors with documented exit codes
that leave --dst_path untouched."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmexport.cli import main
from llmexport.mnn.config import RuntimeProfile
from llmexport.results import VerifyReport
from llmexport.verification.verify import summary_line


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture()
def old_dst(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "previous.txt").write_text("old export")
    return dst


def _unchanged(dst) -> bool:
    return [p.name for p in dst.iterdir()] == ["previous.txt"] and (dst / "previous.txt").read_text() == "old export"


@pytest.mark.slow
def test_cli_exports_and_verifies(tiny_gemma4, tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(tiny_gemma4("e2b")), "--export", "mnn", "--dst_path", str(dst), "--quant_bit", "8",
                           "--verify"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verify: PASS" in proc.stdout
    report = VerifyReport.read(dst / "verify.json")
    assert report.passed and report.runtime_profile is RuntimeProfile.FAST
    assert report.exact_kernels.top1_agreement == 1.0
    # the typed report writes back the same bytes, and the command printed its summary line
    assert (dst / "verify.json").read_text() == json.dumps(report.to_json(), indent=2)
    lines = proc.stdout.splitlines()
    assert lines[0] == f"exported gemma4 (8 layers) to {dst}" and f"verify: {summary_line(report)}" in lines


def test_cli_onnx_export_runs_in_onnxruntime(tiny_gemma4, tmp_path):
    import onnxruntime as ort

    result = _run("--path", str(tiny_gemma4("31b")), "--export", "onnx", "--dst_path", str(tmp_path / "o"), "--quiet")
    assert result.exit_code == 0, result.output
    session = ort.InferenceSession(str(tmp_path / "o" / "llm.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "position_ids", "logits_index"]


def test_missing_path_is_an_input_error(tmp_path, old_dst):
    result = _run("--path", str(tmp_path / "nope"), "--dst_path", str(old_dst))
    assert result.exit_code == 3
    assert "model path does not exist" in result.output and len(result.output.strip().splitlines()) == 1
    assert _unchanged(old_dst)


def test_unsupported_model_type_lists_supported(tiny_gemma4, tmp_path, old_dst):
    from llmexport.models import supported_model_types

    model = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "mamba"
    (model / "config.json").write_text(json.dumps(config))
    result = _run("--path", str(model), "--dst_path", str(old_dst))
    assert result.exit_code == 3
    assert "unsupported model_type 'mamba'" in result.output
    assert f"(supported: {', '.join(supported_model_types())})" in result.output
    assert {"gemma4", "gemma4_text", "k2_horizon", "llama", "qwen3", "qwen3_moe"} <= set(supported_model_types())
    assert _unchanged(old_dst)


@pytest.mark.parametrize("flags, needle", [
    (["--quant_bit", "5"], "--quant_bit"),
    (["--quant_block", "48"], "--quant_block"),
    (["--embed_bit", "2"], "--embed_bit"),
    (["--keep_failed"], "--keep_failed: keeps an export whose --verify disagreed; it needs --verify"),
    (["--max_memory", "0"], "--max_memory: must be a positive number of GiB"),
    (["--max_memory", "nan"], "--max_memory: must be a positive number of GiB"),
])
def test_invalid_options_are_usage_errors(tiny_gemma4, old_dst, flags, needle):
    result = _run("--path", str(tiny_gemma4("31b")), "--dst_path", str(old_dst), *flags)
    assert result.exit_code == 2
    assert needle in result.output
    assert _unchanged(old_dst)


def test_malformed_config_is_an_input_error(tiny_gemma4, tmp_path, old_dst):
    model = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), model)
    (model / "config.json").write_text("{not json")
    result = _run("--path", str(model), "--dst_path", str(old_dst))
    assert result.exit_code == 3 and "config.json" in result.output and "malformed JSON" in result.output
    assert _unchanged(old_dst)


def test_help_and_version_do_not_import_torch():
    code = ("import sys; from llmexport.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "llmexport, version" in proc.stdout


@pytest.mark.parametrize("command,fields", [("llmexport.cli:main", "llmexport.cli:ExportCommand"),
                                            ("llmexport.run_cli:main", "llmexport.run_cli:RunCommand")])
def test_click_hands_every_parameter_by_name_to_one_typed_command(command, fields):
    """Each command's click parameters are the fields of its frozen dataclass, same names, same order."""
    import dataclasses
    import importlib

    def load(name):
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)

    params = [p.name for p in load(command).params if p.name not in ("help", "version")]
    assert params == [f.name for f in dataclasses.fields(load(fields))]


def test_flags_map_to_options_by_name():
    from llmexport.cli import export_options, parse_command
    from llmexport.options import ChatThinking, ExportFormat
    from llmexport.quant.scheme import QuantMethod, QuantScheme

    base = ["--path", "x", "--dst_path", "y"]
    command = parse_command(base)
    assert (command.path, command.dst_path, command.dry_run, command.quant_config) == ("x", "y", False, None)
    options = export_options(parse_command([*base, "--export", "onnx", "--quant_bit", "8", "--quant_block", "32",
                                            "--sym", "--hqq", "--lm_quant_bit", "16", "--embed_bit", "4",
                                            "--visual_quant_bit", "8", "--audio_quant_bit", "4", "--requantize",
                                            "--thread_num", "2", "--chat_thinking", "off", "--verify",
                                            "--keep_failed", "--max_memory", "1.5", "--trust_remote_code",
                                            "--quiet", "--verify_arm"]))
    assert options.export is ExportFormat.ONNX and options.chat_thinking is ChatThinking.OFF
    assert options.quant == QuantScheme(8, 32, sym=True, method=QuantMethod.HQQ)
    assert options.lm_quant == QuantScheme(16, 32, sym=True, method=QuantMethod.HQQ)
    assert (options.embed_bit, options.visual_quant_bit, options.audio_quant_bit, options.thread_num,
            options.max_memory) == (4, 8, 4, 2, 1.5)
    assert options.requantize and options.verify and options.keep_failed and options.trust_remote_code
    assert options.verify_arm and not export_options(parse_command(base)).verify_arm
    assert options.quiet and export_options(parse_command(base)).lm_quant is None
