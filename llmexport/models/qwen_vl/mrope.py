"""Qwen3.5's and Qwen3-VL's multimodal RoPE (M-RoPE) as MNN 3.6.1's runtime feeds it.

HF (transformers models/qwen3_5/modeling_qwen3_5.py): ``get_rope_index`` gives every token three
positions (t, h, w): text tokens three equal ones, counting on from the largest position before
them; an image's soft tokens ``start + (0, row, column)`` over its merged grid, after which the
text goes on at ``start + max(rows, columns)``. ``Qwen3_5TextRotaryEmbedding.recomposition_frequencies``
then takes each rotary pair's angle from one row, interleaved: pair ``i`` reads h where
``i % 3 == 1 and i < 3 * mrope_section[1]``, w where ``i % 3 == 2 and i < 3 * mrope_section[2]``,
t otherwise. Generated tokens continue at ``count + rope_deltas``, ``rope_deltas = max + 1 - count``.

The runtime (omni.cpp ``Omni::addPositionIds`` / ``gen_position_ids``, llm.cpp) feeds
``position_ids`` [3, seq] built the same way for a prompt, with two differences the graph undoes
(``hf_relative_positions``):
- after an image the text goes on at ``start + columns`` (the last soft token's w + 1), not
  ``start + max(rows, columns)``: a taller than wide image leaves ``rows - columns`` positions
  too few for everything after it. The graph adds them back: wherever a token's three positions
  are equal (text, or an image's first soft token, which follows text) it adds what the token
  before it had above its w position, summed along the prompt.
- generated tokens get ``count + i`` on all rows (``all_seq_len``), without ``rope_deltas``. RoPE
  only sees position differences, so the graph moves the whole prompt by one constant that puts
  its last token at ``first + seq - 1``: generated tokens then stand where HF puts them, relative
  to the prompt. A text-only prefill or a decode step is left as it is (the shift is 0).
This is exact for one prefill holding any number of images, then decode steps and text-only
prefills whose table (the last encode's) is text: a later prefill reads the table from its head,
moved on by ``all_seq_len``, so a chat turn must encode only its new text (MNN's prompt cache,
mnn/chat.py; mnn/runtime.py ``run_chat``), not the whole history with its image (measured on the
tiny model: max |dlogit| 0.74 on the next turn). A later prefill that holds an image again lands
its tokens that image's compression further on than HF would.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from llmexport.errors import InputError

#: the rows of ``position_ids``
T, H, W = 0, 1, 2


def mrope_section(params: dict[str, Any], label: str, default: list[int]) -> tuple[int, int, int]:
    """``rope_parameters.mrope_section``: rotary pairs per position row (t, h, w), interleaved."""
    section = params.get("mrope_section", default)
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in section)):
        raise InputError(f"{label}: 'mrope_section' must be three counts of rotary pairs (got {section!r})")
    return section[0], section[1], section[2]


def pair_rows(section: Sequence[int], pairs: int) -> torch.Tensor:
    """The position row each of the ``pairs`` rotary pairs reads (HF's interleaved recomposition)."""
    rows = torch.zeros(pairs, dtype=torch.int64)
    for row, offset in ((H, 1), (W, 2)):
        rows[offset:3 * section[row]:3] = row
    return rows


def hf_relative_positions(positions: torch.Tensor) -> torch.Tensor:
    """The runtime's ``position_ids`` [3, seq] (int) -> float [3, seq] positions equal to HF's up
    to one constant, with the prompt's last token at ``first + seq - 1`` (module docstring)."""
    p = positions.float()
    # the token before each one (zeros before the first): a pad, not an empty slice at seq 1
    before = F.pad(p, (1, 0))[:, :-1]
    above_w = before.max(dim=0).values - before[W]
    equal = ((p[T] == p[H]) & (p[H] == p[W])).float()
    q = p + torch.cumsum(equal * above_w, dim=0)
    count = torch.ones_like(p[T]).sum()
    return q + (p[T, :1] + count - 1.0 - q.max())


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                  rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1, seq, 1, 2 * pairs] for float positions [3, seq]: each pair's angle from its
    row (``pair_rows``), both halves of a pair sharing it (rotate-half layout)."""
    freqs = positions.index_select(0, rows).transpose(0, 1) * inv_freq.view(1, -1)  # [seq, pairs]
    emb = torch.cat([freqs, freqs], dim=-1).view(1, -1, 1, 2 * inv_freq.numel())
    return emb.cos(), emb.sin()


def runtime_positions(segments: Sequence[int | tuple[int, int]]) -> torch.Tensor:
    """What the runtime feeds as ``position_ids`` [3, seq] int32 for one prompt (omni.cpp
    ``addPositionIds``): ``segments`` in prompt order, an int for that many text tokens, (rows,
    columns) for an image's merged grid, which the runtime wraps in vision start and end tokens."""
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []

    def push(a: int, b: int, c: int) -> None:
        t.append(a)
        h.append(b)
        w.append(c)

    for segment in segments:
        current = w[-1] + 1 if w else 0
        if isinstance(segment, int):
            for i in range(segment):
                push(current + i, current + i, current + i)
            continue
        rows, columns = segment
        push(current, current, current)  # vision start
        current += 1
        for r in range(rows):
            for c in range(columns):
                push(current, current + r, current + c)
        end = w[-1] + 1
        push(end, end, end)  # vision end
    return torch.tensor([t, h, w], dtype=torch.int32)
