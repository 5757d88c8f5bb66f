"""OLMo-core's training state and weights, to and from the JAX trainer's: a state OLMo-core kept
between two steps, in the flat format of `goldens.train_state` (the trace's
state_step<N>.safetensors), read into a `model.train_step.TrainState`; params written as an
`OLMoDDPModel` state dict that OLMo-core's model loads.

OLMo-core 3.0.0 counterparts: `OLMoDDPOptimizer.states` ("<param>.main|exp_avg|exp_avg_sq|step",
each flat) with its skip rule's `_losses` and `_grad_norms` (olmo_core/optim/moe_optimizer.py),
and `OLMoDDPModel.state_dict()` (olmo_core/nn/ddp/model.py). A saved state does not say how many
trainer steps it was saved after (Adam's step count leaves out skipped steps): the caller does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from os import PathLike
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from goldens.train_state import GRAD_NORMS, LOSSES, SUFFIXES
from model import optim
from model import train_step as ts
from model.config import Config, Flags, ModelConfig
from model.convert import abstract_transformer, like_params, model_entries, params_to_olmo_core

Tensors = dict[str, np.ndarray]
"""OLMo-core parameter name (as `OLMoDDPModel.state_dict()`) -> array in OLMo-core's layout."""


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """One side's state between steps: params, Adam's moments and update count, and the skip
    rule's history (oldest first)."""

    params: Tensors
    exp_avg: Tensors
    exp_avg_sq: Tensors
    count: int
    losses: list[float]
    grad_norms: list[float]


SHOWN = 6
"""Keys an error lists of those missing or unknown (with their count)."""


def _olmo_core_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """OLMo-core's shape of a param of our `shape` in `model.convert` layout `layout`."""
    if layout == "linear":
        return shape[::-1]
    if layout == "conv":
        return (shape[0], 1, shape[1])
    if layout == "same":
        return shape
    raise NotImplementedError(layout)


@functools.cache
def olmo_core_shapes(cfg: ModelConfig) -> Mapping[str, tuple[int, ...]]:
    """Each `OLMoDDPModel` parameter's shape by its state-dict key, from our params' shapes
    (nothing allocated; read-only, computed once per config) through `model_entries`."""
    model = abstract_transformer(cfg, Flags())
    ours = {p: v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    shapes = {e.torch_key: _olmo_core_shape(ours[e.path], e.layout) for e in model_entries(cfg)}
    return MappingProxyType(shapes)


def _listed(keys: list[str]) -> str:
    more = f" ... ({len(keys)} in all)" if len(keys) > SHOWN else ""
    return f"{keys[:SHOWN]}{more}"


def training_state(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> TrainingState:
    """OLMo-core's state between steps in `goldens.train_state`'s flat format ("<param>.<suffix>"
    [numel] for each of SUFFIXES, "step" [1]; LOSSES and GRAD_NORMS [n], oldest first) as a
    `TrainingState` of OLMo-core-shaped tensors. Raises ValueError naming the missing or unknown
    keys, or the first tensor whose shape is not `cfg`'s, or Adam step counts that differ."""

    shapes = olmo_core_shapes(cfg)
    expected = {f"{n}.{s}" for n in shapes for s in SUFFIXES} | {LOSSES, GRAD_NORMS}
    missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unknown:
        raise ValueError(
            f"OLMo-core training state: missing keys {_listed(missing)}, unknown keys "
            f"{_listed(unknown)}: it was made for another model config"
        )
    for name, shape in shapes.items():
        for suffix in SUFFIXES:
            key = f"{name}.{suffix}"
            want = (1,) if suffix == "step" else (math.prod(shape),)
            if tensors[key].shape != want:
                raise ValueError(
                    f"OLMo-core training state: {key} has shape {tensors[key].shape}, expected "
                    f"{want} ({name} of shape {shape}): it was made for another model config"
                )
    counts = {float(tensors[f"{n}.step"][0]) for n in shapes}
    if len(counts) != 1:
        raise ValueError(f"OLMo-core training state: the params' Adam step counts differ: {counts}")

    def shaped(suffix: str) -> dict[str, np.ndarray]:
        return {n: tensors[f"{n}.{suffix}"].reshape(shape) for n, shape in shapes.items()}

    return TrainingState(
        params=shaped("main"),
        exp_avg=shaped("exp_avg"),
        exp_avg_sq=shaped("exp_avg_sq"),
        count=int(counts.pop()),
        losses=tensors[LOSSES].tolist(),
        grad_norms=tensors[GRAD_NORMS].tolist(),
    )


def load_training_state(path: str | PathLike, cfg: ModelConfig) -> TrainingState:
    """`training_state` of a safetensors file in that flat format (the trace's
    state_step<N>.safetensors are such files); errors name the file."""
    try:
        return training_state(safetensors.numpy.load_file(path), cfg)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def train_state(state: TrainingState, template: nnx.State, cfg: Config, step: int) -> ts.TrainState:
    """A JAX `TrainState` resuming OLMo-core's `state` after `step` trainer steps: params, Adam's
    moments and count, the skip rule's history (`model.optim.resume`). `template`: params of the
    model's structure, shapes and dtypes (arrays or abstract; values not read)."""
    if state.count > step:
        raise ValueError(
            f"OLMo-core's state made {state.count} Adam updates, more than the {step} trainer "
            "steps it is said to follow"
        )
    entries = model_entries(cfg.model)
    params = like_params(state.params, template, entries)
    opt_state = optim.resume(
        params,
        cfg,
        mu=like_params(state.exp_avg, template, entries),
        nu=like_params(state.exp_avg_sq, template, entries),
        count=state.count,
        losses=state.losses,
        grad_norms=state.grad_norms,
    )
    return ts.TrainState(params, opt_state, jnp.asarray(step, jnp.int32))


def export_params(params: nnx.State, cfg: ModelConfig, path: str | PathLike) -> None:
    """Write `params` (a `Transformer`'s) as an `OLMoDDPModel` state dict, OLMo-core's keys and
    layouts in the params' dtype, to a safetensors file whose metadata "model_config" is `cfg` as
    JSON. OLMo-core loads it with `model.load_state_dict({k: torch.from_numpy(v) for k, v in
    safetensors.numpy.load_file(path).items()})`."""
    tensors = params_to_olmo_core(params, model_entries(cfg))
    safetensors.numpy.save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        path,
        metadata={"model_config": json.dumps(cfg.as_dict())},
    )
