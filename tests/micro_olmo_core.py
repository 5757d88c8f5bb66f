"""The micro model with OLMo-core's weights (the golden trace's step 0, OLMo-core's init, and step
50, trained) in any compute dtype, and the jitted runs the fp64-oracle tests share: OLMo-core's
training objective over the whole model, one block's and one mixer's VJP. Each returns our tensors
under the oracle's names (goldens/oracle/*)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from goldens.oracle import WEIGHTS
from model.config import micro
from model.convert import from_olmo_core, model_entries, params_to_olmo_core
from model.data import IGNORE_INDEX
from model.loss import cross_entropy_sums
from model.router import document_ids_from_eos

CFG = micro().model
TRAIN = micro().train


def olmo_core_model(golden, weights: str = "trained", dtype: str = "float32"):
    """`from_olmo_core` of OLMo-core's state dict `weights` ("init" or "trained") in `dtype`
    (float64 must be built and run under `jax.enable_x64(True)`)."""
    cfg = dataclasses.replace(CFG, compute_dtype=dtype)
    return from_olmo_core(golden(WEIGHTS[weights]).tensors, cfg)


def _router_losses(aux):
    """The weighted router losses OLMo-core attaches to a MoE block's output: lb_w LB + rz_w
    router z (per MoE layer)."""
    return TRAIN.lb_loss_weight * aux.lb_loss + TRAIN.router_z_loss_weight * aux.z_loss


@functools.partial(jax.jit, static_argnums=0)
def _train(graphdef, state, input_ids, labels, pool_draws):
    """OLMo-core's training objective: (CE + z_w z-loss) / D + sum over MoE layers of
    lb_w LB + rz_w router z (each divided by D); its parts and gradient."""
    div = jnp.sum(labels != IGNORE_INDEX)

    def objective(state):
        out = nnx.merge(graphdef, state)(
            input_ids, train=True, pool_draws=pool_draws, loss_div_factor=div
        )
        ce, z = cross_entropy_sums(out.logits, labels)
        aux = jnp.sum(_router_losses(out.aux))
        z_term = TRAIN.z_loss_weight * z / div
        return ce / div + z_term + aux, (out, ce / div, z_term)

    (_, (out, ce, z)), grads = jax.value_and_grad(objective, has_aux=True)(state)
    return out, ce, z, grads


eval_logits = nnx.jit(lambda m, ids: m(ids).logits)


def model_outputs(model, oracle) -> dict[str, np.ndarray]:
    """The whole model on the oracle's batch and draws: logits, CE, z-loss, per-layer LB and router
    z (float), every parameter's gradient by OLMo-core key ("grad.<key>"), the evaluation logits;
    and the expert counts (integers)."""
    graphdef, state = nnx.split(model)
    out, ce, z, grads = _train(
        graphdef, state, oracle["input_ids"], oracle["labels"], oracle["pool_draws"]
    )
    ours = params_to_olmo_core(grads, model_entries(CFG))
    return {
        "logits": out.logits,
        "ce_loss": ce[None],  # OLMo-core's finalised losses have shape [1]
        "z_loss": z[None],
        "lb_loss": out.aux.lb_loss,
        "router_z_loss": out.aux.z_loss,
        "eval.logits": eval_logits(model, oracle["input_ids"]),
        **{f"grad.{k}": v for k, v in ours.items()},
    }, np.asarray(out.aux.counts)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block_vjp(graphdef, index, state, x, input_ids, pool_draws, cotangent, div):
    """y of block `index` and the gradients of sum(y * cotangent) + the weighted router losses
    w.r.t. the model state (zero outside the block) and x."""

    def objective(state, x):
        model = nnx.merge(graphdef, state)
        document_ids = document_ids_from_eos(input_ids, eos_token_id=CFG.eos_token_id)
        y, aux = model.blocks[index](
            x, document_ids=document_ids, pools=pool_draws, loss_div_factor=div
        )
        attached = 0.0 if aux is None else _router_losses(aux)
        return jnp.sum(y * cotangent) + attached, y

    (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads


def block_outputs(model, oracle) -> dict[str, np.ndarray]:
    """Block `oracle.entry["config"]["index"]` on the oracle's x, draws and cotangent: y,
    "grad.x" and "grad.blocks.<i>.<name>" of its parameters."""
    config = oracle.entry["config"]
    index, dtype = config["index"], _param_dtype(model)
    pool_draws = oracle["pool_draws"] if "pool_draws" in oracle.tensors else None
    graphdef, state = nnx.split(model)
    y, (grad_state, grad_x) = _block_vjp(
        graphdef,
        index,
        state,
        oracle["x"].astype(dtype),
        oracle["input_ids"],
        pool_draws,
        oracle["cotangent"].astype(dtype),
        config["loss_div_factor"],
    )
    prefix = f"blocks.{index}."
    ours = params_to_olmo_core(grad_state, model_entries(CFG))
    grads = {f"grad.{k}": v for k, v in ours.items() if k.startswith(prefix)}
    return {"y": y, "grad.x": grad_x, **grads}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _mixer_vjp(graphdef, index, state, x, cotangent):
    """y of block `index`'s sequence mixer alone and the gradients of sum(y * cotangent) w.r.t.
    the model state (zero outside the mixer) and x."""
    mixer = lambda s, x: nnx.merge(graphdef, s).blocks[index].attention(x)  # noqa: E731
    y, vjp = jax.vjp(mixer, state, x)
    return y, vjp(cotangent)


def mixer_outputs(model, oracle) -> dict[str, np.ndarray]:
    """The sequence mixer of block `oracle.entry["config"]["index"]` alone (one document a row) on
    the oracle's x: y, "grad.x" and "grad.<name>" of its parameters (OLMo-core names)."""
    index = oracle.entry["config"]["index"]
    dtype = _param_dtype(model)
    graphdef, state = nnx.split(model)
    x, cotangent = oracle["x"].astype(dtype), oracle["cotangent"].astype(dtype)
    y, (grad_state, grad_x) = _mixer_vjp(graphdef, index, state, x, cotangent)
    prefix = f"blocks.{index}.attention."
    ours = params_to_olmo_core(grad_state, model_entries(CFG))
    grads = {f"grad.{k.removeprefix(prefix)}": v for k, v in ours.items() if k.startswith(prefix)}
    return {"y": y, "grad.x": grad_x, **grads}


def _param_dtype(model) -> np.dtype:
    return model.blocks[0].attention_norm.weight.dtype
