"""Progress reporting: tqdm bars on a terminal or in a notebook, plain log lines in CI logs.

A bar redraws itself with carriage returns, which turns a CI log into noise; when stderr is not
a terminal (and we are not in a notebook) progress is logged as a few lines instead.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("llmexport.progress")


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    try:
        return shell is not None and shell.get_ipython() is not None and \
            type(shell.get_ipython()).__name__ == "ZMQInteractiveShell"
    except Exception:  # IPython internals vary across versions; no notebook then
        return False


def bars_wanted(quiet: bool) -> bool:
    """Whether progress is drawn as bars (a terminal or a notebook, not ``--quiet``); also asked for
    huggingface_hub's download bars (llmexport.source.hub)."""
    return not quiet and (sys.stderr.isatty() or _in_notebook())


class Progress:
    """``with Progress("weights", total_bytes, quiet) as p: p.update(n)``."""

    def __init__(self, stage: str, total: int, quiet: bool = False, unit: str = "B"):
        self.stage, self.total, self.quiet, self.unit = stage, max(total, 1), quiet, unit
        self.done, self._bar, self._next_log, self._start = 0, None, 0.25, time.perf_counter()

    def __enter__(self) -> "Progress":
        if bars_wanted(self.quiet):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=self.stage, unit=self.unit, unit_scale=True, leave=False)
        return self

    def update(self, amount: int) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
        elif not self.quiet and self.done / self.total >= self._next_log:
            elapsed = time.perf_counter() - self._start
            eta = elapsed * (self.total - self.done) / max(self.done, 1)
            log.info("%s: %d%% (%s of %s, %.0fs elapsed, ETA %.0fs)", self.stage, 100 * self.done // self.total,
                     _size(self.done, self.unit), _size(self.total, self.unit), elapsed, eta)
            while self._next_log <= self.done / self.total:
                self._next_log += 0.25

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()


def _size(value: float, unit: str) -> str:
    if unit != "B":
        return f"{value:.0f}"
    for suffix in ("B", "KB", "MB", "GB"):
        if value < 1024 or suffix == "GB":
            return f"{value:.1f} {suffix}"
        value /= 1024
    return f"{value:.1f} GB"
