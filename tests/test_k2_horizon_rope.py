"""K2-Horizon's RoPE base: every key that states it is read, and conflicting keys are refused.

Keys: top-level ``rope_theta``, ``rope_parameters.rope_theta`` and the legacy ``rope_scaling``.
Whenever the export accepts a config, the family's own configuration class (the remote code,
loaded the way transformers loads config.json) must end up with the same base.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.errors import InputError
from llmexport.models.k2_horizon.args import DEFAULT_ROPE_THETA, parse_args
from llmexport.reference.k2_horizon.configuration_k2_horizon import K2HorizonConfig
from llmexport.tiny.k2_horizon import variant_config

WHERE = "/models/k2/config.json"


def _config(**rope) -> dict:
    cfg = variant_config("dense")
    cfg.pop("rope_parameters")
    cfg.update({k: v for k, v in rope.items() if v is not None})
    return cfg


def _reference_theta(cfg: dict) -> float:
    return float(K2HorizonConfig.from_dict(dict(cfg)).rope_parameters["rope_theta"])


@pytest.mark.parametrize("rope, theta", [
    (dict(), DEFAULT_ROPE_THETA),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), 5e5),
    (dict(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 5e5}), 5e5),
    (dict(rope_theta=DEFAULT_ROPE_THETA), DEFAULT_ROPE_THETA),
    (dict(rope_theta=2e6, rope_parameters={"rope_type": "default"}), 2e6),  # transformers fills it in
    (dict(rope_scaling={"type": "default", "rope_theta": 3e5}), 3e5),
    (dict(rope_theta=3e5, rope_scaling={"rope_type": "default", "rope_theta": 3e5}), 3e5),
])
def test_rope_base_is_the_one_the_family_code_uses(rope, theta):
    cfg = _config(**rope)
    assert parse_args(cfg, WHERE).rope_theta == theta == _reference_theta(cfg)


@pytest.mark.parametrize("rope, needle", [
    (dict(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
     "'rope_theta' = 500000.0, 'rope_parameters.rope_theta' = 10000000.0"),
    (dict(rope_theta=5e5), "'rope_theta' = 500000.0 but 'rope_parameters' states no 'rope_theta'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
          rope_scaling={"rope_type": "default", "rope_theta": 2e6}), "'rope_scaling.rope_theta' = 2000000.0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"rope_type": "default"}),
     "'rope_scaling' needs 'rope_theta'"),
    (dict(rope_parameters={"rope_type": "default"}), "'rope_parameters' needs 'rope_theta'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type 'linear' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type 'yarn' is not supported"),
    (dict(rope_parameters=[1e6]), "'rope_parameters' must be an object"),
    (dict(rope_theta="1e6", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
     "'rope_theta' must be a number in"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}),
     "'rope_parameters.rope_theta' must be a number in"),
])
def test_conflicting_or_unsupported_rope_keys_are_refused(rope, needle):
    with pytest.raises(InputError, match="^" + WHERE) as info:
        parse_args(_config(**rope), WHERE)
    assert needle in str(info.value)


THETAS = st.sampled_from([1e4, 5e5, 1e6, DEFAULT_ROPE_THETA])
BLOCK = st.one_of(st.none(), st.fixed_dictionaries({"rope_type": st.just("default")},
                                                   optional={"rope_theta": THETAS}))


@settings(max_examples=150, deadline=None)
@given(top=st.one_of(st.none(), THETAS), parameters=BLOCK, scaling=BLOCK)
def test_accepted_configs_agree_with_the_family_code_and_conflicts_are_refused(top, parameters, scaling):
    cfg = _config(rope_theta=top, rope_parameters=parameters, rope_scaling=scaling)
    stated = [v for v in (top, (parameters or {}).get("rope_theta"), (scaling or {}).get("rope_theta"))
              if v is not None]
    try:
        theta = parse_args(cfg, WHERE).rope_theta
    except InputError as exc:
        assert str(exc).startswith(WHERE)
        return
    assert len(set(stated)) <= 1  # never accepts keys that disagree
    assert theta == (stated[0] if stated else DEFAULT_ROPE_THETA) == _reference_theta(cfg)
