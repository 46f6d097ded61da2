"""The streamed reference (llmexport/reference/streamed.py) computes what the full HF model computes.

On every tiny family and variant -- Gemma4's four shapes with and without towers, random points of
its feature space, Llama/Qwen3/Qwen3-MoE (per-expert checkpoint tensors that transformers stacks),
K2-Horizon's remote code -- the streamed model's logits equal ``load_reference``'s bit for bit,
on prompts with repeated ids, the pad id and the table's last row; the towers' features and
media-prompt logits too. The same holds for the fair oracle: the weights an export stored
(``StoredTensors``) streamed vs copied into the full model. And while it runs, one block at a
time holds real parameters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport import ExportOptions, export
from llmexport.quant.scheme import QuantScheme
from llmexport.reference.streamed import ReferenceLayout, reference_footprint, streamed_reference
from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
from llmexport.source.loading import open_architecture
from llmexport.spec import rows_at
from llmexport.tiny.decoders import VARIANTS as DECODER_VARIANTS
from llmexport.tiny.gemma4 import build_gemma4_checkpoint
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.k2_horizon import VARIANTS as K2_VARIANTS
from llmexport.tiny.qwen3_5 import VARIANTS as QWEN3_5_VARIANTS
from llmexport.verification.verify import stored_tensors

from conftest import GEMMA4_SHAPES
from gemma4_variants import random_text_config


def _prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    """A long prompt (past the tiny sliding windows), one token, repeated ids, the first and last rows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (23,), generator=g), torch.tensor([vocab - 1]),
            torch.tensor([7, 7, 7, 0, vocab - 1, 7, 3, 3])]


def realigned(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each parameter and buffer in a fresh allocation. CPU matmul kernels take other
    code paths for other operand alignments, and transformers' loader places parameters at offsets
    torch's allocator never uses: that alone moves the full model's own logits by ~1e-6. The
    streamed reference allocates as torch does, so this is the model it must equal bit for bit."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()
    return model


def _assert_same_logits(arch, full, streamed, vocab: int, seed: int = 0) -> None:
    """Bit for bit against the realigned full model, and within the loader's own alignment noise
    against the full model as ``from_pretrained`` placed it."""
    placed = {len(ids): arch.reference_logits(full, ids) for ids in _prompts(vocab, seed)}
    realigned(full)
    for ids in _prompts(vocab, seed):
        expected = arch.reference_logits(full, ids)
        got = arch.reference_logits(streamed, ids)
        assert torch.equal(got, expected), f"max |diff| {float((got - expected).abs().max())} on {ids.tolist()}"
        assert float((got - placed[len(ids)]).abs().max()) < 1e-4
    tail = _prompts(vocab, seed)[0]  # the lm_head on the last positions only, as verification asks
    assert torch.equal(arch.reference_logits(streamed, tail, 20), arch.reference_logits(full, tail, 20))


def _vocab(arch) -> int:
    return int(arch.embedding_table().shape[0])


def _check_checkpoint(path, trust: bool = False, seed: int = 0):
    arch = open_architecture(Checkpoint.open(path))
    full = arch.load_reference(None, trust_remote_code=trust)
    streamed = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights), trust)
    _assert_same_logits(arch, full, streamed, _vocab(arch), seed)
    return arch, full, streamed


@pytest.mark.parametrize("shape", GEMMA4_SHAPES)
@pytest.mark.parametrize("text_only", [False, True])
def test_gemma4_shapes(tiny_gemma4, shape, text_only):
    _check_checkpoint(tiny_gemma4(shape, text_only))


@pytest.mark.parametrize("seed", range(100, 112))
def test_gemma4_feature_space(tmp_path, seed):
    """Layer patterns, KV sharing, K=V, PLE widths, MoE, RoPE, tying, softcapping (tests/gemma4_variants.py)."""
    path = build_gemma4_checkpoint(tmp_path / "model", random_text_config(seed), seed=seed, text_only=seed % 2 == 0)
    _check_checkpoint(path, seed=seed)


@pytest.mark.parametrize("variant", sorted(DECODER_VARIANTS))
def test_decoder_families(tiny_decoder, variant):
    """Llama and Qwen3 variants; Qwen3-MoE's per-expert tensors go through ``reference_slot``."""
    _check_checkpoint(tiny_decoder(variant))


@pytest.mark.parametrize("variant", sorted(QWEN3_5_VARIANTS))
def test_qwen3_5(tiny_qwen3_5, variant):
    """The multimodal layout's conditional-generation reference (its tower never filled: text
    prompts do not run it) and the causal LMs; the MoE types' per-expert tensors through
    ``reference_slot``; the recurrent layers' conv kernels and 1-D constants read once."""
    _check_checkpoint(tiny_qwen3_5(variant))


def test_qwen3_vl_moe_transposed_stacks(tiny_qwen3_vl_moe):
    """Qwen3-VL-MoE's expert stacks stored [E, in, out] as released: transposed into the
    reference's [E, out, in] (``reference_transposed``)."""
    arch, *_ = _check_checkpoint(tiny_qwen3_vl_moe)
    assert arch.names.transposed


@pytest.mark.parametrize("variant", sorted(K2_VARIANTS))
def test_k2_horizon_remote_code(tiny_k2_horizon, variant):
    _check_checkpoint(tiny_k2_horizon(variant), trust=True)


@pytest.fixture(scope="module")
def both_towers(tmp_path_factory):
    return build_tiny_multimodal(tmp_path_factory.mktemp("vision-audio"), "vision-audio-64")


def test_towers_features_and_media_prompts(both_towers):
    """Vision and audio encoders are streamed layer by layer too: their soft tokens, and the logits
    of prompts carrying them, equal the full model's."""
    arch, full, streamed = _check_checkpoint(both_towers)
    for tower in arch.towers():  # ``full`` is realigned by now
        check = tower.check()
        for expected, got in zip(check.features(full), check.features(streamed)):
            assert torch.equal(got, expected), tower.name
        for prompt in check.prompts:
            ids = prompt.ids + [300, 301]  # two text tokens after the media
            assert torch.equal(check.prompt_logits(streamed, prompt)(ids), check.prompt_logits(full, prompt)(ids))


def test_one_block_at_a_time(tiny_gemma4):
    """While a block runs it is the only one holding parameters; after a forward none does, and the
    lm_head is back on the meta device."""
    arch = open_architecture(Checkpoint.open(tiny_gemma4("26b-a4b")))
    model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights))
    layout = ReferenceLayout.of(model)
    held: list[list[str]] = []

    def loaded() -> list[str]:
        return [name for name in layout.blocks
                if any(p.device.type != "meta" for p in model.get_submodule(name).parameters())]

    for name in layout.blocks:  # registered after the streaming hooks: runs once the block is filled
        model.get_submodule(name).register_forward_pre_hook(lambda *_: held.append(loaded()))
    arch.reference_logits(model, torch.arange(3, 20))
    assert len(held) == len(layout.blocks) and all(len(h) == 1 for h in held)
    assert loaded() == []
    assert 0 < reference_footprint(arch).peak < sum(p.numel() for p in arch.load_reference(None).parameters()) * 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=30))
def test_rows_at_reads_runs_and_keeps_the_order(ids):
    table = torch.arange(41 * 3, dtype=torch.float32).view(41, 3)
    reads: list[tuple[int, int]] = []

    def read(start: int, stop: int) -> torch.Tensor:
        reads.append((start, stop))
        return table[start:stop]

    got = rows_at(read, torch.tensor(ids, dtype=torch.long))
    assert torch.equal(got, table[torch.tensor(ids, dtype=torch.long)].view(-1, 3))
    unique = sorted(set(ids))
    runs = sum(1 for i, v in enumerate(unique) if i == 0 or unique[i - 1] != v - 1)
    assert len(reads) == max(runs, 1) and sum(b - a for a, b in reads) == len(unique)


# --- the fair oracle: what an export stored ----------------------------------------------------------
def _check_stored(path, out, options: ExportOptions, trust: bool = False) -> None:
    export(path, out, options)
    arch = open_architecture(Checkpoint.open(path))
    stored = stored_tensors(out, arch)
    full = arch.load_reference(stored, trust_remote_code=trust)
    streamed = streamed_reference(arch, stored, trust)
    _assert_same_logits(arch, full, streamed, _vocab(arch))
    fp32 = arch.load_reference(None, trust_remote_code=trust)
    ids = _prompts(_vocab(arch), 0)[0]
    moved = float((arch.reference_logits(fp32, ids) - arch.reference_logits(streamed, ids)).abs().max())
    assert moved > 1e-4, "the oracle must carry the stored (rounded) weights, not the checkpoint's"
    for tower in arch.towers():
        check = tower.check()
        for expected, got in zip(check.features(full), check.features(streamed)):
            assert torch.equal(got, expected), tower.name


@pytest.mark.slow
@pytest.mark.parametrize("shape, options", [
    ("e2b", ExportOptions(quant=QuantScheme(4, 64), embed_bit=4)),   # tied lm_head stored apart, PLE table
    ("31b", ExportOptions(quant=QuantScheme(8, 32), embed_bit=8)),   # untied embedding file
    ("26b-a4b", ExportOptions(quant=QuantScheme(4, 64))),            # stacked experts, tied head read as table
])
def test_stored_oracle_gemma4(tiny_gemma4, tmp_path, shape, options):
    _check_stored(tiny_gemma4(shape, text_only=True), tmp_path / "out", options)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama3-tied", "qwen3-moe"])
def test_stored_oracle_decoders(tiny_decoder, tmp_path, variant):
    """Bias records (llama3-tied) and per-expert checkpoint tensors (qwen3-moe)."""
    _check_stored(tiny_decoder(variant), tmp_path / "out", ExportOptions(quant=QuantScheme(4, 32), embed_bit=8))


@pytest.mark.slow
def test_stored_oracle_qwen3_5_moe(tiny_qwen3_5, tmp_path):
    """The multimodal layout's text linears and per-expert records beside an untouched tower."""
    _check_stored(tiny_qwen3_5("qwen3_5-moe"), tmp_path / "out", ExportOptions(quant=QuantScheme(4, 32), embed_bit=8))


@pytest.mark.slow
def test_stored_oracle_qwen3_vl_moe(tiny_qwen3_vl_moe, tmp_path):
    """Each expert's record read back into its row of a transposed stack, beside the tower."""
    _check_stored(tiny_qwen3_vl_moe, tmp_path / "out", ExportOptions(quant=QuantScheme(4, 32), embed_bit=8))


@pytest.mark.slow
def test_stored_oracle_towers(both_towers, tmp_path):
    """Tower linears read back from ``{tower}.mnn.weight`` (4-bit, so they differ from the checkpoint's)."""
    _check_stored(both_towers, tmp_path / "out", ExportOptions(quant=QuantScheme(4, 32), embed_bit=4,
                                                                visual_quant_bit=4, audio_quant_bit=4))


def test_records_missing_from_the_graph_are_an_error(tiny_gemma4, tmp_path, monkeypatch):
    """A linear the graph has no record for would silently keep the checkpoint's weights in the oracle."""
    import llmexport.mnn.readback as readback

    arch = open_architecture(Checkpoint.open(tiny_gemma4("e2b", text_only=True)))
    records = {spec.name: {"external": [0, 0, 0, 0], "quanParameter": {}, "oc": 1, "ic": 1}
               for spec in arch.linears()}
    records.pop("lm_head")
    monkeypatch.setattr(readback, "linear_records", lambda *_: dict(records))
    monkeypatch.setattr(readback, "stored_tables", lambda *_: {})
    with pytest.raises(ValueError, match="1 linear.*'lm_head'"):
        stored_tensors(tmp_path, arch)
