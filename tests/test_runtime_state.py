"""A conversation's runtime state: a second multi-token forward, a decode step between turns and
``reset()`` in one MNN instance give what a fresh instance gives on the whole history.

MNN 3.6.1 caches the ``ple_embeddings`` input of a per-layer-embedding model and refreshes it
only when null or for one-token steps (``Llm::embedding``), so before the token table carried
the PLE rows (mnn/token_table.py) these forwards failed with a shape error or read a stale row.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmexport import ExportOptions, export
from llmexport.mnn.config import RuntimeProfile
from llmexport.quant.scheme import QuantScheme

# Runs in a child: the runtime may crash at interpreter exit (os._exit ends it).
CHILD = r"""
import json, os, sys
import numpy as np
import MNN.llm as llm

def instance():
    m = llm.create(sys.argv[1])
    m.set_config({"thread_num": 2})
    m.load()
    return m

def logits(var):
    return np.array(var.read(), dtype=np.float32, copy=True).reshape(-1)

A, B, C = list(range(10, 31)), list(range(40, 70)), list(range(100, 121))
m = instance()
out = {}
logits(m.forward(A))
out["second_turn"] = logits(m.forward(B))
m.reset()
out["after_reset"] = logits(m.forward(C))
m.reset()
logits(m.forward(A))
logits(m.forward([5]))
out["after_decode"] = logits(m.forward(B))
fresh = {"second_turn": A + B, "after_reset": C, "after_decode": A + [5] + B}
diffs = {}
for name, ids in fresh.items():
    fresh_instance = instance()  # kept alive until its output is read
    want = logits(fresh_instance.forward(ids))
    diffs[name] = [float(np.abs(out[name] - want).max()), int(out[name].argmax() == want.argmax())]
print(json.dumps(diffs))
sys.stdout.flush()
os._exit(0)
"""


def run_turns(export_dir) -> dict[str, list[float]]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(export_dir / "config.json")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape,embed_bit,profile", [
    ("e2b", 4, RuntimeProfile.EXACT),  # PLE rows in a 4-bit token table
    ("e2b", None, RuntimeProfile.FAST),  # bf16 token table, the shipped profile's int8 kernels
    ("e4b", 8, RuntimeProfile.EXACT),  # another layer count and PLE width, 8-bit table
    ("31b", None, RuntimeProfile.EXACT),  # no PLE: the untied embedding file alone
])
def test_second_turn_reset_and_decode_match_a_fresh_instance(tiny_gemma4, tmp_path, shape, embed_bit, profile):
    out = tmp_path / "out"
    block = 32 if shape == "e4b" else 64  # e4b's token table is 160 wide
    export(tiny_gemma4(shape), out, ExportOptions(quant=QuantScheme(4, block), embed_bit=embed_bit,
                                                  runtime_profile=profile))
    diffs = run_turns(out)
    print(f"\n{shape} embed_bit={embed_bit} {profile.value}: {diffs}")
    assert diffs["after_reset"][0] == 0.0  # reset leaves nothing behind
    for name in ("second_turn", "after_decode"):
        max_diff, same_top1 = diffs[name]
        # The exact kernels differ from one whole prefill by float reordering only; the fast
        # profile quantizes activations per call, so a split prefill moves its rounding.
        assert max_diff < (1e-4 if profile is RuntimeProfile.EXACT else 0.5), (name, diffs)
        assert same_top1 or profile is RuntimeProfile.FAST, (name, diffs)


def test_text_only_checkpoint_keeps_state_across_turns(tiny_gemma4, tmp_path):
    """A ``gemma4_text`` checkpoint (Gemma4ForCausalLM layout) exports the same token table."""
    out = tmp_path / "out"
    export(tiny_gemma4("e2b", text_only=True), out, ExportOptions(quant=QuantScheme(8, 64), embed_bit=8,
                                                                  runtime_profile=RuntimeProfile.EXACT))
    diffs = run_turns(out)
    assert all(d[0] < 1e-4 and d[1] for d in diffs.values()), diffs
