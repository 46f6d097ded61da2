"""A family's checkpoint tensor names, declared once in a table (as llama.cpp's ``TensorNameMap``).

A ``NameTable`` maps a key (what a tensor is for: ``"attn.q"``, ``"norm.input"``, ``"embed"``)
to the pattern of its checkpoint name, with ``{layer}`` and ``{expert}`` fields and family fields
bound once (Gemma4's ``{prefix}``). A placeholder linear is named by its HF module path (the
name that ties a graph node to its weights); its tensors are ``weight_name``/``bias_name`` of that
path, or a row of the tensor the table says it is ``stacked`` in. Norms, graph constants and
tables are named by their tensor. Everything that names a tensor reads the table: the linears
a family lists (``LinearList``) and the graph that carries them, the graph constants and
tables, the expected-tensor check and its messages, the expert templates, the reference's slots
and the MLX layouts. A name is formatted by ``NameTable.name`` and parsed back by ``match``;
``rename_rule`` turns two patterns into the MLX importer's rule.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Iterable, Mapping

from llmexport.spec import LinearRole, LinearSource, LinearSpec, MlxRule

#: the fields a pattern may leave open (integers); any other field is bound with ``bind``
INDEX_FIELDS = ("layer", "expert")


def weight_name(linear: str) -> str:
    """The weight of a linear module (HF's ``nn.Linear``): ``{module}.weight``; also of a pattern."""
    return linear + ".weight"


def bias_name(linear: str) -> str:
    """The bias of a linear module: ``{module}.bias``."""
    return linear + ".bias"


@dataclass(frozen=True)
class NameTable:
    """key -> checkpoint name pattern; ``stacked``: linear key -> the key of the tensor that holds
    it with its sibling experts along the first axis (row ``{expert}``); ``transposed``: the
    stacked linear keys whose rows are stored [in, out]; ``bound``: fields filled in for every
    name (``bind``)."""

    patterns: Mapping[str, str]
    stacked: Mapping[str, str] = field(default_factory=dict)
    bound: Mapping[str, object] = field(default_factory=dict)
    transposed: AbstractSet[str] = frozenset()

    def pattern(self, key: str) -> str:
        """``key``'s pattern with the bound fields filled in and the others left open."""
        return self._raw(key).format(**{**{f: "{" + f + "}" for f in INDEX_FIELDS}, **self.bound})

    def name(self, key: str, **fields: int) -> str:
        """The checkpoint name of ``key`` at ``fields`` (``layer=3``, ``expert=0``)."""
        return self._raw(key).format(**self.bound, **fields)

    def names(self, keys: Iterable[str], **fields: int) -> tuple[str, ...]:
        return tuple(self.name(key, **fields) for key in keys)

    def bind(self, **fields: object) -> NameTable:
        """The same table with ``fields`` filled in (``prefix=...``, or ``layer=i`` for one layer's names)."""
        return replace(self, bound={**self.bound, **fields})

    def extended(self, patterns: Mapping[str, str], stacked: Mapping[str, str] | None = None) -> NameTable:
        """This table plus (or with replaced) ``patterns``: a family that differs from a shared layout."""
        return replace(self, patterns={**self.patterns, **patterns}, stacked={**self.stacked, **(stacked or {})})

    def with_transposed(self, keys: Iterable[str]) -> NameTable:
        """The same table with the stacked linears ``keys`` stored [in, out] (and no others)."""
        return replace(self, transposed=frozenset(keys))

    def moved(self, old: str, new: str) -> NameTable:
        """This table with every pattern that starts with ``old`` starting with ``new`` instead (a
        decoder's layout nested in a multimodal checkpoint)."""
        return replace(self, patterns={key: new + pattern[len(old):] if pattern.startswith(old) else pattern
                                       for key, pattern in self.patterns.items()})

    def source(self, key: str, bias: bool = False, **fields: int) -> LinearSource:
        """The checkpoint tensors behind linear ``key``: its module's weight (and bias), or its
        row of the tensor it is stacked in."""
        stacked = self.stacked.get(key)
        if stacked is not None:
            if bias:
                raise ValueError(f"stacked linear {key!r} with a bias")
            return LinearSource(self.name(stacked, **fields), fields["expert"], None, key in self.transposed)
        module = self.name(key, **fields)
        return LinearSource(weight_name(module), None, bias_name(module) if bias else None)

    def template(self, key: str, module: str, marker: str) -> str:
        """Linear ``key``'s name inside an expert template: the path of the expert ``module`` (which
        each instance of the template puts back) replaced by ``marker``."""
        inner, outer = self.pattern(key), self.pattern(module)
        if not inner.startswith(outer):
            raise ValueError(f"{key!r} ({inner}) does not lie inside {module!r} ({outer})")
        return marker + inner[len(outer):]

    def _raw(self, key: str) -> str:
        try:
            return self.patterns[key]
        except KeyError:
            raise KeyError(f"the name table has no tensor {key!r}") from None


class LinearList:
    """The placeholder linears a family lists, in order, each with the checkpoint tensors behind it;
    both come from the name table."""

    def __init__(self, names: NameTable):
        self.names = names
        self.specs: list[LinearSpec] = []
        self.sources: dict[str, LinearSource] = {}

    def add(self, key: str, in_features: int, out_features: int, role: LinearRole, bias: bool = False,
            source: LinearSource | None = None, **fields: int) -> None:
        """Linear ``key`` at ``fields``; ``source``: other tensors than the table's (a tied head)."""
        name = self.names.name(key, **fields)
        self.specs.append(LinearSpec(name, in_features, out_features, role, bias))
        self.sources[name] = source if source is not None else self.names.source(key, bias, **fields)

    def add_group(self, keys: Iterable[str], shapes: Iterable[tuple[int, int]], role: LinearRole,
                  **fields: int) -> None:
        """Several linears of one role, ``shapes`` (in, out) in ``keys`` order."""
        for key, (in_features, out_features) in zip(keys, shapes, strict=True):
            self.add(key, in_features, out_features, role, False, None, **fields)

    def source(self, name: str, owner: str) -> LinearSource:
        try:
            return self.sources[name]
        except KeyError:
            raise KeyError(f"{owner} has no placeholder linear {name!r}") from None


# --- patterns as regular expressions ------------------------------------------------------------
def regex(pattern: str) -> str:
    """An open ``pattern`` as an anchored regular expression, one group per field (digits)."""
    out, seen = ["^"], set()
    for literal, name, _, _ in string.Formatter().parse(pattern):
        out.append(re.escape(literal))
        if name is not None:
            out.append(f"(?P={name})" if name in seen else rf"(?P<{name}>\d+)")
            seen.add(name)
    return "".join(out) + "$"


def match(pattern: str, name: str) -> dict[str, int] | None:
    """The fields of ``name`` when it has the open ``pattern``'s form, else None."""
    found = re.match(regex(pattern), name)
    return None if found is None else {k: int(v) for k, v in found.groupdict().items()}


def _replacement(pattern: str, literal: Mapping[str, str]) -> str:
    out = []
    for text, name, _, _ in string.Formatter().parse(pattern):
        out.append(text.replace("\\", "\\\\"))
        if name is not None:
            out.append(literal.get(name, rf"\g<{name}>"))
    return "".join(out)


def rename_rule(source: str, target: str, split: str | None = None, part: tuple[int, int] = (0, 1), *,
                transpose: bool = False, offset: float = 0.0) -> MlxRule:
    """The MLX importer's rule from names of the open pattern ``source`` to ``target`` (same
    fields); ``split``: the field ``source`` stacks along its first axis (one ``target`` per value);
    ``part``: which of the row blocks of ``target`` it is; ``transpose``/``offset``: how a float
    tensor's stored value differs from HF's (``MlxRule``)."""
    literal = {split: "{e}"} if split else {}  # the importer fills in each expert for "{e}"
    return MlxRule(regex(source), _replacement(target, literal), split is not None, part, transpose, offset)


def prefix_rule(source: str, target: str) -> MlxRule:
    """Every name under the prefix ``source`` keeps its path, under ``target``."""
    return MlxRule(rf"^{re.escape(source)}(.*)$", target.replace("\\", "\\\\") + r"\1")
