"""The token table written on a thread of its own, beside the tracing and conversion of the text graph.

The table (mnn/token_table.py: the embedding, joined with the PLE rows where there are any) does
not depend on the graph, and tracing and MNN's converter leave the quantization workers idle:
writing it meanwhile took the 4.0 s of the embeddings stage of a 35-layer E2B-shaped export off
the critical path (docs/benchmarks.md, "Export speed and memory"). The MNN target waits for it
before the linears' weights stage, so the table's buffers and the linears' never coexist and the
memory plan's peak stays what it was. An export that fails meanwhile cancels it: the writer stops
at its next row chunk, and the staging folder is removed only after it has.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from threading import Event
from typing import Any, Iterable, Iterator

from llmexport.errors import InputError
from llmexport.mnn.config import embedding_file_name
from llmexport.planning.digests import FileDigests
from llmexport.quant.rtn import NonFiniteError


class _Cancelled(Exception):
    """The export failed elsewhere; the table's writer stops."""


class TokenTableWriter:
    """Starts writing the schemes' token table into ``out`` at once (nothing when the model has none:
    tied embeddings are read from the lm_head record); ``result()`` waits for its record."""

    def __init__(self, schemes: Any, out: Path, digests: FileDigests):
        self.file_name: str | None = None
        self.elapsed = 0.0
        self._cancel = Event()
        self._future: Future | None = None
        tables = schemes.tables()
        if "embedding" not in tables:
            return
        table, choice = tables["embedding"]
        self.file_name = embedding_file_name(choice.bits)
        pool = ThreadPoolExecutor(1, thread_name_prefix="llmexport-table")
        self._future = pool.submit(self._write, table, choice, out / self.file_name, digests)
        pool.shutdown(wait=False)  # the thread ends with the table

    def _write(self, table: Any, choice: Any, path: Path, digests: FileDigests):
        from llmexport.mnn.embeddings import write_embedding_table

        start = time.perf_counter()
        try:
            with digests.open(path) as f, table_errors(table, "embedding"):
                return write_embedding_table(f, self._unless_cancelled(choice.chunks()), choice.bits, choice.block,
                                             choice.quantizer)
        finally:
            self.elapsed = round(time.perf_counter() - start, 3)

    def _unless_cancelled(self, chunks: Iterable[Any]) -> Iterator[Any]:
        for chunk in chunks:
            if self._cancel.is_set():
                raise _Cancelled()
            yield chunk

    def result(self):
        """The table's EmbeddingRecord (None without a table); the writer's errors are raised here."""
        return None if self._future is None else self._future.result()

    def cancel(self) -> None:
        """Stop the writer and wait until it has (its errors no longer matter)."""
        self._cancel.set()
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:  # noqa: BLE001 - the export is failing for another reason
                pass


@contextmanager
def table_errors(table: Any, what: str) -> Iterator[None]:
    """A table's values or its bits/block refused by the writer, as the input errors they are."""
    try:
        yield
    except NonFiniteError as exc:
        raise InputError(f"{what} table {table.name!r}: {exc}") from None
    except ValueError as exc:
        raise InputError(f"--embed_bit/--quant_block: {what} table of width {table.shape[-1]}: {exc}") from None
