"""Typed errors. Library code raises these; only the CLI turns them into messages and exit codes.

Exit codes (documented in docs/cli.md):
  2  usage error   — an invalid flag or combination of flags
  3  input error   — the checkpoint folder is missing, malformed or unsupported
  4  verification  — the exported model disagrees with the HF reference beyond the bounds
  5  conversion    — MNN's converter or runtime failed on a graph we produced
  6  output error  — the destination cannot be written (permissions, disk full)
  7  not verified  — the export is complete and in place, but --verify could not run
                     (out of memory, the runtime crashed); verify.json says why
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
