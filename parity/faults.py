"""Deliberate errors in the JAX side, for the tests that show what lockstep catches and
free-running misses. Only tests build an `InjectedFault`; no command-line option does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax

from model.config import Config
from model.convert import model_entries, param_path


@dataclass(frozen=True)
class InjectedFault:
    """From step `first` to `last` (None: to the end) the JAX side trains with `train`'s
    `TrainConfig` fields replaced, `train_scale`'s multiplied by their factors, and/or the
    gradient of OLMo-core parameter `grad_scale[0]` times `grad_scale[1]` (before clipping)."""

    first: int
    last: int | None = None
    train: tuple[tuple[str, Any], ...] = ()
    grad_scale: tuple[str, float] | None = None
    train_scale: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if self.first < 1 or (self.last is not None and self.last < self.first):
            raise ValueError(
                f"InjectedFault steps {self.first}..{self.last}: need 1 <= first <= last"
            )
        if not self.train and not self.train_scale and self.grad_scale is None:
            raise ValueError(
                "InjectedFault changes nothing: give train fields, train_scale or grad_scale"
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
