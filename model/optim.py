"""The optimizer step of OLMo-core's recipe: LR schedule, global-norm clipping, decoupled AdamW
and the skip-step rule (olmo_core/optim/{scheduler.py, adamw.py, skip_step_optimizer.py},
`OLMoDDPOptimizer` in moe_optimizer.py applies the same math).

    lr    = schedule(step + warmup_step_offset)        OLMo-core's first step is step 1
    |g|   = global L2 norm of the grads (logged, before clipping)
    g     = g * min(1, max_grad_norm / (|g| + 1e-6))
    skip  = after >= window/2 recorded steps: loss or |g| above mean + sigma * std of the previous
            <= window steps (std unbiased; the loss is the CE only)
    p     = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)   (wd = 0 on embeddings)
A skipped step changes neither params nor moments nor Adam's step count; the LR still follows the
trainer's step. optax supplies the Adam moments and the decay; the rest optax lacks or does
differently (its clipping has no 1e-6, its schedules count optimizer updates).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from model.config import Config, TrainConfig
from model.precision import full_precision

CLIP_EPS = 1e-6
"""Added to the global norm before dividing, as torch's and OLMo-core's clipping."""


def _warmup(lr: float, current: jax.Array, warmup: int) -> jax.Array:
    """Linear warmup from 0 (OLMo-core `_linear_warmup` with warmup_min_lr 0)."""
    return lr * jnp.minimum(current, warmup) / warmup


def schedule_lr(current: jax.Array, train: TrainConfig) -> jax.Array:
    """OLMo-core's `get_lr(initial_lr, current, t_max)` of `train.schedule`, t_max = max_steps."""
    c = jnp.asarray(current, jnp.float32)
    lr, w, t_max = train.lr, train.warmup_steps, train.max_steps
    eta_min = train.alpha_f * lr
    if train.schedule == "constant_with_warmup":
        after = jnp.full_like(c, lr)
        in_warmup = c <= w
    elif train.schedule == "wsd":
        decay = round(t_max * train.decay_fraction)
        tail = lr * jnp.minimum(t_max - c, decay) / max(decay, 1)  # linear decay to 0 at t_max
        after = jnp.where(c >= t_max - decay, tail, lr)
        in_warmup = c <= w
    elif train.schedule == "cosine":
        progress = (c - w) / max(t_max - w, 1)
        cosine = eta_min + (lr - eta_min) * (1 + jnp.cos(jnp.pi * progress)) / 2
        after = jnp.where(c >= t_max, eta_min, cosine)
        in_warmup = c < w
    elif train.schedule == "linear":
        linear = lr - (lr - eta_min) * (c - w) / max(t_max - w, 1)
        after = jnp.where(c >= t_max, eta_min, linear)
        in_warmup = c < w
    else:
        raise NotImplementedError(train.schedule)
    if w == 0:
        return after
    return jnp.where(in_warmup, _warmup(lr, c, w), after)


def lr_at(step, cfg: Config) -> jax.Array:
    """LR of trainer step `step` (0 = the first step), with `Flags.warmup_step_offset`."""
    return schedule_lr(jnp.asarray(step) + cfg.flags.warmup_step_offset, cfg.train)


def is_embedding(path: tuple) -> bool:
    """OLMo-core's `*embeddings.weight` override: params under a key named "embeddings"."""
    return any(getattr(k, "key", getattr(k, "name", None)) == "embeddings" for k in path)


def _decay_masks(params) -> tuple[Any, Any]:
    embedding = jax.tree_util.tree_map_with_path(lambda p, _: is_embedding(p), params)
    return embedding, jax.tree.map(lambda e: not e, embedding)


class SkipState(NamedTuple):
    """The last window + 1 losses and grad norms, newest last; `count` of them are real."""

    losses: jax.Array
    grad_norms: jax.Array
    count: jax.Array


class OptState(NamedTuple):
    adam: optax.OptState
    skip: SkipState


def _direction(cfg: Config, params) -> optax.GradientTransformation:
    """Adam's m_hat / (sqrt(v_hat) + eps) plus wd * p (wd per param group)."""
    train = cfg.train
    embedding, other = _decay_masks(params)
    return optax.chain(
        optax.scale_by_adam(b1=train.betas[0], b2=train.betas[1], eps=train.eps),
        optax.add_decayed_weights(train.weight_decay, mask=other),
        optax.add_decayed_weights(train.embedding_weight_decay, mask=embedding),
    )


def init(params, cfg: Config) -> OptState:
    window = cfg.train.skip_step_window + 1
    history = jnp.zeros(window, full_precision(jnp.result_type(*jax.tree.leaves(params))))
    skip = SkipState(history, jnp.zeros_like(history), jnp.zeros((), jnp.int32))
    return OptState(_direction(cfg, params).init(params), skip)


def resume(params, cfg: Config, *, mu, nu, count: int, losses, grad_norms) -> OptState:
    """The optimizer state of a run stopped after `count` Adam updates: its moments `mu`, `nu`
    (pytrees like `params`) and the skip rule's last <= window + 1 losses and grad norms (oldest
    first), as `OLMoDDPOptimizer` holds them in `states` and `_losses` / `_grad_norms`."""
    state = jax.eval_shape(functools.partial(init, cfg=cfg), params)  # each leaf replaced below
    size = state.skip.losses.shape[0]
    if len(losses) != len(grad_norms) or len(losses) > size:
        raise ValueError(
            f"skip history: {len(losses)} losses and {len(grad_norms)} grad norms, "
            f"expected equal counts of at most {size}"
        )

    def history(values):
        values = jnp.asarray(values, state.skip.losses.dtype).reshape(-1)
        return jnp.concatenate([jnp.zeros(size - values.shape[0], values.dtype), values])

    adam, *decay = state.adam
    adam = adam._replace(count=jnp.asarray(count, adam.count.dtype), mu=mu, nu=nu)
    skip = SkipState(history(losses), history(grad_norms), jnp.asarray(len(losses), jnp.int32))
    return OptState((adam, *decay), skip)


def laid_out(state: OptState, *, moments, other) -> OptState:
    """`state`'s structure with `moments` (a pytree like the params, e.g. their shardings) for
    each Adam moment and `other` for every other leaf."""
    adam, *decay = state.adam
    adam = adam._replace(count=other, mu=moments, nu=moments)
    decay, skip = jax.tree.map(lambda _: other, (decay, state.skip))
    return OptState((adam, *decay), skip)


def moments(state: OptState) -> tuple[Any, Any]:
    """Adam's first and second moments (pytrees like the params)."""
    return state.adam[0].mu, state.adam[0].nu


def record(state: SkipState, loss, grad_norm) -> SkipState:
    """Append the step's loss and grad norm to the skip history."""
    push = lambda history, x: jnp.concatenate([history[1:], jnp.reshape(x, (1,))])  # noqa: E731
    count = jnp.minimum(state.count + 1, state.losses.shape[0])
    return SkipState(push(state.losses, loss), push(state.grad_norms, grad_norm), count)


def proceeds(state: SkipState, *, sigma: float, window: int) -> jax.Array:
    """OLMo-core's `get_step_factor` on a history whose newest entry is the current step."""
    size = state.losses.shape[0]
    previous = (jnp.arange(size) >= size - state.count) & (jnp.arange(size) < size - 1)
    n = jnp.maximum(state.count - 1, 1)

    def within(history):
        mean = jnp.sum(jnp.where(previous, history, 0.0)) / n
        var = jnp.sum(jnp.where(previous, (history - mean) ** 2, 0.0)) / jnp.maximum(n - 1, 1)
        return history[-1] - mean <= sigma * jnp.sqrt(var)

    enough = state.count >= max(2, window // 2)
    return ~enough | (within(state.losses) & within(state.grad_norms))


@jax.named_scope("optimizer")
def step(params, grads, state: OptState, *, step, loss, cfg: Config):
    """One optimizer step. `loss` is the step's CE (what OLMo-core's skip rule watches).
    Returns (params, state, {"lr", "grad_norm" (before clipping), "skipped"})."""
    train = cfg.train
    grad_norm = optax.tree.norm(grads)
    scale = jnp.minimum(1.0, train.max_grad_norm / (grad_norm + CLIP_EPS))
    grads = jax.tree.map(lambda g: g * scale, grads)
    skip = record(state.skip, loss, grad_norm)
    ok = proceeds(skip, sigma=train.skip_step_sigma, window=train.skip_step_window)
    lr = lr_at(step, cfg)
    direction, adam = _direction(cfg, params).update(grads, state.adam, params)
    stepped = jax.tree.map(lambda p, d: p - lr * d, params, direction)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    params, adam = keep(stepped, params), keep(adam, state.adam)
    return params, OptState(adam, skip), {"lr": lr, "grad_norm": grad_norm, "skipped": ~ok}
