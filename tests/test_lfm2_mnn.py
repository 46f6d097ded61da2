"""LFM2 / LFM2-MoE exports run by MNN's runtime next to transformers in fp32 (short-conv layers on
MNN's LinearAttention op, attention layers on its Attention op, routed experts on its MoE op).

The tiny checkpoints are bf16, so a 16-bit export stores their weights exactly (the conv kernels
are fp32 graph constants, tests/test_graph_constants.py): the runtime is held to both the
stored-weights oracle and the unmodified fp32 reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_decoder_families_mnn import _assert_agrees, _stop_ids, _token_id
from test_run_command import FIRST, SECOND, _fresh_replay, _run, _turns

from llmexport import ExportOptions, export
from llmexport.mnn.config import RECURRENT_STATE
from llmexport.mnn.convert import mnn_to_json
from llmexport.models.lfm2.chat_template import LFM2, derive_runtime_template
from llmexport.quant.scheme import QuantScheme
from llmexport.tiny.byte_level_tokenizer import STYLES
from llmexport.tiny.lfm2 import TOKENIZER_STYLE, VARIANTS, build_lfm2_checkpoint, random_config
from llmexport.verification.verify import summary_line, verify_export

from families import parametrize

MODEL_TYPE = {variant: model_type for variant, (model_type, _) in VARIANTS.items()}


def _ops(out, tmp_path) -> dict[str, list[dict]]:
    graph = mnn_to_json(out / "llm.mnn", tmp_path / "g.json")
    ops: dict[str, list[dict]] = {}
    for op in graph["oplists"]:
        ops.setdefault(op["type"], []).append(op)
    return {**ops, "subgraphs": graph.get("subgraphs", [])}


@pytest.fixture(scope="module")
def exported(tiny_lfm2, tmp_path_factory):
    """``exported(variant)`` -> a 16-bit export of the tiny variant, made once per module."""
    cache: dict[str, Path] = {}

    def build(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = tmp_path_factory.mktemp(f"lfm2-{variant}-q16") / "out"
            export(tiny_lfm2(variant), cache[variant], ExportOptions(quant=QuantScheme(16, 64)))
        return cache[variant]

    return build


@pytest.mark.slow
@parametrize("mnn", "variant", sorted(VARIANTS), MODEL_TYPE.get)
def test_fp16_export_agrees_with_fp32_reference(tiny_lfm2, exported, tmp_path, variant):
    path, out = tiny_lfm2(variant), exported(variant)
    report = verify_export(out, path, steps=24)
    print(f"\nlfm2 {variant} q16: {summary_line(report)}")
    _assert_agrees(report, 24)
    assert report.oracle.top1_agreement == report.fp32.top1_agreement == 1.0
    assert report.oracle.max_abs_err < 0.005 and report.fp32.max_abs_err < 0.005
    assert len(set(report.oracle.greedy_ref)) > 3  # decoding is not stuck on one token
    style = STYLES[TOKENIZER_STYLE]
    assert _stop_ids(out) == list(dict.fromkeys(_token_id(path, t) for t in (style.eos, *style.generation_eos)))
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["attention_type"] == "full" and llm_config["jinja"]["chat_template"] == \
        derive_runtime_template(style.chat_template, LFM2)
    assert llm_config[RECURRENT_STATE] is True  # the runners never erase such a history (docs/output-format.md)
    chat = report.conversation
    assert chat is not None and chat.runtime_error is None and len(chat.turns) == chat.planned_turns
    assert chat.max_abs_err < 0.005  # later turns carry the conv state of the earlier ones
    print("kept tokens per turn:", [t.kept_tokens for t in chat.turns])
    if variant == "dense":  # a history that extends the cache is continued, state and all, without reset()
        assert any(t.turn and t.kept_tokens for t in chat.turns)
    assert json.loads((out / "config.json").read_text())["precision"] == ("normal" if "moe" in variant else "low")
    ops = _ops(out, tmp_path)
    layers = [layer == "full_attention" for layer in VARIANTS[variant][1]["layer_types"] or
              ["full_attention" if i in VARIANTS[variant][1]["full_attn_idxs"] else "conv" for i in range(4)]]
    assert len(ops["LinearAttention"]) == layers.count(False) and len(ops["Attention"]) == layers.count(True)
    experts = {s["name"].rsplit("_", 1)[0] for s in ops["subgraphs"]}
    dense = VARIANTS[variant][1].get("num_dense_layers", 4)
    assert experts == {f"/expert/{i}" for i in range(dense, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_4bit_export_verifies(tiny_lfm2, tmp_path, variant):
    out = tmp_path / "q4"
    export(tiny_lfm2(variant), out, ExportOptions(quant=QuantScheme(4, 32)))
    report = verify_export(out, tiny_lfm2(variant), steps=12)
    print(f"\nlfm2 {variant} q4: {summary_line(report)}")
    assert report.passed, report.failures
    # the fast profile's 8-bit activations cost ~0.1-0.3 logits here; the exact kernels hold the
    # runtime to the weights it stores
    assert report.exact_kernels is not None and report.exact_kernels.max_abs_err < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("seed", [401, 404])
def test_random_config_runs_in_mnn(tmp_path, seed):
    model_type, config = random_config(seed)
    path = build_lfm2_checkpoint(tmp_path / "model", model_type, config, seed=seed)
    export(path, tmp_path / "out", ExportOptions(quant=QuantScheme(16, 64)))
    _assert_agrees(verify_export(tmp_path / "out", path, steps=12), 12)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_cli_verify(tiny_lfm2, tmp_path, variant):
    """``llmexport --verify`` on the command line, the conversation check included."""
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(tiny_lfm2(variant)), "--dst_path", str(dst), "--quant_bit", "8", "--verify"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verify: PASS" in proc.stdout
    report = json.loads((dst / "verify.json").read_text())
    assert report["passed"] and report["conversation"]["turns"]


#: one runtime instance on an export (a second instance in the same process crashes 3.6.1): the
#: last logits of one id as the fresh instance's first call; of a + b prefilled at once; of b after
#: a + c was prefilled and the history erased back to a (what a chat's rewind does); of a + b
#: prefilled again after reset(); of the one id again after reset()
_PROBE = r"""
import json, os, sys
import numpy as np
import MNN.llm as llm
config, a, b, c = json.loads(sys.argv[1])
m = llm.create(config)
m.set_config({"reuse_kv": True, "thread_num": 1})
m.load()
def last(v):
    return np.array(v.read(), dtype=np.float32, copy=True).reshape(-1)
def restart():
    m.reset()
    m._c_obj.generate_init()
out = {"one_fresh": last(m.forward(b[:1]))}
restart()
out["full"] = last(m.forward(a + b))
restart()
m.forward(a + c)
m._c_obj.erase_history(len(a), 0)
m._c_obj.generate_init()
out["erased"] = last(m.forward(b))
restart()
out["again"] = last(m.forward(a + b))
restart()
out["one_after_reset"] = last(m.forward(b[:1]))
np.savez(sys.argv[2], **out)
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_recurrent_state_is_cut_back_only_by_reset_and_a_multi_token_prefill(exported, tmp_path):
    """Measured on MNN 3.6.1 with an LFM2 export: erasing the history back to a prefix and
    prefilling the rest does not give the logits of the whole sequence (the conv state is not cut
    back), while reset() and prefilling the whole history again does, exactly; one id after
    reset() keeps the last sequence's conv state (the fresh instance's first call differs). Hence
    the runners' rule (mnn/runtime.py ``_rewind``, ``_prefill_ids``; mnn/chat.py)."""
    out = exported("dense")
    ids = json.dumps([str(out / "config.json"), [30, 41, 52, 63, 74], [85, 96, 107], [118, 129, 140]])
    proc = subprocess.run([sys.executable, "-c", _PROBE, ids, str(tmp_path / "probe.npz")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.load(tmp_path / "probe.npz")
    full = got["full"]
    assert np.abs(full).max() > 1.0
    assert np.array_equal(got["again"], full)  # reset() + the whole history: exact
    assert np.abs(got["erased"] - full).max() > 1e-2  # erase_history + the rest: not the same sequence
    assert np.abs(got["one_after_reset"] - got["one_fresh"]).max() > 1e-2  # stale state after reset()


@pytest.mark.slow
def test_conversation_check_fails_when_the_history_is_erased(tiny_lfm2, exported, tmp_path):
    """The same export without ``recurrent_state``: the chat runner erases the history as for a
    KV cache alone, the conv state is wrong from the second turn on, and verify fails on it."""
    broken = shutil.copytree(exported("dense"), tmp_path / "broken")
    config = json.loads((broken / "llm_config.json").read_text())
    del config[RECURRENT_STATE]
    (broken / "llm_config.json").write_text(json.dumps(config))
    report = verify_export(broken, tiny_lfm2("dense"), steps=8)
    print("\nwithout recurrent_state:", report.failures)
    assert report.oracle.top1_agreement == 1.0  # the single prompt (a fresh instance) still agrees
    assert not report.passed
    assert all("conversation" in failure for failure in report.failures), report.failures
    assert report.conversation is not None and report.conversation.max_abs_err > 0.1


@pytest.mark.slow
def test_llmexport_run_chats_with_the_recurrent_state(exported, tmp_path):
    """``llmexport-run`` on an LFM2 export: turn two answers as a fresh instance does from the same
    ids (the conv state of turn one carried, or the history prefilled whole after reset()), /reset
    starts over exactly, and a raw one-token start after /reset is refused (it would keep the last
    sequence's state) while the session goes on."""
    folder, transcript = exported("dense"), tmp_path / "t.jsonl"
    proc = _run(folder, "--max_new_tokens", 12, "--transcript", transcript,
                stdin=f"{FIRST}\n{SECOND}\n/reset\n{FIRST}\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    one, two, reset, three = _turns(transcript)
    assert reset == {"reset": True} and three["ids"] == one["ids"]
    assert two["stats"]["prompt_tokens"] in (len(two["context_ids"]),  # prefilled whole after reset()
                                             len(two["context_ids"]) - len(one["context_ids"]) - len(one["ids"]))
    want = _fresh_replay(folder, one, two)
    assert want["cached"] == want["template"] and want["answer"] == two["ids"]
    raw = _run(folder, "--raw", "--max_new_tokens", 4, "--quiet", stdin="Hello there\n/reset\nA\nHello there\n")
    assert raw.returncode == 0 and "recurrent state" in raw.stderr, raw.stderr
