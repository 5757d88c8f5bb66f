"""The model's train-step terms (`model.objective`) on a mesh of 4 simulated data devices, for a
two-block hybrid (KDA + dense, attention + EMO MoE): with `moe_global_load_balancing` every term
and its gradient equal the whole batch's on one device; without it each device balances its own
rows, the logged LB is device 0's scaled to the batch and the gradient is the sum of each device's
own. Each remat policy puts one `jax.checkpoint` of its policy around each block and leaves the
gradients as they were."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import LOCAL_LB_VISIBLE, REMAT, SHARDED
from model import config as c
from model import train_step as ts
from model.data import olmo_labels, shift_to_inputs_targets
from model.layout import make_mesh
from model.objective import model_terms_fn
from model.transformer import CHECKPOINT_POLICIES, Transformer
from tests.compare import assert_close

DEVICES, ROWS, T = 4, 8, 64
MODEL = c.ModelConfig(
    d_model=32,
    n_layers=2,
    vocab_size=384,
    eos_token_id=256,
    layer_types=("kda", "attention"),
    dense_layers=(0,),
    dense_hidden=64,
    kda=c.KDAConfig(n_heads=1, head_dim=16),
    attention=c.AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=16),
    moe=c.MoEConfig(
        num_experts=8,
        top_k=2,
        expert_hidden=16,
        latent_dim=16,
        shared_expert_hidden=16,
        emo=c.EmoConfig(min_pool=2, max_pool=8, eval_pool=8),
    ),
)


def _config(global_lb: bool) -> c.Config:
    cfg = c.olmo_core(c.Config(model=MODEL, train=c.micro().train))
    return dataclasses.replace(
        cfg, flags=dataclasses.replace(cfg.flags, moe_global_load_balancing=global_lb)
    )


def _batch() -> dict:
    """ROWS rows of T tokens, several documents each, rows favouring different token ranges (so
    the devices' routings differ), with EMO draws."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (ROWS, T + 1)) + 32 * np.arange(ROWS)[:, None] % 256
    tokens[:, [10, 30, 31]] = MODEL.eos_token_id
    batch = shift_to_inputs_targets(tokens, segment_ids_from_eos=MODEL.eos_token_id)
    batch["labels"] = olmo_labels(batch["targets"], batch["targets_segmentation"])
    batch["pool_draws"] = rng.integers(2, 9, (ROWS, len(MODEL.moe_layers), T)).astype(np.int32)
    return {k: jnp.asarray(v) for k, v in batch.items()}


@functools.cache
def _model():
    return nnx.split(
        Transformer(
            MODEL, ignore_segment_ids=True, kda_inverse="forward_substitution", rngs=nnx.Rngs(0)
        )
    )


@functools.partial(jax.jit, static_argnames=("devices", "global_lb"))
def _terms_and_grads(params, mb, div, *, devices, global_lb):
    """The terms and the gradient of their sum (CE, z-loss, LB and router z of every layer)."""
    mesh = make_mesh(data=devices) if devices > 1 else None
    terms_fn = model_terms_fn(_model()[0], _config(global_lb), mesh=mesh)

    def total(p):
        terms = terms_fn(p, mb, div)
        return sum(jnp.sum(v) for v in terms.values()), terms

    (_, terms), grads = jax.value_and_grad(total, has_aux=True)(params)
    return terms, grads


@pytest.fixture(scope="module")
def whole_batch():
    mb = _batch()
    div = ts.loss_div_factor(mb)
    return mb, div, _terms_and_grads(_model()[1], mb, div, devices=1, global_lb=True)


def test_global_load_balancing_on_4_devices_is_the_whole_batch(whole_batch):
    mb, div, expected = whole_batch
    actual = _terms_and_grads(_model()[1], mb, div, devices=DEVICES, global_lb=True)
    assert_close("terms and grads", expected=expected, actual=actual, tol=SHARDED)


def _rows(mb: dict, start: int, n: int) -> dict:
    return {k: v[start : start + n] for k, v in mb.items()}


def test_local_load_balancing_logs_device_0_and_balances_each_device(whole_batch):
    mb, div, (whole, _) = whole_batch
    params = _model()[1]
    terms, grads = _terms_and_grads(params, mb, div, devices=DEVICES, global_lb=False)
    rows = ROWS // DEVICES
    own = [  # each device's rows alone on one device, divided by the batch's D
        _terms_and_grads(params, _rows(mb, i * rows, rows), div, devices=1, global_lb=True)
        for i in range(DEVICES)
    ]
    assert_close(
        "logged LB: device 0's",
        expected=DEVICES * own[0][0]["lb_loss"],
        actual=terms["lb_loss"],
        tol=SHARDED,
    )
    summed = jax.tree.map(lambda *xs: sum(xs), *[g for _, g in own])
    assert_close("grads: each device's own", expected=summed, actual=grads, tol=SHARDED)
    gap = abs(float(terms["lb_loss"][0]) / float(whole["lb_loss"][0]) - 1)
    assert gap > LOCAL_LB_VISIBLE, (
        f"local LB within {gap:.1e} of the global one: the batch shows nothing"
    )


def _remat_config(policy: str) -> c.Config:
    cfg = _config(global_lb=True)
    return dataclasses.replace(cfg, scale=dataclasses.replace(cfg.scale, remat_policy=policy))


def _grad_of_sum(policy: str):
    terms_fn = model_terms_fn(_model()[0], _remat_config(policy))

    def total(params, mb, div):
        return sum(jnp.sum(v) for v in terms_fn(params, mb, div).values())

    return jax.grad(total)


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_remat_recomputes_each_block_as_its_policy_says_and_changes_no_gradient(
    whole_batch, policy
):
    mb, div, (_, expected) = whole_batch  # no remat
    params = _model()[1]
    grads = jax.jit(_grad_of_sum(policy))(params, mb, div)
    assert_close("grads", expected=expected, actual=grads, tol=REMAT)
    for p, expected in (("none", []), (policy, [CHECKPOINT_POLICIES[policy]] * MODEL.n_layers)):
        jaxpr = jax.make_jaxpr(_grad_of_sum(p))(params, mb, div).jaxpr
        remats = [e.params["policy"] for e in jaxpr.eqns if e.primitive.name == "remat2"]
        assert remats == expected, (p, remats)
