"""Worker threads that run the quantization of independent row slices, each single-threaded.

torch's own intra-op threads (OpenMP) meet at a barrier after every operation, so one thread
that the OS preempts stalls the others: on this project's 2-core machine, with other processes
busy, quantizing the same tiles took 14x longer on 2 OpenMP threads than on 2 single-threaded
workers (docs/benchmarks.md). The writers therefore cut each tensor into row slices and map them
over these workers; torch releases the GIL inside its kernels, so the slices run in parallel.
Results come back in order, with a bounded number of slices in flight.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_worker = threading.local()


def worker_count() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _init_worker() -> None:
    # omp_set_num_threads is per thread: this leaves the caller's own torch threads alone.
    torch.set_num_threads(1)
    _worker.active = True


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks of up to 256 MiB for reuse instead of returning them to the
    OS (and of taking fresh mmap'd blocks for every large allocation). Otherwise each slice's
    few-MB temporaries are new pages, and the page faults on them, which the threads of one
    process take in turn, made two workers no faster than one (kernels of a 12-layer E2B-shaped
    model: 1.9-2.5 s on two workers and 1.9 s on one; 1.5 s on two with this). Peak memory is
    unchanged (1.21 GiB for that export either way): what is kept is what the export used."""
    set_malloc(mmap_threshold=256 << 20, trim_threshold=512 << 20)


@contextlib.contextmanager
def malloc_policy(mmap_threshold: int) -> Iterator[None]:
    """``set_malloc(mmap_threshold)`` for a while; then the workers' policy again where they run."""
    set_malloc(mmap_threshold)
    try:
        yield
    finally:
        if _pool is not None:
            _keep_freed_memory()


def set_malloc(mmap_threshold: int, trim_threshold: int | None = None) -> None:
    """glibc's allocation policy for this process (``mallopt``; nothing elsewhere): blocks of at
    least ``mmap_threshold`` bytes are mapped on their own (and returned when freed); freed heap
    above ``trim_threshold`` is returned to the OS."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, mmap_threshold)
    if trim_threshold is not None:
        libc.mallopt(m_trim_threshold, trim_threshold)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _keep_freed_memory()
            _pool = ThreadPoolExecutor(max_workers=worker_count(), thread_name_prefix="llmexport-quant",
                                       initializer=_init_worker)
        return _pool


def map_ordered(fn: Callable[[T], R], items: Iterable[T], in_flight: int | None = None) -> Iterator[R]:
    """``map(fn, items)`` on the workers, in order, at most ``in_flight`` results pending.

    Called from a worker itself (nested), or with one core, it runs inline.
    """
    if getattr(_worker, "active", False) or worker_count() == 1:
        yield from map(fn, items)
        return
    pool = _get_pool()
    limit = in_flight or 2 * worker_count()
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= limit:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
