"""llmexport: HuggingFace LLM checkpoints -> MNN, verified against transformers.

    import llmexport
    llmexport.export("path/to/hf", "out/", llmexport.ExportOptions())
    llmexport.verify("out/", "path/to/hf")
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["export", "plan", "verify", "ExportOptions", "RuntimeProfile", "__version__"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for `llmexport --help`) must not import torch.
    if name in ("export", "plan", "verify"):
        from llmexport import api

        return getattr(api, name)
    if name in ("ExportOptions", "RuntimeProfile"):
        from llmexport import options

        return getattr(options, name)
    raise AttributeError(name)
