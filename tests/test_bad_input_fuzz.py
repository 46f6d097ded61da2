"""Property: whatever is wrong in config.json or a safetensors header, only llmexport's typed,
one-line errors come out — never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.checkpoint import Checkpoint
from llmexport.errors import LlmExportError
from llmexport.models import architecture_for

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                 st.text(max_size=6), st.lists(st.integers(-1, 4), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                                  st.integers(), max_size=2))
TEXT_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "layer_types", "per_layer_config", "num_kv_shared_layers", "rope_parameters",
             "vocab_size", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "sliding_window",
             "attention_k_eq_v", "enable_moe_block", "num_experts", "top_k_experts", "final_logit_softcapping",
             "rms_norm_eps", "tie_word_embeddings", "use_double_wide_mlp", "hidden_activation", "pad_token_id"]
HEADER_FIELDS = ["dtype", "shape", "data_offsets"]


def _run(path) -> None:
    try:
        arch = architecture_for(Checkpoint.open(path))
        arch.build_graph()
        arch.linears()
    except LlmExportError as exc:
        message = str(exc)
        assert message and "Traceback" not in message


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None, derandomize=not os.environ.get("FUZZ_EXAMPLES"), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(TEXT_KEYS + ["model_type", "text_config"]), value=JUNK, delete=st.booleans())
def test_mutated_config_gives_typed_errors(tiny_gemma4, tmp_path_factory, key, value, delete):
    path = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_gemma4("e2b"), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    target = config if key in ("model_type", "text_config") else config["text_config"]
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    (path / "config.json").write_text(json.dumps(config))
    _run(path)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None, derandomize=not os.environ.get("FUZZ_EXAMPLES"), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, 200), field=st.sampled_from(HEADER_FIELDS), value=JUNK, truncate=st.integers(0, 3))
def test_mutated_safetensors_header_gives_typed_errors(tiny_gemma4, tmp_path_factory, index, field, value, truncate):
    path = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_gemma4("31b"), path, dirs_exist_ok=True)
    file = path / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    header[names[index % len(names)]][field] = value
    raw = json.dumps(header).encode()
    body = data[8 + n:]
    body = body[: len(body) - truncate * 1000] if truncate else body
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    _run(path)
