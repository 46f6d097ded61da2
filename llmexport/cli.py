"""Command line: parse flags into ExportOptions, call the API, map errors to exit codes.

Heavy modules (torch, transformers, MNN) are imported only after parsing, so ``--help`` and
``--version`` answer at once.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

import click

from llmexport import __version__
from llmexport.mnn.config import Precision

if TYPE_CHECKING:  # heavy: imported only after parsing
    from llmexport.options import Calibration, ExportOptions
    from llmexport.results import ExportResult

EXIT_INTERNAL = 1


def _configure_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@dataclass(frozen=True)
class ExportCommand:
    """The command line as click parsed it, one field per parameter of ``main`` under the same name
    (the flags, their defaults, choices and help live in ``main``'s decorators only); click hands
    them over by name and ``export_options`` maps them to ``ExportOptions``."""

    path: str
    export_format: str
    dst_path: str
    quant_bit: int
    quant_block: int
    sym: bool
    hqq: bool
    quant_config: str | None
    lm_quant_bit: int | None
    lm_quant_block: int | None
    embed_bit: int | None
    visual_quant_bit: int
    audio_quant_bit: int
    requantize: bool
    thread_num: int
    runtime_profile: str
    chat_thinking: str
    dry_run: bool
    verify: bool
    keep_failed: bool
    max_memory: float | None
    trust_remote_code: bool
    quiet: bool
    approximate_ignore_merges: bool = False
    calib_data: str | None = None
    calib_samples: int = 16
    calib_seq_len: int = 128
    calib_method: str | None = None
    smooth_alpha: float | None = None
    verify_text: str | None = None
    verify_windows: int = 16
    lora_path: str | None = None
    revision: str | None = None
    gguf_file: str | None = None
    target_bpw: float | None = None
    verify_arm: bool = False
    precision: str | None = None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--path", required=True, type=click.Path(path_type=str),
              help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json), a GGUF file (or a folder "
                   "holding one), or a hub repo id org/name (downloaded into the HF cache; an existing path always "
                   "wins).")
@click.option("--export", "export_format", type=click.Choice(["mnn", "onnx"]), default="mnn", show_default=True,
              help="mnn: a folder MNN's LLM runtime loads; onnx: a standard-op ONNX with the weights.")
@click.option("--dst_path", required=True, type=click.Path(path_type=str),
              help="Output folder; replaced atomically when the export succeeds.")
@click.option("--quant_bit", type=int, default=4, show_default=True,
              help="Linear weights: 4 or 8 (block RTN), 16 = fp16.")
@click.option("--quant_block", type=int, default=64, show_default=True,
              help="Block size along the input dimension: 0 (per channel), 32, 64, 128, 256.")
@click.option("--sym", is_flag=True, help="Symmetric quantization (scale only) instead of asymmetric.")
@click.option("--hqq", is_flag=True,
              help="Half-quadratic optimisation of each block's zero point (slower, more accurate).")
@click.option("--quant_config", default=None, metavar="FILE|RECIPE",
              help="Per-module schemes: a JSON file (see docs/quantization.md) or a recipe: uniform, mlp4-attn8.")
@click.option("--lm_quant_bit", type=int, default=None, help="lm_head bits (default: from the scheme).")
@click.option("--lm_quant_block", type=int, default=None, help="lm_head block (default: --quant_block).")
@click.option("--embed_bit", type=int, default=None,
              help="Token/PLE embedding tables read from their own files: 16 (bf16, default), 8 or 4.")
@click.option("--visual_quant_bit", type=int, default=16, show_default=True,
              help="Vision tower (visual.mnn) linear weights: 4 or 8 (block RTN), 16 = fp16.")
@click.option("--audio_quant_bit", type=int, default=16, show_default=True,
              help="Audio tower (audio.mnn) linear weights: 4 or 8 (block RTN), 16 = fp16.")
@click.option("--requantize", is_flag=True,
              help="Pre-quantized (MLX, GPTQ, AWQ) checkpoints: dequantize and quantize every weight with this "
                   "command's scheme instead of keeping the stored integers (docs/mlx-import.md, "
                   "docs/gptq-awq-import.md).")
@click.option("--thread_num", type=int, default=4, show_default=True, help="Runtime threads written to config.json.")
@click.option("--runtime_profile", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
              help="fast: MNN's low-memory int4/int8 kernels (activations quantized to 8 bits on the fly); "
                   "exact: weights dequantized to float at load (slower, the stored weights' logits).")
@click.option("--chat_thinking", type=click.Choice(["default", "off", "on"]), default="default", show_default=True,
              help="Chat template thinking mode written to llm_config.json (jinja.context.enable_thinking); "
                   "default: the template's own (Gemma4: off, an empty thought channel ends the generation prompt).")
@click.option("--dry-run", "dry_run", is_flag=True, help="Print the plan (layers, schemes, size) and write nothing.")
@click.option("--verify", is_flag=True, help="Run the export in MNN's runtime next to HF; fail on disagreement.")
@click.option("--keep_failed", is_flag=True,
              help="With --verify: keep the export even when the verification disagrees (verify.json records "
                   "the failures; the exit code is still 4).")
@click.option("--max_memory", type=float, default=None, metavar="GIB",
              help="Memory the export (and --verify) may use, in GiB, instead of the machine's available memory, "
                   "in the check that refuses a run that would not fit (exit 8).")
@click.option("--trust_remote_code", is_flag=True,
              help="Allow --verify to run the checkpoint's own modeling code (families whose reference model is "
                   "remote code, such as k2_horizon).")
@click.option("--quiet", is_flag=True, help="Only warnings and errors.")
@click.option("--approximate_ignore_merges", is_flag=True,
              help="Export a tokenizer with ignore_merges words MNN's runtime cannot reach (Llama-3) instead of "
                   "refusing it; the measured difference is logged and recorded in verify.json.")
@click.option("--calib_data", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="FILE",
              help="Round the quantized text linears with GPTQ on the model's activations over this text "
                   "(plain text, or JSONL with a \"text\" field); nothing is downloaded.")
@click.option("--calib_samples", type=int, default=16, show_default=True,
              help="Calibration windows cut from --calib_data.")
@click.option("--calib_seq_len", type=int, default=128, show_default=True,
              help="Tokens per calibration window.")
@click.option("--calib_method", type=click.Choice(["gptq", "awq", "awq+gptq", "smooth", "smooth+gptq"]), default=None,
              help="What --calib_data drives [default: gptq]: GPTQ rounding; AWQ scales (searched on the "
                   "activations) or SmoothQuant scales (outliers moved into the weights), folded into the norm or "
                   "linear before each group of linears; or such scales, then GPTQ.")
@click.option("--smooth_alpha", type=float, default=None,
              help="SmoothQuant's migration strength, 0 < alpha < 1 [default: 0.5] (--calib_method smooth*).")
@click.option("--verify_text", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="FILE",
              help="With --verify: also score windows of this text (plain UTF-8 or JSONL) in MNN's runtime and HF "
                   "fp32: perplexity, KLD and top-1 as llama.cpp defines them.")
@click.option("--verify_windows", type=int, default=16, show_default=True,
              help="Windows of 128 tokens scored from --verify_text.")
@click.option("--lora_path", type=click.Path(path_type=str), default=None, metavar="DIR",
              help="A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) merged into the weights "
                   "before quantization; --verify compares with HF carrying the same merge (docs/lora.md).")
@click.option("--revision", default=None, metavar="REV",
              help="With a hub repo id: the branch, tag or commit to export (default: main).")
@click.option("--gguf_file", default=None, metavar="NAME",
              help="The .gguf file to export from a folder or hub repo holding several (a split model: its first "
                   "part, NAME-00001-of-0000N.gguf); of a hub repo only that file is downloaded.")
@click.option("--target_bpw", type=float, default=None, metavar="BITS",
              help="A size budget instead of a recipe: each text linear's scheme (from --quant_bit/--quant_block up "
                   "to a smaller block or 8 bits) chosen by sensitivity per byte until the linears' records average "
                   "BITS bits per weight (docs/quantization.md).")
@click.option("--verify_arm", is_flag=True,
              help="With --verify: run the runtime side again on MNN's ARM kernels (natively on an ARM host, under "
                   "qemu-aarch64-static elsewhere) at precision normal and low; the shipped precision must pass "
                   "(docs/verification.md#arm-kernels).")
@click.option("--precision", type=click.Choice([p.value for p in Precision]), default=None,
              help="Activation precision written to config.json (default: the family's, measured on MNN's ARM "
                   "kernels: docs/benchmarks.md). low = fp16 on ARM CPUs with fp16 arithmetic, faster, less exact; "
                   "on x86 low equals normal.")
@click.version_option(__version__, "--version", prog_name="llmexport")
def main(**flags: Any) -> None:
    """Export a HuggingFace LLM checkpoint to MNN (or ONNX), optionally verified."""
    command = ExportCommand(**flags)
    _configure_logging(command.quiet)
    from llmexport.errors import LlmExportError, ResourceError

    try:
        with _termination_as_interrupt():
            result = _run(command)
    except LlmExportError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        click.echo(f"llmexport: interrupted ({signal.Signals(signum).name}); the destination was left unchanged",
                   err=True)
        sys.exit(128 + signum)
    except Exception as exc:  # out of memory outside a stage, else an llmexport bug: say so in one line
        out_of_memory = ResourceError.out_of_memory(exc, "during the export")
        if out_of_memory is not None:
            _fail(str(out_of_memory), out_of_memory.exit_code)
        logging.getLogger("llmexport").debug("internal error", exc_info=True)
        click.echo(f"llmexport: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_INTERNAL)
    if result is not None:
        _report(result, command.quiet)
        _exit_unverified(result)


def _fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"llmexport: error: {message}", err=True)
    sys.exit(exit_code)


def _exit_unverified(result: ExportResult) -> None:
    """Exit 7 (--verify could not run) or 4 (it disagreed, --keep_failed) for an export that was kept."""
    from llmexport.errors import NotVerified, VerificationFailed

    if result.verify_error is not None:
        _fail(f"exported to {result.dst}, but --verify could not run ({result.verify_error}); verify.json "
              "records it", NotVerified.exit_code)
    if result.verification is not None and not result.verification.passed:
        _fail(f"exported to {result.dst} (--keep_failed), but verification failed: "
              f"{'; '.join(result.verification.failures)}; verify.json records it", VerificationFailed.exit_code)


def _run(command: ExportCommand) -> ExportResult | None:
    """The export (or with --dry-run, the printed plan and None)."""
    from llmexport.api import export, plan

    options = export_options(command)
    if command.dry_run:
        from llmexport.planning.export_plan import plan_summary
        from llmexport.planning.memory_plan import fit_line

        planned = plan(command.path, options)
        click.echo(plan_summary(planned))
        assert planned.memory is not None  # every plan estimates it
        click.echo(fit_line(planned.memory, options.max_memory))
        return None
    return export(command.path, command.dst_path, options)


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised like Ctrl-C so that every ``finally`` cleans up on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _termination_as_interrupt():
    """While the command runs, SIGTERM and SIGHUP raise ``Terminated`` (where they would kill)."""
    def raise_terminated(signum, frame):
        raise Terminated(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                previous[signum] = signal.signal(signum, raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def parse_command(args: Sequence[str]) -> ExportCommand:
    """``args`` parsed as ``llmexport`` parses them, defaults filled in (for tests and benchmarks)."""
    return ExportCommand(**main.make_context("llmexport", list(args)).params)


def export_options(command: ExportCommand) -> ExportOptions:
    """The ``ExportOptions`` a command line asks for (``UsageError`` for a bad ``--quant_config``)."""
    from pathlib import Path

    from llmexport.errors import UsageError
    from llmexport.mnn.config import RuntimeProfile
    from llmexport.options import ChatThinking, ExportFormat, ExportOptions, VerifyText
    from llmexport.quant.recipes import RECIPES, load_quant_config, recipe
    from llmexport.quant.scheme import QuantMethod, QuantScheme

    method = QuantMethod.HQQ if command.hqq else QuantMethod.RTN
    default = QuantScheme(bits=command.quant_bit, block=command.quant_block, sym=command.sym, method=method)
    lm = None
    if command.lm_quant_bit is not None or command.lm_quant_block is not None:
        lm = QuantScheme(bits=command.quant_bit if command.lm_quant_bit is None else command.lm_quant_bit,
                         block=command.quant_block if command.lm_quant_block is None else command.lm_quant_block,
                         sym=command.sym, method=method)
    options = ExportOptions(export=ExportFormat(command.export_format), quant=default, lm_quant=lm,
                            embed_bit=command.embed_bit, verify=command.verify, quiet=command.quiet,
                            thread_num=command.thread_num, visual_quant_bit=command.visual_quant_bit,
                            audio_quant_bit=command.audio_quant_bit, requantize=command.requantize,
                            trust_remote_code=command.trust_remote_code,
                            runtime_profile=RuntimeProfile(command.runtime_profile),
                            chat_thinking=ChatThinking(command.chat_thinking), keep_failed=command.keep_failed,
                            max_memory=command.max_memory,
                            approximate_ignore_merges=command.approximate_ignore_merges,
                            calibration=_calibration(command),
                            verify_text=None if command.verify_text is None else VerifyText(
                                Path(command.verify_text), command.verify_windows),
                            lora=None if command.lora_path is None else Path(command.lora_path),
                            revision=command.revision, gguf_file=command.gguf_file,
                            target_bpw=command.target_bpw,
                            verify_arm=command.verify_arm,
                            precision=None if command.precision is None else Precision(command.precision))
    quant_config = command.quant_config
    if quant_config is None:
        return options
    try:
        if quant_config in RECIPES and not Path(quant_config).exists():
            return options.with_plan(recipe(quant_config, default))
        if not Path(quant_config).is_file():
            raise ValueError(f"{quant_config}: neither a file nor a recipe ({', '.join(RECIPES)})")
        return options.with_plan(load_quant_config(Path(quant_config), default))
    except ValueError as exc:
        raise UsageError(f"--quant_config: {exc}") from None


def _calibration(command: ExportCommand) -> Calibration | None:
    """``--calib_data`` and the flags that only mean something with it."""
    from pathlib import Path

    from llmexport.errors import UsageError
    from llmexport.options import CalibMethod, Calibration

    method = CalibMethod(command.calib_method or CalibMethod.GPTQ.value)
    if command.smooth_alpha is not None and method.scaling != "smooth":
        raise UsageError("--smooth_alpha: tunes SmoothQuant's scales; it needs --calib_method smooth or smooth+gptq")
    if command.calib_data is None:
        if command.calib_method is not None:
            raise UsageError(f"--calib_method {method.value}: needs the calibration text, --calib_data FILE")
        return None
    alpha = 0.5 if command.smooth_alpha is None else command.smooth_alpha
    return Calibration(Path(command.calib_data), command.calib_samples, command.calib_seq_len, method, alpha)


def _report(result: ExportResult, quiet: bool) -> None:
    if quiet:
        return
    arch = result.plan.architecture
    click.echo(f"exported {arch.family} ({arch.layers} layers) to {result.dst}")
    click.echo("stages (s): " + json.dumps(result.timings))
    if result.verification is not None:
        from llmexport.verification.verify import summary_line

        click.echo("verify: " + summary_line(result.verification))
