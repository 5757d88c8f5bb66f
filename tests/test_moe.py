"""The latent MoE with a shared expert against OLMo-core's v2 MoE in an `OLMoDDPTransformerBlock`
(goldens/moe*.safetensors): output, expert counts, LB and z-losses and every gradient in training
with OLMo-core's recorded pool draws, output in evaluation; every dispatch equals its spec."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import FP32_FORWARD, FP32_GRAD, MOE_FORWARD
from model.config import micro
from model.convert import load_olmo_core, moe_entries, params_to_olmo_core
from model.moe import (
    LatentMoE,
    megablox_matmul,
    naive_routed_experts,
    ragged_matmul,
    routed_experts,
    tiled_routed_experts,
)
from model.precision import TPU_LANES
from tests.compare import assert_close


def _past_the_groups(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, 1]: True for the rows of x after the last group."""
    return (jnp.arange(x.shape[0]) >= jnp.sum(group_sizes))[:, None]


@jax.custom_vjp
def unwritten_matmul(x, w, group_sizes):
    """`ragged_matmul` under megablox's contract: the rows past the last group come out NaN, in
    the output and in the gradient with respect to x (the kernel leaves them unwritten); the
    weights' gradient reads the groups' rows only."""
    y = ragged_matmul(x, w, group_sizes)
    return jnp.where(_past_the_groups(y, group_sizes), jnp.nan, y)


def _unwritten_fwd(x, w, group_sizes):
    return unwritten_matmul(x, w, group_sizes), (x, w, group_sizes)


def _unwritten_bwd(residuals, dy):
    x, w, group_sizes = residuals
    _, vjp = jax.vjp(lambda x, w: ragged_matmul(x, w, group_sizes), x, w)
    past = _past_the_groups(dy, group_sizes)
    dx, dw = vjp(jnp.where(past, 0.0, dy))
    return jnp.where(past, jnp.nan, dx), dw, None


unwritten_matmul.defvjp(_unwritten_fwd, _unwritten_bwd)


@pytest.mark.parametrize(
    ("dispatch", "widths"),
    [
        (routed_experts, (8, 12)),
        (functools.partial(routed_experts, matmul=unwritten_matmul), (8, 12)),
        (functools.partial(tiled_routed_experts, tile=4), (8, 12)),
        (
            functools.partial(
                routed_experts, matmul=functools.partial(megablox_matmul, interpret=True)
            ),
            (TPU_LANES, TPU_LANES),
        ),
    ],
    ids=["ragged_dot", "unwritten_rows", "tiles", "megablox"],
)
def test_grouped_dispatch_matches_the_spec(dispatch, widths):
    """Every dispatch gives every expert on every token, values and gradients, with an expert
    that gets no token, tokens whose two experts are far apart in the order, slots of index E
    (another device's expert: nothing) and (tiles of 4 rows) part-filled and spare tiles. `widths`:
    the latent and expert widths L, H (megablox: whole TPU lanes, in Pallas's interpreter;
    `unwritten_matmul`: the rows past the groups NaN, as a chip may leave them)."""
    (L, H), N, E, k = widths, 48, 6, 2
    rng = np.random.default_rng(0)
    indices = np.stack([rng.choice(E - 1, k, replace=False) for _ in range(N)])  # E-1: unused
    indices[rng.random((N, k)) < 0.2] = E
    args = [
        rng.standard_normal((N, L), np.float32),
        rng.random((N, k), np.float32),
        rng.standard_normal((E, 2 * H, L), np.float32) / np.sqrt(L),
        rng.standard_normal((E, H, L), np.float32) / np.sqrt(H),
    ]
    cotangent = rng.standard_normal((N, L), np.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grads(fn, z, weights, w_up_gate, w_down):
        def objective(*a):
            out = fn(a[0], indices, *a[1:])
            return jnp.sum(out * cotangent), out

        return jax.value_and_grad(objective, argnums=(0, 1, 2, 3), has_aux=True)(
            z, weights, w_up_gate, w_down
        )

    (_, spec), spec_grads = value_and_grads(naive_routed_experts, *args)
    (_, out), grads = value_and_grads(dispatch, *args)
    assert_close("out", expected=spec, actual=out, tol=FP32_FORWARD)
    assert_close("grads", expected=spec_grads, actual=grads, tol=FP32_GRAD)


def _olmo_core_moe(golden):
    g = golden("moe.safetensors")
    cfg = micro().model
    moe = LatentMoE(cfg.moe, g.entry["config"]["d_model"], std=cfg.init_std, rngs=nnx.Rngs(0))
    load_olmo_core(moe, g.group("param."), moe_entries())
    return g, moe


@functools.partial(jax.jit, static_argnums=0)
def _train_with_grads(graphdef, state, m, document_ids, pools, cotangent, weights):
    """Output, aux and the gradients of sum(y * cotangent) + lb_w * LB + z_w * Z (OLMo-core's
    objective with its aux loss attached) with respect to the MoE state and m."""
    lb_w, z_w, loss_div_factor = weights

    def objective(state, m):
        y, aux = nnx.merge(graphdef, state)(
            m, document_ids=document_ids, pools=pools, loss_div_factor=loss_div_factor
        )
        return jnp.sum(y * cotangent) + lb_w * aux.lb_loss + z_w * aux.z_loss, (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(state, m)
    return y, aux, grads


def test_training_moe_matches_olmo_core(golden):
    """OLMo-core's weights and pool draws: output, counts, losses, gradients of m and every
    MoE weight."""
    g, moe = _olmo_core_moe(golden)
    grads_golden = golden("moe_grads.safetensors")
    config = g.entry["config"]
    graphdef, state = nnx.split(moe)
    y, aux, (grad_state, grad_m) = _train_with_grads(
        graphdef,
        state,
        g["m"],
        g["segment_ids"],
        g["train.pool_draws"],
        g["train.cotangent"],
        (config["lb_loss_weight"], config["z_loss_weight"], float(config["loss_div_factor"])),
    )
    assert_close("out", expected=g["train.out"], actual=y, tol=MOE_FORWARD)
    np.testing.assert_array_equal(aux.counts, g["train.counts"])
    assert_close(
        "losses",
        expected={"lb": g["train.lb_loss"][0], "z": g["train.z_loss"][0]},
        actual={"lb": aux.lb_loss, "z": aux.z_loss},
        tol=FP32_FORWARD,
    )
    grads = {"m": grad_m, **params_to_olmo_core(grad_state, moe_entries())}
    assert_close("grad", expected=grads_golden.tensors, actual=grads, tol=FP32_GRAD)


def test_eval_moe_matches_olmo_core(golden):
    """Evaluation: the eval pool (all 16 experts in the micro config)."""
    g, moe = _olmo_core_moe(golden)
    y, _ = nnx.jit(lambda moe, m, s: moe(m, document_ids=s))(moe, g["m"], g["segment_ids"])
    assert_close("out", expected=g["eval.out"], actual=y, tol=MOE_FORWARD)
