"""The whole-model weight map: an OLMo-core `OLMoDDPModel` state dict (OLMo-core's own keys and
shapes, from goldens.olmo_core_model) -> `Transformer` -> state dict is bit-exact; unknown, missing
and mis-shaped keys are errors naming the key."""

import numpy as np
import pytest

from model.config import micro
from model.convert import from_olmo_core, model_entries, to_olmo_core

CFG = micro().model


@pytest.fixture(scope="module")
def olmo_core_state_dict():
    """OLMo-core's micro model, every tensor replaced by distinct random values."""
    from goldens.olmo_core_model import build

    rng = np.random.default_rng(0)
    return {
        k: rng.standard_normal(tuple(v.shape)).astype(np.float32)
        for k, v in build(CFG).state_dict().items()
    }


def test_round_trip_is_bit_exact(olmo_core_state_dict):
    back = to_olmo_core(from_olmo_core(olmo_core_state_dict, CFG))
    assert back.keys() == olmo_core_state_dict.keys()
    for key, value in olmo_core_state_dict.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_table_covers_olmo_core_keys_once(olmo_core_state_dict):
    keys = [e.torch_key for e in model_entries(CFG)]
    assert len(keys) == len(set(keys)) and set(keys) == set(olmo_core_state_dict)


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(
    ("change", "error", "named"),
    [
        (
            lambda d: {**d, "blocks.8.attention.w_q.weight": d["embeddings.weight"]},
            KeyError,
            "blocks.8.attention.w_q.weight",
        ),
        (
            lambda d: _without(d, "blocks.3.routed_experts.w_down"),
            KeyError,
            "blocks.3.routed_experts.w_down",
        ),
        (
            lambda d: {
                **d,
                "blocks.7.attention.q_norm.weight": d["blocks.7.attention.q_norm.weight"].T,
            },
            ValueError,
            "blocks.7.attention.q_norm.weight",
        ),
    ],
    ids=["unknown", "missing", "mis-shaped"],
)
def test_bad_state_dict_names_the_key(olmo_core_state_dict, change, error, named):
    with pytest.raises(error, match=named.replace(".", r"\.")):
        from_olmo_core(change(olmo_core_state_dict), CFG)
