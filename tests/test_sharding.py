"""Training on a (data, fsdp, expert) mesh of 8 simulated devices equals training on one: two GA=2
steps of the small LM with rows split over data x fsdp, params and gradients fully sharded."""

import jax
import pytest

from goldens.tolerances import SAME_AS_ONE_DEVICE
from model import config as c
from model import sharding
from model import train_step as ts
from parity import small_lm
from tests.compare import assert_close


def _train(params, batch, cfg, mesh=None):
    terms = small_lm.terms_fn()
    if mesh is None:
        state = ts.init_state(params, cfg)
        step = jax.jit(lambda s, mb: ts.train_step(s, mb, cfg=cfg, terms_fn=terms))
    else:
        shardings = sharding.param_shardings(params, mesh)
        state = ts.init_state(jax.device_put(params, shardings), cfg)
        batch = jax.device_put(batch, sharding.batch_sharding(mesh))
        step = jax.jit(
            lambda s, mb: ts.train_step(s, mb, cfg=cfg, terms_fn=terms, grad_sharding=shardings)
        )
    for _ in range(2):
        state, metrics = step(state, batch)
    return state.params, {k: metrics[k] for k in ("ce", "z_loss", "grad_norm")}


@pytest.mark.parametrize(("data", "fsdp"), [(8, 1), (2, 4)], ids=["data8", "data2-fsdp4"])
def test_sharded_training_equals_one_device(data, fsdp):
    params, rows = small_lm.params_and_rows(vocab=64, d_model=16, rows=16, seq_len=32)
    batch = small_lm.micro_batches(rows, 2)
    cfg = c.olmo_core(c.micro())
    expected = _train(params, batch, cfg)
    mesh = sharding.make_mesh(data=data, fsdp=fsdp)
    actual = _train(params, batch, cfg, mesh)
    assert_close("params and metrics", expected=expected, actual=actual, tol=SAME_AS_ONE_DEVICE)
    if fsdp > 1:
        assert actual[0]["embeddings"].sharding.spec[0] == "fsdp"


def test_param_specs():
    mesh = sharding.make_mesh(data=1, fsdp=4, expert=2)
    spec = lambda path, shape: sharding.param_spec(  # noqa: E731
        tuple(jax.tree_util.DictKey(k) for k in path), shape, mesh
    )
    assert spec(("routed_experts", "w_up_gate"), (16, 128, 32)) == jax.sharding.PartitionSpec(
        "expert", "fsdp", None
    )
    assert spec(("w_q", "kernel"), (64, 64)) == jax.sharding.PartitionSpec("fsdp", None)
    assert spec(("A_log",), (2,)) == jax.sharding.PartitionSpec(None)


def test_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match="needs 16 devices, 8 exist"):
        sharding.make_mesh(data=4, fsdp=4)
