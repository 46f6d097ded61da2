"""Bidirectional attention over image spans (text_config.use_bidirectional_attention "vision"):
the marked soft tokens and the opened sliding mask (gemma4_media.py) vs HF's masks and HF's
full model, eagerly; refusal of the settings the export cannot honour."""

from __future__ import annotations

import json
import math
import shutil

import PIL  # noqa: E402,F401  (pillow is a dependency)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.errors import InputError
from llmexport.media.image import synthetic_image
from llmexport.models.gemma4.media import MARK_THRESHOLD, MEDIA_MARK, open_media_spans, unmark_media
from llmexport.models.gemma4.tower_checks import PROMPT_HEAD, FullModel, hf_processor, processor_inputs
from llmexport.models.gemma4.vision import image_features
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.trace.eager import bind_weights, prompt_inputs

BIDIRECTIONAL = {"use_bidirectional_attention": "vision"}
LOWEST = torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def bidirectional(tmp_path_factory):
    path = build_tiny_multimodal(tmp_path_factory.mktemp("bidir"), "vision-64", text_overrides=BIDIRECTIONAL)
    arch = open_architecture(Checkpoint.open(path))
    return path, arch, arch.load_reference(None)


def _runtime_mask(seq: int, kv: int, window: int) -> torch.Tensor:
    """MNN 3.6.1 Llm::gen_attention_mask, sliding slice, for ``seq`` new tokens after ``kv - seq`` cached."""
    q = torch.arange(seq).view(-1, 1) + (kv - seq)
    k = torch.arange(kv).view(1, -1)
    return torch.where((k <= q) & (k > q - window), 0.0, LOWEST).view(1, 1, seq, kv)


def _hf_mask(types: list[int], cached: int, window: int) -> torch.Tensor:
    """HF's rule (masking_utils blockwise_overlay / sliding_window_overlay, Gemma4's
    create_masks_for_vision_model): AND(window, OR(causal, same image run)); cached keys are text."""
    from transformers.masking_utils import blockwise_overlay, sliding_window_overlay
    from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

    blocks = get_block_sequence_ids_for_mask(torch.tensor([[0] * cached + types]), torch.device("cpu"))
    same, inside = blockwise_overlay(blocks), sliding_window_overlay(window)
    seq, kv = len(types), cached + len(types)
    allowed = torch.zeros(seq, kv, dtype=torch.bool)
    for i in range(seq):
        q = cached + i
        for k in range(kv):
            allowed[i, k] = bool(inside(0, 0, q, k) & ((k <= q) | same(0, 0, q, k)))
    return allowed


@settings(max_examples=60, deadline=None)
@given(types=st.lists(st.sampled_from([0, 0, 1]), min_size=1, max_size=24), cached=st.integers(0, 6),
       window=st.integers(1, 10))
def test_opened_mask_is_hfs(types, cached, window):
    marked = torch.tensor(types, dtype=torch.bool)
    mask = open_media_spans(_runtime_mask(len(types), cached + len(types), window), marked)
    assert torch.equal(mask[0, 0] == 0, _hf_mask(types, cached, window))
    assert set(mask.unique().tolist()) <= {0.0, LOWEST}


@settings(max_examples=40, deadline=None)
@given(seq=st.integers(1, 12), hidden=st.integers(1, 64), seed=st.integers(0, 2 ** 16))
def test_marks_round_trip_exactly(seq, hidden, seed):
    """Image rows times 2^40 (then the runtime's 1/39.25) come back bit for bit; text rows are untouched."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(seq, 1, hidden, generator=g) * 0.05
    image = torch.rand(seq, generator=g) < 0.5
    features = torch.randn(seq, 1, hidden, generator=g) * (1.0 / 39.25)
    runtime = torch.where(image.view(-1, 1, 1), features * MEDIA_MARK * (1.0 / 39.25), embeds)
    out, marked = unmark_media(runtime)
    assert torch.equal(marked, image)
    assert torch.equal(out, torch.where(image.view(-1, 1, 1), features * (1.0 / 39.25), embeds))


def test_threshold_separates_real_rows_from_marked_ones(bidirectional):
    """No embedding row comes near the threshold, and every marked soft token (RMS-normalised,
    then projected, as the runtime hands it over) exceeds it by a wide margin."""
    path, arch, hf = bidirectional
    table = hf.model.language_model.embed_tokens.weight.detach()
    processor = hf_processor(path)
    pixels = processor.image_processor(images=[synthetic_image(317, 451, seed=2)], return_tensors="pt")
    soft = image_features(hf, pixels["pixel_values"], pixels["image_position_ids"])
    arriving = soft / math.sqrt(arch.args.hidden_size) * MEDIA_MARK
    print(f"\nmax |embedding| {table.abs().max():.3g}, min over soft tokens of max |marked| "
          f"{arriving.abs().amax(-1).min():.3g}, threshold {MARK_THRESHOLD:.3g}")
    assert table.abs().max() < MARK_THRESHOLD * 1e-3
    assert arriving.abs().amax(-1).min() > MARK_THRESHOLD * 1e3


@pytest.mark.parametrize("sizes", [[(200, 640)], [(317, 451), (120, 90)]])
def test_text_graph_matches_hfs_full_model(bidirectional, sizes):
    """The exported text graph, fed as the runtime feeds it (marked soft tokens, causal + sliding
    mask), equals HF's full model on the processor's inputs, for one and two images; without the
    opened mask it would not."""
    path, arch, hf = bidirectional
    assert arch.marks_images
    processor = hf_processor(path)
    images = [synthetic_image(h, w, seed=h) for h, w in sizes]
    text = PROMPT_HEAD + " then ".join(processor.image_token for _ in images) + " Describe both."
    prompt = FullModel(hf, processor_inputs(processor, text, images=images))
    ref = prompt(prompt.ids)
    ids = torch.tensor(prompt.ids)
    lm = hf.model.language_model
    inputs = list(prompt_inputs(arch, arch.ple_lookup_ids(ids), lm.embed_tokens.weight.detach(),
                                lm.embed_tokens_per_layer.weight.detach()))
    slots = (ids == arch.checkpoint.config["image_token_id"]).nonzero().view(-1)
    features = image_features(hf, prompt.inputs["pixel_values"], prompt.inputs["image_position_ids"])
    inputs[0] = inputs[0].clone()
    # a soft token fills the embedding columns; the PLE tail (the pad id's row) comes marked too
    hidden = arch.args.hidden_size
    inputs[0][slots, 0, :hidden] = features / math.sqrt(hidden)
    inputs[0][slots, 0] *= MEDIA_MARK
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    with torch.no_grad():
        ours = graph(*inputs)[0][0]
        graph.media_spans = False  # what the export did before: causal, and the marks left in
        inputs[0][slots, 0] /= MEDIA_MARK
        causal = graph(*inputs)[0][0]
    print(f"\n{sizes}: opened mask vs HF {(ours - ref).abs().max():.2e}, causal vs HF {(causal - ref).abs().max():.2f}")
    assert (ours - ref).abs().max() < 1e-4
    assert (causal - ref).abs().max() > 0.1


def _with_text_config(src, tmp_path, **changes):
    copy = tmp_path / "ck"
    shutil.copytree(src, copy)
    config = json.loads((copy / "config.json").read_text())
    config["text_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("value,match", [("all", "'all'"), ("images", "must be null, 'vision' or 'all'")])
def test_unexportable_settings_are_refused(bidirectional, tmp_path, value, match):
    path = _with_text_config(bidirectional[0], tmp_path, use_bidirectional_attention=value)
    with pytest.raises(InputError, match=f"config.json: text_config 'use_bidirectional_attention' .*{match}"):
        open_architecture(Checkpoint.open(path))


def test_only_a_vision_checkpoint_with_sliding_layers_marks_images(tmp_path):
    audio = build_tiny_multimodal(tmp_path / "audio", "audio-64", text_overrides=BIDIRECTIONAL)
    assert not open_architecture(Checkpoint.open(audio)).marks_images
    full = build_tiny_multimodal(tmp_path / "full", "vision-64",
                                 text_overrides=dict(BIDIRECTIONAL, layer_types=["full_attention"] * 8))
    arch = open_architecture(Checkpoint.open(full))
    assert arch.args.bidirectional_vision and not arch.marks_images  # HF: full layers stay causal
    plain = build_tiny_multimodal(tmp_path / "plain", "vision-64")
    arch = open_architecture(Checkpoint.open(plain))
    assert not arch.marks_images and not arch.build_graph().media_spans
    assert arch.towers()[0].output_scale == arch.towers()[0].args.output_scale
