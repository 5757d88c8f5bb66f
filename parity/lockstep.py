"""Lockstep: OLMo-core's own train module and the JAX train step, one step at a time in one
process, every step from OLMo-core's state.

OLMo-core trains as the golden trace did (`goldens.trace.fit`: `OLMoDDPModel`,
`OLMoDDPTrainModule`, `OLMoDDPOptimizer`, the CPU stand-ins, the per-step reseed, one torch
thread). Before its step s a callback takes its params, Adam moments and step count and the skip
rule's history; after it, its gradients before clipping (`OLMoDDPOptimizer._clip_grad` sees them
first), its metrics, params and moments. The JAX side starts step s from that same state, with the
same micro-batches and EMO draws, and does the whole step (`parity.run.take_step`). Both go on
from OLMo-core's state at s + 1, so rounding cannot compound as it does when free-running: a gap
at step s is that step's own (`parity.lockstep_check`).
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from goldens.export import make_torch_deterministic
from goldens.trace import (
    fit,
    record_pool_draws,
    trace_metrics,
    train_module,
    use_free_port,
)
from goldens.train_state import (
    GRAD_NORMS,
    LOSSES,
    PREFIX,
    optimizer_state,
    restore_optimizer_state,
    unwrapped,
)
from model import optim
from model import train_step as ts
from model.convert import from_olmo_core, like_params, model_entries, params_to_olmo_core
from parity.olmo_core_state import Tensors, TrainingState, train_state
from parity.run import Metrics, Run, parts_at, take_step
from parity.trace import GoldenTrace


@dataclass(frozen=True)
class StepResult:
    """What one side's step s produced from the same state: gradients before clipping, the state
    after the step, the metrics (`model.train_step.train_step`'s names, and "expert_counts"). On
    the JAX side also `optimizer_alone`: its optimizer's step on OLMo-core's gradients and CE."""

    grads: Tensors
    after: TrainingState
    metrics: Metrics
    optimizer_alone: TrainingState | None = None


@dataclass(frozen=True)
class OlmoCoreStep:
    step: int
    before: TrainingState
    result: StepResult
    input_ids: np.ndarray
    """[global batch, T] the batch OLMo-core's loader gave."""
    pool_draws: np.ndarray
    """[GA, b, MoE layers, T] OLMo-core's EMO draws (document d of a row in column d)."""


def _local(tensor) -> np.ndarray:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().numpy().copy()


class _OlmoCoreSide:
    """Reads OLMo-core's `OLMoDDPOptimizer` and model; names without the DDP "module." prefix."""

    def __init__(self, module):
        self.module, self.optim = module, module.optim
        self.names = [n for g in self.optim.param_groups for n in g["named_params"]]
        self.shapes = {n: tuple(p.shape) for n, p in unwrapped(module).named_parameters()}
        self.grads: Tensors = {}
        clip = self.optim._clip_grad

        def clip_recording():
            self.grads = {
                self._name(n): self._shaped(n, g) for n, g in self.optim.main_grad.items()
            }
            return clip()

        self.optim._clip_grad = clip_recording

    def _name(self, name: str) -> str:
        return name.removeprefix(PREFIX)

    def _shaped(self, name: str, flat) -> np.ndarray:
        return _local(flat).reshape(self.shapes[self._name(name)])

    def state(self) -> TrainingState:
        flat = optimizer_state(self.module)
        names = [self._name(n) for n in self.names]
        counts = {float(flat[f"{n}.step"][0]) for n in names}
        if len(counts) != 1:
            raise RuntimeError(f"OLMo-core's parameters have different Adam step counts: {counts}")

        def moment(kind: str) -> Tensors:
            return {n: flat[f"{n}.{kind}"].reshape(self.shapes[n]) for n in names}

        return TrainingState(
            params={
                k: v.detach().numpy().copy() for k, v in unwrapped(self.module).state_dict().items()
            },
            exp_avg=moment("exp_avg"),
            exp_avg_sq=moment("exp_avg_sq"),
            count=int(counts.pop()),
            losses=flat[LOSSES].tolist(),
            grad_norms=flat[GRAD_NORMS].tolist(),
        )


def record_expert_counts(model, on_counts: Callable[[np.ndarray], None]) -> None:
    """Report each training call of every `EmoRouterV2` of `model` to `on_counts`: the token
    slots each expert received ([E], the `counts` its forward returns)."""
    from olmo_core.nn.moe.v2.emo_router import EmoRouterV2

    def hook(router, args, kwargs, output):
        if router.training:
            on_counts(output[2].detach().numpy().copy())

    for router in (m for m in model.modules() if isinstance(m, EmoRouterV2)):
        router.register_forward_hook(hook, with_kwargs=True)


def _olmo_core_metrics(raw: dict, step: int) -> Metrics:
    """One step's recorded metrics (OLMo-core's names, as the golden trace reads them:
    `goldens.trace.trace_metrics`) under `train_step`'s names, per layer in MoE order."""
    _, named = trace_metrics({step: raw}, range(step, step + 1))
    ours = {
        k.removesuffix("_per_block") + ("_per_layer" if k.endswith("_per_block") else ""): v
        for k, v in ((k, np.asarray(v[0]).tolist()) for k, v in named.items())
    }
    ours["skipped"] = bool(ours["skipped"])
    return ours


def run_olmo_core(
    trace: GoldenTrace, steps: int, on_step: Callable[[OlmoCoreStep], None], *, first: int = 1
) -> None:
    """Train OLMo-core's micro model to step `steps` as the trace did, calling `on_step` after
    each with what it started from and what it did; from step `first`, restoring the trace's
    saved state after `first - 1` (`GoldenTrace.state`) and skipping the steps before it."""
    from olmo_core.train.callbacks import Callback

    make_torch_deterministic()
    use_free_port()
    cfg = trace.config
    module = train_module(cfg)
    if first > 1:
        restore_optimizer_state(module, trace.state(first - 1))
    side = _OlmoCoreSide(module)
    draws, counts = [], []

    class Lockstep(Callback):
        after: TrainingState | None = None
        """OLMo-core's state after the last step: the next one starts from it."""

        def pre_train(self):
            record_pool_draws(unwrapped(module), lambda layer, raw, docs: draws.append(raw.numpy()))
            record_expert_counts(unwrapped(module), counts.append)

        def pre_step(self, batch):
            if self.step < first:  # skipped: it draws its batch and trains nothing
                return
            self.before = self.after or side.state()
            self.input_ids = batch["input_ids"].numpy().copy()
            draws.clear()
            counts.clear()

        def post_step(self):
            step = self.step
            if step < first:
                return
            raw = {k: float(v) for k, v in self.trainer._metrics[step].items()}
            ours = _olmo_core_metrics(raw, step)
            ga, layers = cfg.train.ga_steps, len(draws) // cfg.train.ga_steps
            stacked = np.stack(draws).reshape(ga, layers, *draws[0].shape)  # [GA, L, b, T]
            pool_draws = stacked.transpose(0, 2, 1, 3).astype(np.int32)
            ours["expert_counts"] = np.stack(counts).reshape(ga, layers, -1).sum(0).tolist()
            self.after = side.state()
            result = StepResult(side.grads, self.after, ours)
            on_step(OlmoCoreStep(step, self.before, result, self.input_ids, pool_draws))

    with tempfile.TemporaryDirectory(prefix="lockstep-") as tmp:
        fit(
            cfg,
            module,
            Path(tmp),
            steps=steps,
            callbacks={"lockstep": Lockstep()},
            skip_before=first,
        )


def _ours(state: nnx.State, cfg) -> Tensors:
    return params_to_olmo_core(state, model_entries(cfg.model))


def _state(state: ts.TrainState, cfg) -> TrainingState:
    mu, nu = optim.moments(state.opt_state)
    skip = state.opt_state.skip
    kept = int(skip.count)
    return TrainingState(
        params=_ours(state.params, cfg),
        exp_avg=_ours(mu, cfg),
        exp_avg_sq=_ours(nu, cfg),
        count=int(state.opt_state.adam[0].count),
        losses=np.asarray(skip.losses)[len(skip.losses) - kept :].tolist(),
        grad_norms=np.asarray(skip.grad_norms)[len(skip.grad_norms) - kept :].tolist(),
    )


def _micro_batches(trace: GoldenTrace, run: Run, olmo_core: OlmoCoreStep) -> dict:
    """The JAX side's micro-batches of the step (its flags' segment ids), checked against the
    batch OLMo-core trained on, with OLMo-core's EMO draws."""
    train, step = run.config.train, olmo_core.step
    batch = trace.data.micro_batches(
        step - 1,
        ga_steps=train.ga_steps,
        segment_ids_from_eos=run.config.flags.olmo_segment_ids_from_eos,
    )
    if not np.array_equal(batch["inputs"].reshape(olmo_core.input_ids.shape), olmo_core.input_ids):
        raise RuntimeError(f"step {step}: OLMo-core's batch is not the JAX side's")
    return {**batch, "pool_draws": olmo_core.pool_draws}


def _placed_as(values, like):
    """`values` on the shardings of `like` (arrays in the same structure), committed where those
    are: a jitted function given either then runs the same compiled program."""
    return jax.tree.map(
        lambda value, on: jax.device_put(value, on.sharding if on.committed else None), values, like
    )


def jax_step(trace: GoldenTrace, run: Run, model, olmo_core: OlmoCoreStep) -> StepResult:
    """The JAX side's step from OLMo-core's state before it: the whole step, and its optimizer
    alone on OLMo-core's gradients (so an update is compared without the gradients' rounding,
    which Adam scales up where a gradient is near its eps), these placed as the step's own
    gradients and CE so that the step's compiled optimizer serves both. `model`: (graphdef, a
    state) of the run's model, whose values are not read."""
    cfg, step = run.config, olmo_core.step
    graphdef, template = model
    state = train_state(olmo_core.before, template, cfg, step - 1)
    batch = jax.tree.map(jnp.asarray, _micro_batches(trace, run, olmo_core))
    after, metrics, grads = take_step(run, graphdef, state, batch)
    update = parts_at(run, graphdef, step)[0].update
    golden_grads = _placed_as(
        like_params(olmo_core.result.grads, template, model_entries(cfg.model)), grads
    )
    ce = _placed_as(jnp.asarray(olmo_core.result.metrics["ce"], jnp.float32), metrics["ce"])
    alone, alone_opt, _ = update(state.params, golden_grads, state.opt_state, state.step, ce)
    alone = ts.TrainState(alone, alone_opt, state.step + 1)
    metrics = {k: np.asarray(v).tolist() for k, v in metrics.items()}
    return StepResult(_ours(grads, cfg), _state(after, cfg), metrics, _state(alone, cfg))


@dataclass(frozen=True)
class JaxSide:
    """One JAX side of a lockstep run: its `run`, its `last` step, and `on_step(olmo_core,
    ours)` after each of its steps."""

    run: Run
    last: int
    on_step: Callable[[OlmoCoreStep, StepResult], None]


def lockstep(
    trace: GoldenTrace,
    run: Run,
    *,
    steps: int,
    on_step: Callable[[OlmoCoreStep, StepResult], None],
    first: int = 1,
    overlap: bool = True,
) -> None:
    """Steps `first`..`steps` in lockstep; `on_step(olmo_core, ours)` after each, in step order.
    With `overlap`, the JAX step s and `on_step` run on their own thread beside OLMo-core's step
    s + 1 (at most one step behind; an error there stops the run at OLMo-core's next step);
    without, one after the other."""
    lockstep_sides(trace, [JaxSide(run, steps, on_step)], first=first, overlap=overlap)


def lockstep_sides(
    trace: GoldenTrace, sides: list[JaxSide], *, first: int = 1, overlap: bool = True
) -> None:
    """`lockstep` of several JAX sides against one OLMo-core run from step `first` to the last
    side's last step: at each step, every side whose `last` it has not passed steps from
    OLMo-core's state, in the order given (the injected faults share OLMo-core's steps)."""
    if first not in trace.starts or any(first > side.last for side in sides):
        raise ValueError(
            f"lockstep runs steps first..steps from one of the steps {trace.starts}, got "
            f"first={first}, steps={[side.last for side in sides]}"
        )
    models = {}
    for side in sides:
        cfg = side.run.config
        if (cfg.model, cfg.flags) not in models:
            models[cfg.model, cfg.flags] = nnx.split(
                from_olmo_core(trace.params(0), cfg.model, flags=cfg.flags)
            )

    def step(olmo_core: OlmoCoreStep) -> None:
        for side in (side for side in sides if olmo_core.step <= side.last):
            cfg = side.run.config
            ours = jax_step(trace, side.run, models[cfg.model, cfg.flags], olmo_core)
            side.on_step(olmo_core, ours)
        # A step's modules and states sit in reference cycles: freed now, not ~45 MB a step
        # later. What lives after the first step (both models, compiled code) is frozen out of
        # the collections, which then walk one step's objects (0.6 s a step -> 0.01 s).
        gc.collect()
        if olmo_core.step == first:
            gc.freeze()

    steps = max(side.last for side in sides)
    try:
        if not overlap:
            run_olmo_core(trace, steps, step, first=first)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="lockstep-jax") as jax_side:
            behind: list[Future] = []

            def hand_over(olmo_core: OlmoCoreStep) -> None:
                if behind:
                    behind.pop().result()
                behind.append(jax_side.submit(step, olmo_core))

            run_olmo_core(trace, steps, hand_over, first=first)
            if behind:
                behind.pop().result()
    finally:
        gc.unfreeze()
