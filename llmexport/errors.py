"""Typed errors. Library code raises these; only the CLI turns them into messages and exit codes.

Exit codes (documented in docs/cli.md):
  2  usage error   — an invalid flag or combination of flags
  3  input error   — the checkpoint folder is missing, malformed or unsupported
  4  verification  — the exported model disagrees with the HF reference beyond the bounds
                     (the export is discarded, or kept in place with --keep_failed)
  5  conversion    — MNN's converter or runtime failed on a graph we produced
  6  output error  — the destination cannot be written (permissions, disk full)
  7  not verified  — the export is complete and in place, but --verify could not run
                     (out of memory, the runtime crashed); verify.json says why
  8  resources     — the export (or --verify) would not fit in the available memory, refused
                     before any heavy stage; or memory ran out during a stage
"""

from __future__ import annotations


class LlmExportError(Exception):
    """Base class: one-line, user-facing message; ``exit_code`` for the CLI."""

    exit_code = 1


class UsageError(LlmExportError):
    exit_code = 2


class InputError(LlmExportError):
    exit_code = 3


class VerificationFailed(LlmExportError):
    exit_code = 4


class ConversionError(LlmExportError):
    exit_code = 5


class OutputError(LlmExportError):
    exit_code = 6


class NotVerified(LlmExportError):
    exit_code = 7


class ResourceError(LlmExportError):
    exit_code = 8

    #: how torch reports a failed CPU allocation (a RuntimeError, not a MemoryError)
    _TORCH_OOM = "DefaultCPUAllocator: can't allocate memory"

    @classmethod
    def out_of_memory(cls, exc: BaseException, where: str) -> "ResourceError | None":
        """``exc`` as the resource error it is when it says memory ran out (Python's or numpy's
        MemoryError, torch's CPU allocator failing), else None; ``where``: "during the ... stage"."""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if isinstance(exc, RuntimeError) and cls._TORCH_OOM in message:
            message = message[message.index(cls._TORCH_OOM):]
        elif not isinstance(exc, MemoryError):
            return None
        return cls(f"out of memory {where}" + (f": {message}" if message else ""))
