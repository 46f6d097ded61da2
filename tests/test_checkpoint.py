"""Opening checkpoints: lazy tensors and clear errors for broken safetensors and configs."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture

from helpers import rewrite_safetensors_header


@pytest.fixture()
def model(tiny_gemma4, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), path)
    return path


def test_tensors_are_read_lazily_and_exactly(model):
    from safetensors.torch import load_file

    ck = Checkpoint.open(model)
    ref = load_file(str(model / "model.safetensors"))
    for name, tensor in ref.items():
        assert torch.equal(ck.weights.tensor(name), tensor)


@pytest.mark.parametrize("mutate, needle", [
    (lambda h: h.__setitem__("lm_head.weight", {**h["lm_head.weight"], "dtype": "F8_E4M3"}), "unsupported dtype"),
    (lambda h: h.__setitem__("lm_head.weight", {**h["lm_head.weight"], "shape": [7, 3]}), "disagrees with dtype"),
    (lambda h: h.__setitem__("lm_head.weight", {**h["lm_head.weight"], "data_offsets": [0, 10 ** 12]}),
     "disagrees with dtype"),
])
def test_corrupt_header_entries(model, mutate, needle):
    rewrite_safetensors_header(model / "model.safetensors", mutate)
    with pytest.raises(InputError, match=needle):
        Checkpoint.open(model)


def test_truncated_file(model):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated"):
        Checkpoint.open(model)


def test_garbage_header(model):
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops" + b"\0" * 10)
    with pytest.raises(InputError, match="not valid JSON"):
        Checkpoint.open(model)


def test_missing_shard_named_in_index(model):
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(InputError, match="missing"):
        Checkpoint.open(model)


def test_shape_disagreeing_with_config(model):
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 80
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="config implies"):
        open_architecture(Checkpoint.open(model))


def test_unmapped_tensor_is_an_error(model):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.language_model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(InputError, match="not mapped"):
        open_architecture(Checkpoint.open(model))
