"""llmexport: HuggingFace LLM checkpoints -> MNN, verified against transformers.

    import llmexport
    result = llmexport.export("path/to/hf", "out/", llmexport.ExportOptions())   # ExportResult
    report = llmexport.verify("out/", "path/to/hf")                               # VerifyReport
    print(report.passed, report.to_json()["oracle"]["max_abs_err"])
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["export", "plan", "verify", "ExportOptions", "RuntimeProfile", "ExportPlan", "ExportResult",
           "VerifyReport", "__version__"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for `llmexport --help`) must not import torch.
    if name in ("export", "plan", "verify"):
        from llmexport import api

        return getattr(api, name)
    if name in ("ExportOptions", "RuntimeProfile"):
        from llmexport import options

        return getattr(options, name)
    if name in ("ExportPlan", "ExportResult", "VerifyReport"):
        from llmexport import results

        return getattr(results, name)
    raise AttributeError(name)
