"""What an output target is: the files one ``--export`` format writes from a loaded architecture.

The pipeline (llmexport/pipeline.py) opens the checkpoint, decides every scheme
(llmexport/planning/schemes.py), plans, and then hands one ``ExportJob`` to the target of the options'
format (llmexport/targets/__init__.py). A target owns everything about its files: the input
checks its format needs (``prepare``, before any heavy work), the bytes each linear and table
takes there and the export's peak memory (``record_bytes``, ``table_bytes``,
``export_peak_bytes``: the plan and ``--dry-run`` ask these) and the
writing itself, stage by stage (``write``). ``verifiable``: whether ``--verify`` can run what it
wrote in a runtime.
"""

from __future__ import annotations

import abc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llmexport.errors import OutputError, ResourceError
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.planning.digests import FileDigests
from llmexport.planning.schemes import Schemes
from llmexport.quant.scheme import QuantScheme
from llmexport.results import ExportPlan
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import LinearSpec

log = logging.getLogger(__name__)
#: tokens of the example input every graph is traced with (its sequence axis stays dynamic)
TRACE_SEQ_LEN = 3


@contextmanager
def stage(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time a stage; an OSError inside a writing stage is the destination failing, and memory
    running out is a resource error that names the stage."""
    start = time.perf_counter()
    log.info("stage %s ...", name)
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{name}: writing the export failed ({exc.strerror or exc})") from None
    except (MemoryError, RuntimeError) as exc:
        out_of_memory = ResourceError.out_of_memory(exc, f"during the {name} stage")
        if out_of_memory is None:
            raise
        raise out_of_memory from None
    finally:
        timings[name] = round(time.perf_counter() - start, 3)


@dataclass
class ExportJob:
    """One export as a target receives it: what to write, how, where, and its stage timings."""

    arch: Architecture
    graph: Any  # the rewritten text graph (torch module with placeholder linears)
    options: ExportOptions
    schemes: Schemes
    out: Path
    prepared: Any = None  # what ``prepare`` returned
    timings: dict[str, float] = field(default_factory=dict)
    #: the sha256 of the large files, taken while they are written (manifest.json)
    digests: FileDigests = field(default_factory=FileDigests)

    def stage(self, name: str):
        return stage(self.timings, name)


class OutputTarget(abc.ABC):
    """One ``--export`` format."""

    #: whether ``--verify`` runs this format's files (in MNN's runtime)
    verifiable: bool = False

    def prepare(self, checkpoint: Checkpoint, arch: Architecture, options: ExportOptions) -> Any:
        """Check (and convert in memory) what this format needs from the input before any heavy
        stage; input errors only, never output errors. Returns what ``write`` gets as ``job.prepared``."""
        return None

    @abc.abstractmethod
    def record_bytes(self, spec: LinearSpec, scheme: QuantScheme) -> int:
        """The bytes one linear takes in this format's weight file."""

    @abc.abstractmethod
    def export_peak_bytes(self, arch: Architecture, plan: ExportPlan) -> int:
        """The export's expected peak resident memory (llmexport.planning.memory_plan has the calibration)."""

    def table_bytes(self, rows: int, dim: int, bits: int, block: int) -> int:
        """The bytes of a token table written to its own file (0: this format writes none)."""
        return 0

    @abc.abstractmethod
    def write(self, job: ExportJob) -> None:
        """Write every file of the export into ``job.out`` (an empty staging folder)."""
