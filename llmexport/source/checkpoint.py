"""A HuggingFace checkpoint folder: config, tokenizer files and a lazy safetensors index.

Tensors are never loaded up front. Each safetensors header is parsed and checked when the
folder is opened (dtypes, shapes, and byte ranges that tile the data section exactly, as the
format requires); a tensor's bytes are read only when asked for, so a 30 GB checkpoint costs a
few MB to open. Shards named by an index must lie inside the folder, and the index and the
shards' headers must list the same tensors.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from llmexport.errors import InputError
from llmexport.source.input_files import CONFIG_LIMIT, INDEX_LIMIT, TOKENIZER_LIMIT, read_json, read_optional_json
from llmexport.source.safetensors_file import LazyTensor, TensorEntry, parse_header
from llmexport.spec import WeightStore

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsIndex:
    """Lazy name -> tensor access over one or many safetensors files."""

    def __init__(self, entries: dict[str, TensorEntry], folder: Path | None = None):
        self._entries = entries
        self.folder = folder  # named in messages about its tensors

    @classmethod
    def open(cls, folder: Path) -> "SafetensorsIndex":
        index_file = folder / INDEX_FILE
        if os.path.lexists(index_file):
            return cls._open_indexed(index_file)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{folder}: no *.safetensors weight files found")
        entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in parse_header(file).items():
                if name in entries:
                    raise InputError(f"{file}: tensor {name!r} is also in {entries[name].file.name}")
                entries[name] = entry
        return cls(entries, folder)

    @classmethod
    def of_file(cls, file: Path) -> "SafetensorsIndex":
        """The tensors of one safetensors file (a LoRA adapter's ``adapter_model.safetensors``)."""
        return cls(parse_header(file), file.parent)

    @classmethod
    def _open_indexed(cls, index_file: Path) -> "SafetensorsIndex":
        """Shards named by the index, which must list exactly the tensors their headers hold."""
        weight_map = _weight_map(index_file)
        entries: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())):
            file = index_file.parent / shard
            if not os.path.lexists(file):
                raise InputError(f"{file}: weight file named in {index_file.name} is missing")
            for name, entry in parse_header(file).items():
                if weight_map.get(name) != shard:
                    where = f"lists it in {weight_map[name]!r}" if name in weight_map else "does not list it"
                    raise InputError(f"{file}: holds tensor {name!r} but {index_file.name} {where}")
                entries[name] = entry
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise InputError(f"{index_file}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}"
                             + (f" ({len(missing)} such tensors)" if len(missing) > 1 else ""))
        return cls(entries, index_file.parent)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"checkpoint has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def lazy(self, name: str) -> "LazyTensor":
        return LazyTensor(self.entry(name), name)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor as stored (dtype kept), read into fresh memory."""
        return self.lazy(name).read()


class CheckpointTensors:
    """A checkpoint's tensors as the HF reference holds them (``ReferenceTensors``): floats widened
    to fp32 (what ``from_pretrained(dtype=torch.float32)`` loads), read when asked for."""

    def __init__(self, weights: WeightStore):
        self.weights = weights

    def names(self) -> list[str]:
        return self.weights.names()

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights.shape(name))

    def read(self, name: str) -> torch.Tensor:
        return _widened(self.weights.tensor(name))

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return _widened(self.weights.lazy(name).take(ids))


def _widened(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.is_floating_point() else value


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no values);
    buffers are built as usual (rotary frequencies and other computed constants keep their values)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=False)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_from_config(loader: Any, config: Any, **kwargs: Any) -> torch.nn.Module:
    """``loader``'s model for ``config``: an Auto class through ``from_config``, a model class
    through ``_from_config`` (which takes no ``trust_remote_code``)."""
    if not hasattr(loader, "from_config"):
        kwargs.pop("trust_remote_code", None)
    return (loader.from_config if hasattr(loader, "from_config") else loader._from_config)(config, **kwargs)


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor -> shard map; every shard is a plain file name or a relative path that
    stays inside the checkpoint folder (no absolute paths, no ``..``)."""
    index = read_json(index_file, INDEX_LIMIT, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise InputError(f"{index_file}: malformed safetensors index ('weight_map' must map tensor names "
                         "to shard file names)")
    if not weight_map:
        raise InputError(f"{index_file}: 'weight_map' lists no tensors")
    for shard in set(weight_map.values()):
        parts = Path(shard).parts
        if (not shard or Path(shard).is_absolute() or ".." in parts or "\\" in shard or "\x00" in shard
                or not shard.endswith(".safetensors")):
            raise InputError(f"{index_file}: shard {shard!r} is not a *.safetensors file inside the "
                             "checkpoint folder")
    return weight_map


@dataclass
class Checkpoint:
    """An opened HF folder."""

    path: Path
    config: dict[str, Any]
    weights: WeightStore  # a SafetensorsIndex, or an importer's view (llmexport.source.importers)

    @classmethod
    def open(cls, path: Path | str) -> "Checkpoint":
        folder = Path(path)
        if not folder.exists():
            raise InputError(f"{folder}: model path does not exist")
        if not folder.is_dir():
            raise InputError(f"{folder}: model path is not a folder")
        config = read_config(folder)
        return cls(folder, config, _gguf_weights(folder, config) or SafetensorsIndex.open(folder))

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def from_pretrained(self, loader: Any, **kwargs: Any) -> Any:
        """``loader.from_pretrained`` on this folder, from the same safetensors the export reads
        (never a ``pytorch_model.bin`` pickle beside them). An MLX checkpoint builds the HF model
        from its config and dequantized tensors instead (llmexport.source.importers.mlx)."""
        return loader.from_pretrained(self.path, use_safetensors=True, **kwargs)

    def hf_config(self, trust_remote_code: bool = False) -> Any:
        """transformers' config object of this checkpoint."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)

    def empty_model(self, loader: Any, **kwargs: Any) -> torch.nn.Module:
        """``loader``'s model of this checkpoint with every parameter on the meta device, ties
        made and in eval mode: the skeleton the streamed reference fills one block at a time."""
        config = self.hf_config(bool(kwargs.get("trust_remote_code", False)))
        with meta_parameters():
            model: Any = build_from_config(loader, config, **kwargs)
        model.tie_weights()
        return model.eval()

    def tokenizer_file(self) -> Path:
        path = self.path / "tokenizer.json"
        if not os.path.lexists(path):
            raise InputError(f"{self.path}: no tokenizer.json (a HF fast tokenizer is required)")
        return path

    def check_tokenizer_side_files(self) -> None:
        """The small JSON files HF's tokenizer loader reads beside ``tokenizer.json`` must parse
        (an error names the file) before any heavy stage runs."""
        for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                     "added_tokens.json"):
            read_optional_json(self.path / name, TOKENIZER_LIMIT, "tokenizer file")


def _gguf_weights(folder: Path, config: dict[str, Any]) -> WeightStore | None:
    """The tensors of the GGUF file a materialized GGUF folder links to (llmexport.source.importers.gguf)."""
    from llmexport.source.importers.gguf import GGUF_LINK, open_weights

    link = folder / GGUF_LINK
    return open_weights(link.resolve(), config) if os.path.lexists(link) else None  # errors name the file itself


def read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not os.path.lexists(config_file):
        raise InputError(f"{config_file}: missing (expected a HF config.json)")
    config = read_json(config_file, CONFIG_LIMIT, "config")
    if not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_file}: no 'model_type' string")
    return config
