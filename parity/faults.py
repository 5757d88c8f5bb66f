"""Deliberate errors in the JAX side, for the tests that show what lockstep catches and
free-running misses. Only tests build an `InjectedFault`; no command-line option does."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp

from model import router
from model.config import Config
from model.convert import model_entries, param_path

_ROUTE = router.route
"""The router's own `route`, which `near_tie_route` calls while it stands in for it."""


@dataclass(frozen=True)
class InjectedFault:
    """From step `first` to `last` (None: to the end) the JAX side trains with `train`'s
    `TrainConfig` fields replaced, `train_scale`'s multiplied by their factors, the gradient of
    OLMo-core parameter `grad_scale[0]` times `grad_scale[1]` (before clipping), and/or a
    router whose top-k breaks near-ties wrongly (`near_tie_margin`, see `near_tie_route`)."""

    first: int
    last: int | None = None
    train: tuple[tuple[str, Any], ...] = ()
    grad_scale: tuple[str, float] | None = None
    train_scale: tuple[tuple[str, float], ...] = ()
    near_tie_margin: float | None = None

    def __post_init__(self):
        if self.first < 1 or (self.last is not None and self.last < self.first):
            raise ValueError(
                f"InjectedFault steps {self.first}..{self.last}: need 1 <= first <= last"
            )
        if not (self.train or self.train_scale or self.grad_scale or self.near_tie_margin):
            raise ValueError(
                "InjectedFault changes nothing: give train fields, train_scale, grad_scale or "
                "near_tie_margin"
            )

    def acts_at(self, step: int) -> bool:
        return self.first <= step and (self.last is None or step <= self.last)

    def config(self, cfg: Config) -> Config:
        scaled = {name: getattr(cfg.train, name) * factor for name, factor in self.train_scale}
        train = dataclasses.replace(cfg.train, **dict(self.train), **scaled)
        return dataclasses.replace(cfg, train=train)

    def scale_grads(self, grads, cfg: Config):
        if self.grad_scale is None:
            return grads
        name, factor = self.grad_scale
        paths = {e.torch_key: e.path for e in model_entries(cfg.model)}
        if name not in paths:
            raise KeyError(f"InjectedFault.grad_scale: no OLMo-core parameter {name!r}")

        def scale(path, g):
            return g * factor if param_path(path) == paths[name] else g

        return jax.tree_util.tree_map_with_path(scale, grads)

    @property
    def in_the_trace(self) -> bool:
        """Whether the fault changes the jitted train step itself (not its config or gradients)."""
        return self.near_tie_margin is not None

    def traced_with(self, fn):
        """`fn`, traced with the faulty router when the fault has one."""
        if not self.in_the_trace:
            return fn

        @functools.wraps(fn)
        def faulty(*args, **kwargs):
            biased = functools.partial(near_tie_route, margin=self.near_tie_margin)
            with mock.patch.object(router, "route", biased):
                return fn(*args, **kwargs)

        return faulty


def near_tie_route(logits: jax.Array, *, margin: float, top_k: int, keep=None, **kw):
    """`model.router.route` whose top-k picks by probs x (1 + margin e / (E - 1)) (expert e): an
    expert whose probability is within `margin` (relative) of a higher-index one's may lose its
    slot to it. The weights stay the true probabilities, so only the slots a near-tie moves
    differ: a tie-break bug."""
    E = logits.shape[-1]
    tilted = jax.nn.softmax(logits, axis=-1) * (1 + margin * jnp.arange(E) / (E - 1))
    if keep is not None:
        tilted = jnp.where(keep, tilted, -jnp.inf)
    _, picked = jax.lax.top_k(tilted, top_k)  # shape: [B, T, E] -> [B, T, k]
    chosen = jax.nn.one_hot(picked, E, dtype=jnp.bool_).any(axis=-2)
    return _ROUTE(logits, top_k=top_k, keep=chosen, **kw)
