"""The whole-model weight map: an OLMo-core `OLMoDDPModel` state dict (OLMo-core's own keys and
shapes, from goldens.runtime.models) -> `Transformer` -> state dict is bit-exact; unknown, missing
and mis-shaped keys are errors naming the key."""

import numpy as np
import pytest
from flax import nnx

from model.config import micro
from model.convert import (
    from_olmo_core,
    like_params,
    model_entries,
    params_to_olmo_core,
    to_olmo_core,
)

CFG = micro().model


@pytest.fixture(scope="module")
def olmo_core_state_dict():
    """OLMo-core's micro model, every tensor replaced by distinct random values."""
    from goldens.runtime.models import build

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


def test_each_model_holds_its_own_weights(olmo_core_state_dict):
    """Models built one after another (from one abstract module, traced once) share no
    variable: loading the second leaves the first's weights."""
    negated = {k: -v for k, v in olmo_core_state_dict.items()}
    first = from_olmo_core(olmo_core_state_dict, CFG)
    second = from_olmo_core(negated, CFG)
    for model, expected in ((first, olmo_core_state_dict), (second, negated)):
        back = to_olmo_core(model)
        for key, value in expected.items():
            np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_tensors_like_the_params_round_trip_and_leave_the_params(olmo_core_state_dict):
    """`like_params` (Adam moments, gradients keyed as the state dict) gives a new state in the
    params' layout: back through `params_to_olmo_core` bit-exact, the params unchanged."""
    _, params = nnx.split(from_olmo_core(olmo_core_state_dict, CFG))
    doubled = {k: 2 * v for k, v in olmo_core_state_dict.items()}
    like = like_params(doubled, params, model_entries(CFG))
    for state, expected in ((like, doubled), (params, olmo_core_state_dict)):
        back = params_to_olmo_core(state, model_entries(CFG))
        for key, value in expected.items():
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


def _pooled(state_dict) -> dict[str, np.ndarray]:
    """All values of each parameter kind (the key without its block index), flattened."""
    pools: dict[str, list] = {}
    for key, value in state_dict.items():
        kind = ".".join(p for p in key.split(".") if not p.isdigit())
        pools.setdefault(kind, []).append(np.asarray(value, np.float64).ravel())
    return {k: np.concatenate(v) for k, v in pools.items()}


LARGE_POOL = 1000
"""Values of a parameter kind enough to compare moments (std within 10% at 1000 samples)."""


def test_init_is_in_olmo_core_distribution():
    """Our random init, in OLMo-core's layout, against OLMo-core's own init of the micro model
    ("normal", std 0.02 truncated at 3 std), pooled per parameter kind: constants equal, large
    pools with the same mean and std (10%) and no value beyond OLMo-core's largest by 10%, small
    pools inside OLMo-core's range padded by half its spread."""
    from flax import nnx

    from goldens.runtime.models import build
    from model.transformer import Transformer

    model = Transformer(
        CFG, ignore_segment_ids=True, kda_inverse="forward_substitution", rngs=nnx.Rngs(0)
    )
    ours = _pooled(to_olmo_core(model))
    theirs = _pooled({k: v.detach().numpy() for k, v in build(CFG).state_dict().items()})
    assert ours.keys() == theirs.keys()
    for kind, b in theirs.items():
        a = ours[kind]
        if b.min() == b.max():
            np.testing.assert_array_equal(a, b, err_msg=kind)
        elif b.size >= LARGE_POOL:
            assert abs(a.std() / b.std() - 1) < 0.1, kind
            assert abs(a.mean() - b.mean()) < 0.1 * b.std(), kind
            assert np.abs(a).max() <= 1.1 * np.abs(b).max(), kind
        else:
            pad = 0.5 * (b.max() - b.min())
            assert b.min() - pad <= a.min() and a.max() <= b.max() + pad, kind
