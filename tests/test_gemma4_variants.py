"""Random points of the Gemma4 feature space (layer patterns, KV sharing, K=V, PLE, MoE, RoPE,
tying, softcapping): the rewrite matches HF on each, and a sample of them runs in MNN."""

from __future__ import annotations

import pytest
import torch

from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4 import build_gemma4_checkpoint
from llmexport.trace.eager import bind_weights, prompt_inputs

from gemma4_variants import random_text_config

SEEDS = list(range(100, 124))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_variant_rewrite_matches_hf(tmp_path, seed):
    config = random_text_config(seed)
    path = build_gemma4_checkpoint(tmp_path / "model", config, seed=seed, text_only=seed % 2 == 0)
    arch = open_architecture(Checkpoint.open(path))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    torch.manual_seed(seed)
    ids = torch.randint(5, 500, (13,))
    with torch.no_grad():
        ours = graph(*prompt_inputs(arch, ids, arch.embedding_table(), arch.ple_table()))[0][0]
    ref = arch.reference_logits(arch.load_reference(None), ids)
    assert (ours - ref).abs().max().item() < 1e-4, config


@pytest.mark.slow
@pytest.mark.parametrize("seed", [101, 106, 113, 118])
def test_random_variant_runs_in_mnn(tmp_path, seed):
    from llmexport import ExportOptions, export
    from llmexport.quant.scheme import QuantScheme
    from llmexport.verification.verify import verify_export

    path = build_gemma4_checkpoint(tmp_path / "model", random_text_config(seed), seed=seed)
    export(path, tmp_path / "out", ExportOptions(quant=QuantScheme(16)))
    report = verify_export(tmp_path / "out", path, steps=12)
    assert report.passed, report.failures
    assert report.oracle.max_abs_err < 0.005
