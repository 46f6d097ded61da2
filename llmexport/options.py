"""Typed export options and their cross-checks (the CLI only parses into these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from llmexport.errors import UsageError
from llmexport.mnn.config import Precision, RuntimeProfile
from llmexport.mnn.limits import TABLE_BITS
from llmexport.quant.budget import check_target
from llmexport.quant.recipes import QuantPlan, QuantRule
from llmexport.quant.scheme import QuantScheme


class ExportFormat(str, Enum):
    MNN = "mnn"
    ONNX = "onnx"


class ChatThinking(str, Enum):
    """The chat template's thinking mode, written to llm_config.json as ``jinja.context.enable_thinking``
    (the variable Gemma4's and Qwen3's templates read; see llmexport.models.chat_templates).
    ``DEFAULT`` writes nothing: the template's own default (Gemma4: off, its generation prompt ends
    with an empty thought channel; Qwen3: on). The runtime can switch it later with
    ``Llm.set_config({"jinja": {"context": {"enable_thinking": ...}}})``."""

    DEFAULT = "default"
    OFF = "off"
    ON = "on"

    def template_context(self) -> dict[str, bool]:
        """The chat template variables this choice sets."""
        return {} if self is ChatThinking.DEFAULT else {"enable_thinking": self is ChatThinking.ON}


class CalibMethod(str, Enum):
    """What ``--calib_data`` drives (``--calib_method``): per-channel scales folded into the op
    before each group of linears, chosen by AWQ's search or SmoothQuant's rule
    (llmexport.calibration.activation_scaling), then, or instead, GPTQ's rounding (llmexport.calibration.gptq)."""

    GPTQ = "gptq"
    AWQ = "awq"
    AWQ_GPTQ = "awq+gptq"
    SMOOTH = "smooth"
    SMOOTH_GPTQ = "smooth+gptq"

    @property
    def scaling(self) -> str | None:
        """"awq", "smooth", or None (no scales)."""
        first = self.value.split("+")[0]
        return None if first == "gptq" else first

    @property
    def gptq(self) -> bool:
        return self.value.endswith("gptq")


@dataclass(frozen=True)
class Calibration:
    """Calibration (``--calib_data``): ``samples`` windows of ``seq_len`` tokens cut from the text
    of ``data`` (plain text, or JSONL with a "text" field per line; llmexport.calibration.data),
    used as ``method`` says; ``smooth_alpha``: SmoothQuant's migration strength."""

    data: Path
    samples: int = 16
    seq_len: int = 128
    method: CalibMethod = CalibMethod.GPTQ
    smooth_alpha: float = 0.5

    def validate(self) -> "Calibration":
        if self.samples < 1:
            raise UsageError(f"--calib_samples: must be >= 1, got {self.samples}")
        if self.seq_len < 8:
            raise UsageError(f"--calib_seq_len: must be >= 8 tokens, got {self.seq_len}")
        if not 0.0 < self.smooth_alpha < 1.0:
            raise UsageError(f"--smooth_alpha: must be between 0 and 1 (exclusive), got {self.smooth_alpha}")
        return self

    def manifest(self) -> dict:
        out: dict = {"data": str(self.data), "samples": self.samples, "seq_len": self.seq_len}
        if self.method is not CalibMethod.GPTQ:  # manifests of GPTQ exports stay as they were
            out["method"] = self.method.value
        if self.method.scaling == "smooth":
            out["smooth_alpha"] = self.smooth_alpha
        return out


@dataclass(frozen=True)
class VerifyText:
    """``--verify_text``: ``windows`` windows of ``length`` tokens of a text the user gives, scored
    by ``--verify`` in MNN's runtime and HF fp32 (perplexity, KLD, top-1: llmexport.verification.quality)."""

    path: Path
    windows: int = 16
    length: int = 128

    def validate(self) -> "VerifyText":
        if self.windows < 1:
            raise UsageError(f"--verify_windows: must be >= 1, got {self.windows}")
        return self


@dataclass(frozen=True)
class ExportOptions:
    """Everything that decides what an export writes.

    ``quant`` is the default scheme of every linear; ``rules`` (from ``--quant_config`` or a
    recipe) override it per module, first match wins; ``lm_quant`` (when given) is lm_head's,
    which a tied model's runtime also reads as its token embedding. ``embed_bit`` is the width
    of the embedding/PLE tables read from their own files (None: the recipe's, else 16).

    ``runtime_profile`` picks the runtime's kernels for quantized linears (written to config.json).
    ``precision`` (``--precision``) replaces the family's activation precision in config.json
    (None: the family's, measured on MNN's ARM kernels; docs/benchmarks.md, fp16 on ARM).

    An already-quantized (MLX, GPTQ, AWQ) checkpoint keeps its stored integers per module by default (see
    llmexport.planning.schemes): explicit rules, ``lm_quant`` and ``embed_bit`` override that for
    what they name, and ``requantize`` dequantizes everything and applies the scheme above.

    ``trust_remote_code`` lets ``verify`` run a checkpoint's own modeling code where the family's
    reference model is that code (K2-Horizon); without it such a verification is refused.

    ``keep_failed`` keeps an export whose verification ran and disagreed (swapped into place,
    ``verify.json`` holding the failures) instead of discarding it. ``max_memory`` (GiB) replaces
    the machine's available memory in the check that refuses an export (or its verification)
    whose estimated peak would not fit (llmexport.planning.memory_plan).

    ``calibration`` (``--calib_data``) rounds the quantized text linears with GPTQ on the
    checkpoint's own activations over that text (llmexport.calibration.gptq); None: the scheme's method alone.

    ``verify_text`` (``--verify_text``) adds perplexity, KLD and top-1 on the user's text to the
    verification (not a pass/fail criterion).

    ``lora`` (``--lora_path``): a PEFT LoRA adapter folder merged into the weights as they stream,
    before quantization; ``--verify``'s HF reference carries the same merged weights (llmexport.source.lora).

    ``approximate_ignore_merges`` exports a tokenizer whose ``ignore_merges`` words MNN's runtime
    cannot reach (Llama-3) instead of refusing it; the measured difference is logged and recorded
    in verify.json (llmexport/mnn/tokenizer/whole_words.py). manifest.json records it only when set.

    ``revision`` (``--revision``): the branch, tag or commit of a hub repo id given as the path
    (llmexport.source.hub); manifest.json records it, with the commit it resolved to, under ``source``.

    ``gguf_file`` (``--gguf_file``): the GGUF file to export from a folder or hub repo holding
    several (docs/gguf-import.md); of a repo only that file is fetched. manifest.json records it
    under ``source`` for a hub repo.

    ``target_bpw`` (``--target_bpw``) chooses each text linear's scheme, from ``quant`` upwards, by
    sensitivity per byte until the linears' records average that many bits per weight
    (llmexport.quant.budget, llmexport.calibration.size_budget). manifest.json records it only when set.
    """

    export: ExportFormat = ExportFormat.MNN
    quant: QuantScheme = field(default_factory=lambda: QuantScheme(bits=4, block=64))
    lm_quant: QuantScheme | None = None
    rules: tuple[QuantRule, ...] = ()
    embed_bit: int | None = None
    recipe_embed_bit: int | None = None
    use_gpu: bool = True
    visual_quant_bit: int = 16
    audio_quant_bit: int = 16
    verify: bool = False
    quiet: bool = False
    thread_num: int = 4
    requantize: bool = False
    trust_remote_code: bool = False
    runtime_profile: RuntimeProfile = RuntimeProfile.FAST
    chat_thinking: ChatThinking = ChatThinking.DEFAULT
    keep_failed: bool = False
    max_memory: float | None = None
    approximate_ignore_merges: bool = False
    calibration: Calibration | None = None
    verify_text: VerifyText | None = None
    lora: Path | None = None
    revision: str | None = None
    gguf_file: str | None = None
    target_bpw: float | None = None
    verify_arm: bool = False
    precision: Precision | None = None

    #: fields that change how the export talks or runs, never what it writes (left out of manifest.json)
    PRESENTATION = ("quiet", "keep_failed", "max_memory", "verify_text", "verify_arm")

    def validate(self) -> "ExportOptions":
        for flag, scheme in (("--quant_bit/--quant_block", self.quant), ("--lm_quant_bit", self.lm_quant)):
            if scheme is None:
                continue
            try:
                scheme.validate()
            except ValueError as exc:
                raise UsageError(f"{flag}: {exc}") from None
        table_bits = self.embed_bit if self.embed_bit is not None else self.recipe_embed_bit
        if table_bits is not None and table_bits not in TABLE_BITS:
            raise UsageError(f"--embed_bit: {table_bits} is not one of {', '.join(map(str, TABLE_BITS))} "
                             "(MNN 3.6.1 decodes 2- and 3-bit tables wrongly)")
        for flag, bits in (("--visual_quant_bit", self.visual_quant_bit), ("--audio_quant_bit", self.audio_quant_bit)):
            if bits not in (4, 8, 16):
                raise UsageError(f"{flag}: {bits} is not one of 4, 8, 16")
        if self.thread_num < 1:
            raise UsageError(f"--thread_num: must be >= 1, got {self.thread_num}")
        if not isinstance(self.runtime_profile, RuntimeProfile):
            raise UsageError(f"--runtime_profile: {self.runtime_profile!r} is not one of "
                             f"{', '.join(p.value for p in RuntimeProfile)}")
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise UsageError(f"--precision: {self.precision!r} is not one of {', '.join(p.value for p in Precision)}")
        if self.keep_failed and not self.verify:
            raise UsageError("--keep_failed: keeps an export whose --verify disagreed; it needs --verify")
        if self.verify_arm and not self.verify:
            raise UsageError("--verify_arm: runs --verify's runtime side again on MNN's ARM kernels; it needs --verify")
        if self.max_memory is not None and not self.max_memory > 0:
            raise UsageError(f"--max_memory: must be a positive number of GiB, got {self.max_memory}")
        if self.verify_text is not None:
            self.verify_text.validate()
            if not self.verify:
                raise UsageError("--verify_text: scores the export in MNN's runtime against HF; it needs --verify")
        if self.calibration is not None:
            self.calibration.validate()
            if self.quant.is_fp16:
                raise UsageError("--calib_data: calibration chooses quantized levels; --quant_bit 16 has none")
            if self.export is not ExportFormat.MNN:
                raise UsageError("--calib_data: only the MNN export stores quantized levels")
        if self.revision is not None and not self.revision.strip():
            raise UsageError("--revision: must name a branch, tag or commit, got an empty string")
        if self.target_bpw is not None:
            self._validate_budget()
        if not isinstance(self.chat_thinking, ChatThinking):
            raise UsageError(f"--chat_thinking: {self.chat_thinking!r} is not one of "
                             f"{', '.join(t.value for t in ChatThinking)}")
        return self

    def _validate_budget(self) -> None:
        """``--target_bpw`` is a number of bits the budget can spend, and nothing else chooses per linear."""
        assert self.target_bpw is not None
        try:
            check_target(self.target_bpw)
        except ValueError as exc:
            raise UsageError(f"--target_bpw: {exc}") from None
        if self.quant.is_fp16:
            raise UsageError("--target_bpw: the budget upgrades linears from a quantized --quant_bit; 16 leaves none")
        if self.export is not ExportFormat.MNN:
            raise UsageError("--target_bpw: the budget counts MNN's quantized records; --export onnx writes floats")
        for flag, conflict in (("--quant_config rules", self.rules), ("--lm_quant_bit/--lm_quant_block",
                                                                     self.lm_quant)):
            if conflict:
                raise UsageError(f"--target_bpw: the budget chooses every linear's scheme; {flag} choose some "
                                 "too (use one or the other)")

    def manifest_fields(self) -> dict:
        """The options that decide the exported bytes, as recorded in manifest.json."""
        from dataclasses import asdict

        fields = {k: v for k, v in asdict(self).items() if k not in self.PRESENTATION}
        del fields["revision"]  # the manifest's "source" holds it beside the commit it resolved to
        del fields["gguf_file"]  # so does it, of a hub repo; the export's bytes are the file's
        if not self.approximate_ignore_merges:  # manifests written before the flag existed stay the same
            del fields["approximate_ignore_merges"]
        if self.lora is None:  # manifests of exports without an adapter stay the same
            del fields["lora"]
        else:
            fields["lora"] = str(self.lora)
        if self.target_bpw is None:  # likewise
            del fields["target_bpw"]
        if self.calibration is None:
            del fields["calibration"]
        else:
            fields["calibration"] = self.calibration.manifest()
        return fields

    def with_plan(self, plan: QuantPlan) -> "ExportOptions":
        """These options with a recipe's or quant_config's default, rules and table width."""
        from dataclasses import replace

        return replace(self, quant=plan.default, rules=plan.rules, recipe_embed_bit=plan.embed_bit)
