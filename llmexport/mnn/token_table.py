"""The one table MNN's runtime reads per token: the embedding, joined with the PLE rows.

MNN 3.6.1 reads two per-token tables for a model with per-layer embeddings: the embedding
(``Llm::embedding`` -> ``DiskEmbedding``, rows of width ``hidden_size``) and the PLE table
(``ple_embed_file``, fed as the ``ple_embeddings`` input). The PLE input is cached in the
instance and rebuilt only when it is null or for one-token steps, and ``reset()`` keeps it
(``Llm::embedding``, transformers/llm/engine/src/llm.cpp; unchanged in MNN's current sources):
a chat's second turn (a multi-token forward after decoding) gets the last decoded token's PLE
row broadcast over its prompt, or a shape error. The embedding rows, in contrast, are read
afresh for every forward and every id.

So the export writes one table whose rows are ``[embedding | PLE]`` (unscaled) and declares
its width as ``hidden_size``: the runtime reads the PLE rows with the embedding, and the text
graph splits them (``Gemma4TextGraph``). A tied lm_head keeps its own record. The towers'
soft tokens, which the runtime places in that input instead of table rows, carry the PLE row
of the pad id (HF's PLE lookup for media positions) after their features (``stored_row`` gives
that row as the file stores it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llmexport.quant.rtn import NonFiniteError
from llmexport.spec import ModelTables, Prequantized


class JoinedColumns:
    """Lazy tables of the same row count read side by side: row i is the parts' rows i joined.
    Offers what the table writers read of a ``LazyTensor`` (shape, name, rows, row chunks)."""

    def __init__(self, *parts: Any):
        rows = {int(p.shape[0]) for p in parts}
        if len(rows) != 1:
            raise ValueError(f"joined tables need one row count, got {sorted(rows)}")
        self.parts = parts
        self.shape = torch.Size((rows.pop(), sum(int(p.shape[1]) for p in parts)))
        self.name = " + ".join(p.name for p in parts)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.cat([_finite(p.name, _float(p.rows(start, stop))) for p in self.parts], dim=1)

    def quantized_rows(self, start: int, stop: int) -> Prequantized:
        """Rows [start, stop) with the integers every part stores (each part's ``quantized_rows``),
        joined into one weight of one width and group (``Prequantized.join_columns``): the table
        written as stored keeps both parts' integers and affine maps."""
        return Prequantized.join_columns([p.quantized_rows(start, stop) for p in self.parts])

    def row_chunks(self, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        return self._chunks(self.rows, max_bytes)

    def quantized_chunks(self, max_bytes: int = 64 << 20) -> Iterator[Prequantized]:
        return self._chunks(self.quantized_rows, max_bytes)

    def _chunks(self, rows: Callable[[int, int], Any], max_bytes: int) -> Iterator[Any]:
        step = max(1, max_bytes // (4 * self.shape[1]))
        for start in range(0, self.shape[0], step):
            yield rows(start, min(start + step, self.shape[0]))


def _float(rows: torch.Tensor) -> torch.Tensor:
    # Parts may differ in dtype (bf16 embedding, fp16 PLE); fp32 holds both exactly.
    return rows if rows.dtype == torch.float32 else rows.float()


def _finite(name: str, rows: torch.Tensor) -> torch.Tensor:
    """The rows, refused when not finite: the error names the checkpoint tensor, not the joined table."""
    if not bool(torch.isfinite(rows).all()):
        raise NonFiniteError(f"tensor {name!r} contains NaN or Inf")
    return rows


def token_table(arch: ModelTables) -> Any | None:
    """The table the runtime reads per token; None when it reads the tied lm_head record."""
    ple = arch.ple_table()
    if ple is not None:
        return JoinedColumns(arch.embedding_table(), ple)
    return None if arch.tied_embedding else arch.embedding_table()


def split_rows(arch: ModelTables, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-table rows -> (embedding rows, PLE rows or None)."""
    width = int(arch.embedding_table().shape[1])
    if arch.ple_table() is None:
        return rows, None
    return rows[..., :width], rows[..., width:]


def stored_row(rows: Callable[[int, int], Any], token: int, bits: int, block: int, quantizer=None) -> torch.Tensor:
    """Row ``token`` as the runtime decodes it once written at ``bits``/``block``; ``rows`` reads
    the table's rows in the form ``quantizer`` takes (floats, or stored integers for a table kept as
    stored). Quantization is per row and block, so the one row written alone is the row in the file."""
    from llmexport.mnn.embeddings import read_embedding_table, write_embedding_table

    row = rows(token, token + 1)
    with tempfile.TemporaryDirectory(prefix="llmexport-row-") as tmp:
        path = Path(tmp) / "row.bin"
        with open(path, "wb") as f:
            rec = write_embedding_table(f, iter([row]), bits, block, quantizer)
        return read_embedding_table(path, 1, rec.dim, bits, rec.block,
                                    alpha_bytes=None if bits == 16 else rec.alpha_bytes)[0]
