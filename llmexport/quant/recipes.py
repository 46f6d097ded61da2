"""Per-module quantization: ordered rules mapping linear names or roles to a QuantScheme.

A rule matches a linear by glob pattern on its name (the HF module name, e.g.
``model.language_model.layers.3.mlp.down_proj``) or by role (``role:mlp``, ``role:attention``,
``role:expert``, ``role:router``, ``role:ple``, ``role:lm_head``); the first matching rule wins,
otherwise the default scheme applies.

Routers (role ``router``: the gates that choose experts) stay fp16 in every recipe and under the
default scheme: quantization error in a router moves which experts are chosen, not only how much
they weigh (the published K2-Horizon-3.7B-4bit mix keeps its routers in floats). Only a rule that
names them explicitly quantizes them: ``role:router``, or a name pattern whose last component is
spelled out (``*.mlp.gate``, ``*.router.proj``, ``model.layers.3.self_attn.v_router``). A broad
pattern such as ``*`` or ``*.self_attn.*`` does not reach a router. Even then a router is never
stored below 8 bits.

``--quant_config FILE`` (JSON)::

    {"default": {"bits": 4, "block": 64},
     "rules": [{"match": "role:mlp", "bits": 4, "block": 32},
               {"match": "*.self_attn.*", "bits": 8, "block": 64, "sym": false, "method": "rtn"}],
     "embed_bit": 8}

Built-in recipes: ``uniform`` (the default scheme everywhere but routers) and ``mlp4-attn8`` (MLP
and expert weights 4-bit block 32; attention, PLE projections and lm_head 8-bit block 64; routers
fp16; embedding tables 8-bit).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmexport.quant.scheme import FP16_BITS, QuantMethod, QuantScheme
from llmexport.spec import LinearRole, LinearSpec

ROUTER_MIN_BITS = 8  # when a rule names routers explicitly
_WILDCARDS = frozenset("*?[")
_FIELDS = {"bits", "block", "sym", "method"}


@dataclass(frozen=True)
class QuantRule:
    match: str
    scheme: QuantScheme

    def matches(self, spec: LinearSpec) -> bool:
        if self.match.startswith("role:"):
            return spec.role.value == self.match[5:]
        if spec.role is LinearRole.ROUTER and _WILDCARDS & set(self.match.rsplit(".", 1)[-1]):
            return False  # a router is only quantized by a rule that names it (module docstring)
        return fnmatch.fnmatchcase(spec.name, self.match)


@dataclass(frozen=True)
class QuantPlan:
    """The default scheme, ordered rules and the embedding-table width a recipe asks for."""

    default: QuantScheme
    rules: tuple[QuantRule, ...] = ()
    embed_bit: int | None = None

    def scheme_for(self, spec: LinearSpec) -> QuantScheme:
        rule = next((rule for rule in self.rules if rule.matches(spec)), None)
        if spec.role is not LinearRole.ROUTER:
            return self.default if rule is None else rule.scheme
        if rule is None:
            return QuantScheme(FP16_BITS)
        if not rule.scheme.is_fp16 and rule.scheme.bits < ROUTER_MIN_BITS:
            return replace(rule.scheme, bits=ROUTER_MIN_BITS)
        return rule.scheme


def _scheme(entry: dict[str, Any], base: QuantScheme, where: str) -> QuantScheme:
    unknown = set(entry) - _FIELDS - {"match"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)} (expected {sorted(_FIELDS)})")
    methods = [m.value for m in QuantMethod if m is not QuantMethod.STORED]
    method = entry.get("method", base.method.value)
    if method not in methods:
        raise ValueError(f"{where}: method must be one of {methods}")
    method = QuantMethod(method)
    scheme = QuantScheme(bits=int(entry.get("bits", base.bits)), block=int(entry.get("block", base.block)),
                         sym=bool(entry.get("sym", base.sym)), method=method)
    try:
        return scheme.validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def recipe(name: str, default: QuantScheme) -> QuantPlan:
    """A built-in recipe applied on top of the command line's default scheme."""
    if name == "uniform":
        return QuantPlan(default)
    if name == "mlp4-attn8":
        four = replace(default, bits=4, block=32)
        eight = replace(default, bits=8, block=64)
        rules = (QuantRule("role:mlp", four), QuantRule("role:expert", four))
        return QuantPlan(eight, rules, embed_bit=8)
    raise ValueError(f"unknown recipe {name!r} (available: {', '.join(RECIPES)})")


RECIPES = ("uniform", "mlp4-attn8")


def load_quant_config(path: Path, default: QuantScheme) -> QuantPlan:
    """Parse a --quant_config JSON file (see the module docstring); ValueError names the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rules", []), list):
        raise ValueError(f"{path}: expected an object with 'default', 'rules' (a list) and 'embed_bit'")
    unknown = set(data) - {"default", "rules", "embed_bit"}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}")
    base = _scheme(data.get("default", {}), default, f"{path}: default")
    rules = []
    for i, entry in enumerate(data.get("rules", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
            raise ValueError(f"{path}: rules[{i}] needs a 'match' string (a glob or role:NAME)")
        role = entry["match"][5:] if entry["match"].startswith("role:") else None
        if role is not None and role not in {r.value for r in LinearRole}:
            raise ValueError(f"{path}: rules[{i}]: unknown role {role!r} "
                             f"(roles: {', '.join(r.value for r in LinearRole)})")
        rules.append(QuantRule(entry["match"], _scheme(entry, base, f"{path}: rules[{i}]")))
    embed_bit = data.get("embed_bit")
    return QuantPlan(base, tuple(rules), None if embed_bit is None else int(embed_bit))
