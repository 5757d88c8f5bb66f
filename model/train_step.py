"""One training step with gradient accumulation, as OLMo-core's `OLMoDDPTrainModule.train_batch`
followed by `optim_step`.

A step's losses are normalised by D, the count of labels not ignored in the whole global batch
(OLMo-core's `batch_num_tokens_for_loss`): each micro-batch adds its sums divided by D. So the
gradient is the whole-batch gradient and the reported CE, z-loss and aux losses are the sums of the
micro-batch contributions, whatever the number of micro-batches (MaxText reported z-loss and aux
losses GA times too large).

`terms_fn(params, micro_batch, loss_div_factor)` is the model's side: it returns the unweighted
terms of one micro-batch, already divided by D: "ce" and "z_loss" (scalars) and, for MoE models,
"lb_loss" and "router_z_loss" ([n_moe_layers] each) and "expert_counts" ([n_moe_layers, E],
token slots per routed expert, reported as they are). Weights come from `TrainConfig`; the MoE
terms are combined over layers by `Flags.moe_aux_loss_reduction`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model import optim
from model.config import Config
from model.data import IGNORE_INDEX
from model.precision import matmul_precision

TermsFn = Callable[[Any, dict[str, jax.Array], jax.Array], dict[str, jax.Array]]
AUX_TERMS = ("lb_loss", "router_z_loss")
"""The MoE terms; each is also reported per layer as "<name>_per_layer"."""
METRICS = ("ce", "z_loss", *AUX_TERMS, "lr", "grad_norm")
"""The scalar metrics a step reports besides "skipped", in the order a replay looks for a
divergence."""


class TrainState(NamedTuple):
    params: Any
    opt_state: optim.OptState
    step: jax.Array


def init_state(params, cfg: Config) -> TrainState:
    return TrainState(params, optim.init(params, cfg), jnp.zeros((), jnp.int32))


def combine_aux(per_layer: jax.Array, reduction: str) -> jax.Array:
    """MoE aux losses of all layers: OLMo-core sums them, MaxText averages them."""
    if reduction == "sum":
        return jnp.sum(per_layer)
    if reduction == "mean":
        return jnp.mean(per_layer)
    raise NotImplementedError(reduction)


def _weighted(terms: dict[str, jax.Array], cfg: Config) -> tuple[dict, dict]:
    """The terms as they enter the objective and the logs (weights applied, layers combined),
    and what only the logs see: the weighted MoE terms of each layer ("<name>_per_layer"
    [n_moe_layers]) and the expert counts."""
    train = cfg.train
    weights = {"lb_loss": train.lb_loss_weight, "router_z_loss": train.router_z_loss_weight}
    out = {"ce": terms["ce"], "z_loss": train.z_loss_weight * terms["z_loss"]}
    per_layer = {}
    for name in AUX_TERMS:
        if name in terms:
            per_layer[f"{name}_per_layer"] = weights[name] * terms[name]
            out[name] = combine_aux(
                per_layer[f"{name}_per_layer"], cfg.flags.moe_aux_loss_reduction
            )
    if "expert_counts" in terms:
        per_layer["expert_counts"] = terms["expert_counts"]
    return out, per_layer


def loss_div_factor(micro_batches: dict[str, jax.Array]) -> jax.Array:
    """D: labels not ignored in `micro_batches["labels"]`, of any shape: the whole global batch's
    [GA, b, T] (OLMo-core's D), or one micro-batch's [b, T]."""
    return jnp.sum(micro_batches["labels"] != IGNORE_INDEX).astype(jnp.float32)


def accumulate(
    params,
    micro_batches,
    *,
    cfg: Config,
    terms_fn: TermsFn,
    grad_sharding=None,
):
    """Gradients and reported terms summed over the micro-batches (leading axis), under
    `lax.scan`. `grad_sharding` (a pytree of shardings like params) lays out each micro-batch's
    gradients and their sum as the params, behind an optimisation barrier: each micro-batch's are
    reduce-scattered inside the loop, where XLA would otherwise carry a sum of the unscattered
    gradients (every device's full share of the routed experts', in float32) and scatter it once
    after the loop. `Flags.ga_params_loop_barrier` puts an optimisation barrier on the params in
    the loop body so XLA cannot hoist work on them out of it. Every matmul, forward and backward,
    runs at `model.precision.matmul_precision(cfg)`."""
    div = loss_div_factor(micro_batches)

    def objective(p, mb):
        terms, per_layer = _weighted(terms_fn(p, mb, div), cfg)
        return sum(terms.values()), {**terms, **per_layer}

    def body(acc, mb):
        p = lax.optimization_barrier(params) if cfg.flags.ga_params_loop_barrier else params
        (_, terms), grads = jax.value_and_grad(objective, has_aux=True)(p, mb)
        if grad_sharding is not None:
            grads = lax.optimization_barrier(lax.with_sharding_constraint(grads, grad_sharding))
        acc = jax.tree.map(jnp.add, acc, grads)
        if grad_sharding is not None:
            acc = lax.with_sharding_constraint(acc, grad_sharding)
        return acc, terms

    # The terms leave the loop stacked [GA, ...] and are summed after it: a zero carry for them
    # would need their shapes, one more trace of the whole objective.
    with jax.default_matmul_precision(matmul_precision(cfg)):
        grads, terms = lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro_batches)
    return grads, jax.tree.map(lambda t: jnp.sum(t, axis=0), terms)


def train_step(
    state: TrainState,
    micro_batches,
    *,
    cfg: Config,
    terms_fn: TermsFn,
    grad_sharding=None,
):
    """Accumulate over the micro-batches [GA, b, ...] (arguments as `accumulate`), then one
    optimizer step. Returns (state, metrics): the reported terms (with the weighted MoE terms of
    each layer, "<name>_per_layer", and "expert_counts"), "lr", "grad_norm" (before clipping),
    "skipped"."""
    grads, terms = accumulate(
        state.params,
        micro_batches,
        cfg=cfg,
        terms_fn=terms_fn,
        grad_sharding=grad_sharding,
    )
    params, opt_state, metrics = optim.step(
        state.params, grads, state.opt_state, step=state.step, loss=terms["ce"], cfg=cfg
    )
    return TrainState(params, opt_state, state.step + 1), {**terms, **metrics}
