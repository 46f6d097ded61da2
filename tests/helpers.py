"""Helpers shared by several test files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def rewrite_safetensors_header(path: Path, mutate: Callable[[dict], None]) -> None:
    """Apply ``mutate`` to a safetensors file's JSON header, keeping the data section."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    mutate(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def assert_reference_onnx_matches_eager(arch, graph, path: Path, vocab: int = 512, atol: float = 1e-4) -> None:
    """The standard-op ONNX of ``graph`` (weights bound), run by onnxruntime at other lengths than
    traced and with both logits_index modes, equals the eager graph within ``atol``."""
    import onnxruntime as ort

    from llmexport.trace.eager import prompt_inputs
    from llmexport.trace.onnx_export import export_onnx

    export_onnx(graph, arch.graph_inputs(3), path, for_mnn=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for seq, all_logits in ((17, True), (5, False)):
        torch.manual_seed(seq)
        args = prompt_inputs(arch, torch.randint(5, 500, (seq,)), arch.embedding_table(), arch.ple_table(),
                             all_logits=all_logits)
        got = session.run(["logits"], {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})[0]
        with torch.no_grad():
            want = graph(*args)[0].numpy()
        assert got.shape == want.shape == (1, seq if all_logits else 1, vocab)
        assert np.abs(got - want).max() < atol


def edit_checkpoint(src: Path, dst: Path, config: dict | None = None, drop=(), add: dict | None = None,
                    reshape: dict | None = None) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` with tensors dropped, added or replaced by zeros
    of another shape, and config.json keys updated."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    save_file(tensors, str(dst / "model.safetensors"))
    if config:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def custom_nodes(arch, path: Path, kinds=("Linear", "Attention", "LinearAttention", "MoE")) -> dict[str, list[dict]]:
    """The MNN-flavoured trace of ``arch``'s graph at ``path``: attributes of its placeholder ops
    of ``kinds`` (all four by default)."""
    import onnx

    from llmexport.trace.onnx_export import export_onnx

    export_onnx(arch.build_graph(), arch.graph_inputs(3), path, for_mnn=True)
    nodes = [n for n in onnx.load(str(path)).graph.node if n.domain == "LlmExport"]
    attrs = lambda n: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}  # noqa: E731
    return {kind: [attrs(n) for n in nodes if n.op_type == kind] for kind in kinds}


def rewrite_logits(arch, graph, ids: torch.Tensor) -> torch.Tensor:
    """The eager rewrite's logits [seq, vocab] for the prompt ``ids`` (fed as the runtime feeds it)."""
    from llmexport.trace.eager import prompt_inputs

    with torch.no_grad():
        return graph(*prompt_inputs(arch, ids, arch.embedding_table(), None))[0][0]


def rewrite_and_reference(path: Path, ids: torch.Tensor):
    """(architecture, its eager graph with the checkpoint's weights bound, that graph's logits, HF's
    fp32 logits) for the checkpoint at ``path`` on the prompt ``ids``."""
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.trace.eager import bind_weights

    arch = open_architecture(Checkpoint.open(path))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    return arch, graph, rewrite_logits(arch, graph, ids), arch.reference_logits(arch.load_reference(None), ids)


def assert_alteration_shows(path: Path, alter, ids: torch.Tensor) -> None:
    """A parity check's guard against being vacuous: ``alter`` (a change to the eager graph of the
    checkpoint at ``path``) moves its logits on ``ids`` visibly away from HF's."""
    arch, graph, _, ref = rewrite_and_reference(path, ids)
    with torch.no_grad():
        alter(graph)
    assert (rewrite_logits(arch, graph, ids) - ref).abs().max().item() > 1e-3


def set_or_delete(config: dict, key: str, value, delete: bool) -> None:
    """A config fuzz step: ``key`` removed, or set to ``value``."""
    if delete:
        config.pop(key, None)
    else:
        config[key] = value


def assert_config_edit_is_typed(src: Path, work: Path, edit: Callable[[dict], None]) -> None:
    """``src`` copied to ``work`` with ``edit`` applied to its config.json: opening it and building
    its graph either works or raises a typed one-line error (LlmExportError)."""
    import shutil

    from llmexport.errors import LlmExportError
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture

    path = shutil.copytree(src, work, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    try:
        open_architecture(Checkpoint.open(path)).build_graph()
    except LlmExportError as exc:
        assert str(exc) and "\n" not in str(exc).strip()


def tower_report(path: Path, out: Path, alter=None, media: bool = True):
    """The one tower of the checkpoint at ``path``, exported to ``out``, verified in MNN against HF
    carrying the stored weights (``alter``: a change to its ``TowerCheck``; ``media``: the image
    prompts too)."""
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.verification.towers import verify_tower
    from llmexport.verification.verify import reference_pair, stored_tensors

    arch = open_architecture(Checkpoint.open(path))
    (tower,) = arch.towers()
    check = tower.check() if alter is None else alter(tower.check())
    return verify_tower(tower, out, *reference_pair(arch, stored_tensors(out, arch)), check, media=media)


def cli_verified_visual(checkpoint: Path, dst: Path, *flags: str) -> dict:
    """``llmexport --verify`` on the command line (``flags`` added), required to pass with the
    visual tower ok: the report's ``visual`` section."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(checkpoint), "--dst_path", str(dst), *flags, "--verify"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verify: PASS" in proc.stdout and "visual ok" in proc.stdout
    report = json.loads((dst / "verify.json").read_text())
    assert report["passed"] and report["towers"]["visual"]["passed"]
    return report["towers"]["visual"]


def tower_exports(checkpoint: Path, folder: Callable[[str], Path]) -> Callable[[int], Path]:
    """``get(bits)`` -> the checkpoint exported once per tower bit width (16-bit text), into
    ``folder(name)`` (a test's ``tmp_path_factory.mktemp``)."""
    from llmexport import ExportOptions, export
    from llmexport.quant.scheme import QuantScheme

    cache: dict[int, Path] = {}

    def get(bits: int) -> Path:
        if bits not in cache:
            out = folder(f"{checkpoint.name}-visual-q{bits}") / "out"
            export(checkpoint, out, ExportOptions(quant=QuantScheme(16, 64), visual_quant_bit=bits))
            cache[bits] = out
        return cache[bits]

    return get


def media_conversation_check(checkpoint: Path, out: Path, alter=None):
    """``--verify``'s media conversation of the checkpoint's one tower on the export at ``out``
    (llmexport/verification/media_chat.py; ``alter``: a change to its ``TowerCheck``): the
    ``ConversationCheck`` and its failures under the fp16 exact-kernels bound."""
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.verification.media_chat import media_conversation, media_conversation_failures
    from llmexport.verification.verify import FP16_MAX_ABS_ERR, reference_pair, stored_tensors

    arch = open_architecture(Checkpoint.open(checkpoint))
    (tower,) = arch.towers()
    check = tower.check() if alter is None else alter(tower.check())
    chat = media_conversation(out, arch, check, *reference_pair(arch, stored_tensors(out, arch)))
    assert not isinstance(chat, str), chat
    return chat, media_conversation_failures(chat, FP16_MAX_ABS_ERR)


def assert_media_conversation(name: str, section: dict) -> None:
    """A tower section of ``verify.json`` holds a passing media conversation: an image turn and two
    text turns, each with HF's ids, HF's greedy answer and HF's top-1 at every step (printed: max
    |dlogit| per turn vs HF carrying the stored weights and vs the fp32 HF)."""
    chat = section["conversation"]
    turns = chat["turns"]
    errors = ", ".join(f"{t['oracle']['max_abs_err']:.2e}" for t in turns)
    errors32 = ", ".join(f"{t['fp32']['max_abs_err']:.2e}" for t in turns)
    print(f"\n{name} media conversation, max |dlogit| per turn vs stored-weights HF [{errors}], vs fp32 HF "
          f"[{errors32}]; top-1 {chat['top1_agreement']:.0%}; prefilled {[t['prefilled_tokens'] for t in turns]} "
          f"after keeping {[t['kept_tokens'] for t in turns]}")
    assert chat["runtime_error"] is None and len(turns) == chat["planned_turns"] == 3
    assert all(t["prompt_mismatch_at"] is None and t["oracle"]["greedy_match"] for t in turns)
    assert chat["top1_agreement"] == 1.0 and chat["max_abs_err"] < 1e-3
    assert all(t["kept_tokens"] > 0 for t in turns[1:])  # the later turns prefill only what the cache lacks


def image_conversation(checkpoint: Path, out: Path):
    """The tower's last image prompt's image as the first user turn of a chat, then two text turns,
    through the runtime's chat path (``run_chat``, MNN's exact kernels, 8 greedy steps per turn)
    on the export at ``out``: (tower, prompt, run, HF carrying the stored weights)."""
    import re
    import tempfile

    from llmexport.mnn.config import EXACT_KERNELS
    from llmexport.mnn.runtime import run_chat
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.verification.verify import reference_pair, stored_tensors

    arch = open_architecture(Checkpoint.open(checkpoint))
    (tower,) = arch.towers()
    prompt = tower.check().prompts[-1]
    with tempfile.TemporaryDirectory() as tmp:
        image = re.search(r"<img>.*</img>", prompt.runtime_text(Path(tmp)))
        assert image is not None
        first = f"{image.group(0)}Describe this picture in a few words."
        run = run_chat(out, [[first, "Tell me about the sea, briefly.", "Und jetzt auf Deutsch, bitte."]], 8,
                       config=EXACT_KERNELS)
    assert run.error is None and len(run.turns) == 3, run.error
    return tower, prompt, run, reference_pair(arch, stored_tensors(out, arch))[0]
