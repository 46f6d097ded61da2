"""K2-Horizon reference model (remote code as checkpoints ship it); see docs/k2-horizon.md.

``REMOTE_CODE_FILES`` are the files a checkpoint folder carries; ``AUTO_MAP`` is the matching
``config.json`` entry.
"""

from __future__ import annotations

from pathlib import Path

from llmexport.reference.k2_horizon.configuration_k2_horizon import K2HorizonConfig

_MODELING = ("GroupedRMSNorm", "K2HorizonForCausalLM", "K2HorizonRouter", "routed_sum")

_HERE = Path(__file__).resolve().parent
REMOTE_CODE_FILES = (_HERE / "configuration_k2_horizon.py", _HERE / "modeling_k2_horizon.py")
AUTO_MAP = {
    "AutoConfig": "configuration_k2_horizon.K2HorizonConfig",
    "AutoModelForCausalLM": "modeling_k2_horizon.K2HorizonForCausalLM",
}

__all__ = ["AUTO_MAP", "REMOTE_CODE_FILES", "GroupedRMSNorm", "K2HorizonConfig", "K2HorizonForCausalLM",
           "K2HorizonRouter", "routed_sum"]


def __getattr__(name: str):
    # The modeling module pulls in transformers' model machinery (~2.6 s): imported when first
    # asked for, not whenever the registry loads the family (every export, any family).
    if name in _MODELING:
        from llmexport.reference.k2_horizon import modeling_k2_horizon

        return getattr(modeling_k2_horizon, name)
    raise AttributeError(name)
