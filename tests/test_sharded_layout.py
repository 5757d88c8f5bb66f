"""Where the model's arrays live (`model.sharding`), on 8 simulated CPU devices: params and Adam
moments are made sharded, each device holding its share, with the values one device makes; the
hero's params, laid out abstractly on (1, 4, 2), carry the shardings written out below by hand,
and nothing is allocated."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from goldens.tolerances import BITWISE
from model import config as c
from model.layout import make_mesh
from model.state import abstract_init, init_train_state, make_model
from tests.compare import assert_close


def _two_blocks() -> c.Config:
    """The micro config cut to its first KDA block (dense) and one attention block (MoE)."""
    cfg = c.olmo_core(c.micro())
    model = dataclasses.replace(
        cfg.model, n_layers=2, layer_types=c.hybrid_layer_types(2, attention_every=2)
    )
    return dataclasses.replace(cfg, model=model)


def _spec_shards(spec: P, mesh) -> int:
    axes = [a for dim in spec if dim is not None for a in ((dim,) if isinstance(dim, str) else dim)]
    return int(np.prod([mesh.shape[a] for a in axes]))


def test_params_and_moments_are_made_sharded_each_device_its_share():
    cfg = _two_blocks()
    mesh = make_mesh(fsdp=4, expert=2)
    _, state = init_train_state(cfg, mesh)
    made_whole = nnx.state(make_model(cfg))
    assert_close("init", expected=made_whole, actual=state.params, tol=BITWISE)
    mu, nu = state.opt_state.adam[0].mu, state.opt_state.adam[0].nu
    for name, tree in (("params", state.params), ("exp_avg", mu), ("exp_avg_sq", nu)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            label = f"{name}{jax.tree_util.keystr(path)}"
            shards = _spec_shards(leaf.sharding.spec, mesh)
            assert shards >= (4 if any(n % 4 == 0 for n in leaf.shape) else 1), label
            held = {s.data.nbytes for s in leaf.addressable_shards}
            assert held == {leaf.nbytes // shards}, (label, held, leaf.nbytes, shards)


HERO_SPECS = {
    "embeddings": P(None, "fsdp"),
    "weight": P("fsdp"),  # every norm gain, the router's flat weight, KDA's A_log
    "kernel": P("fsdp", None),  # every linear layer, the LM head included
    "bias": P("fsdp"),
    "dt_bias": P("fsdp"),
    "o_norm": P("fsdp"),
    "ssmax_scale": P("fsdp"),
    "A_log": P("fsdp"),
    "q_norm.weight": P("fsdp", None),
    "k_norm.weight": P("fsdp", None),
    "conv1d.weight": P("fsdp", None),
    "shared.w_up_gate": P("fsdp", None),
    "shared.w_down": P(None, "fsdp", None),
    "routed.w_up_gate": P("expert", "fsdp", None),
    "routed.w_down": P("expert", "fsdp", None),
}
"""The hero's params on (data 1, fsdp 4, expert 2), written out by hand: every weight split over
fsdp along its first dimension that is not the experts' (nor a shared expert's leading 1), routed
experts over "expert"."""


def _hero_spec(path: tuple[str, ...]) -> P:
    *_, owner, name = ("", *path)
    if name in ("w_up_gate", "w_down"):
        return HERO_SPECS[f"{'routed' if owner == 'routed_experts' else 'shared'}.{name}"]
    if owner in ("q_norm", "k_norm"):
        return HERO_SPECS[f"{owner}.{name}"]
    if owner.endswith("conv1d"):
        return HERO_SPECS[f"conv1d.{name}"]
    return HERO_SPECS[name]


def test_the_heros_params_laid_out_abstractly_as_the_rules_say():
    cfg = c.olmo35_tiny()
    live = len(jax.live_arrays())
    params = abstract_init(cfg, make_mesh(fsdp=4, expert=2))
    assert len(jax.live_arrays()) == live
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert sum(leaf.size for _, leaf in leaves) == cfg.model.num_params() == 12_496_341_632
    for path, leaf in leaves:
        assert isinstance(leaf, jax.ShapeDtypeStruct)
        names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        assert leaf.sharding.spec == _hero_spec(names), (names, leaf.sharding.spec)


def test_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match="needs 16 devices, 8 exist"):
        make_mesh(data=4, fsdp=4)
