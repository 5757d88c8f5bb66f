"""Running the JAX model on OLMo-core's golden trace: free-running from its step-0 weights, or
teacher-forced from each of its saved params.

Free-running: the golden step-0 weights through `model.convert.from_olmo_core`, the golden data
order, OLMo-core's EMO draws, then only the JAX optimizer moves the params. A `Run` holds the
config and, for `parity.diagnosis`, the MaxText variants that are not config: a wrapper of the
model's terms and JAX's own EMO draws.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import optim
from model import train_step as ts
from model.config import Config
from model.convert import from_olmo_core, to_olmo_core
from model.layout import make_mesh
from model.objective import model_terms_fn
from model.state import StepParts, compiled_train_step, placed, step_parts
from parity.faults import InjectedFault
from parity.trace import GoldenTrace

Metrics = dict[str, float | bool | list[float]]
"""One step's metrics as `model.train_step.train_step` reports them, as plain floats and lists."""
PoolDraws = Callable[[int, tuple[int, ...]], np.ndarray]
"""(step, shape [GA, b, MoE layers, T]) -> the EMO pool draws of that step."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The (data, fsdp, expert) mesh a run's JAX side trains on (`model.sharding`), written
    `data=D,fsdp=F,expert=E` on the command line (axes left out are 1)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1

    def __post_init__(self):
        bad = {k: v for k, v in dataclasses.asdict(self).items() if v < 1}
        if bad:
            raise ValueError(f"mesh axes must be >= 1, got {bad}")

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        sizes = {}
        for part in text.split(","):
            name, _, size = part.partition("=")
            if name not in {f.name for f in dataclasses.fields(cls)} or not size.isdigit():
                raise ValueError(f"mesh: expected data=D,fsdp=F,expert=E, got {text!r}")
            sizes[name] = int(size)
        return cls(**sizes)

    @classmethod
    def argument(cls, text: str) -> MeshShape:
        """`parse` as an argparse type: a bad mesh is a usage error."""
        try:
            return cls.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.expert

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


@dataclasses.dataclass(frozen=True)
class Run:
    """How the JAX side runs: `config` (OLMo-core's flags, or others), on `mesh` (simulated CPU
    devices; one by default). `wrap_terms` replaces the model's terms function by a variant of
    it, `draws` OLMo-core's recorded EMO draws by others (both None: OLMo-core's)."""

    config: Config
    mesh: MeshShape = MeshShape()
    wrap_terms: Callable[[ts.TermsFn], ts.TermsFn] | None = None
    draws: PoolDraws | None = None
    fault: InjectedFault | None = None
    """Tests only (`parity.faults`): a deliberate error from a given step."""


PLATFORMS = ("cpu", "tpu")
"""Where the JAX side can run: simulated CPU devices, or a TPU host's chips (OLMo-core stays on
the host's CPU either way)."""


def use_platform(platform: str, devices: int = 1) -> None:
    """Run JAX on `platform` with at least `devices` devices: on "cpu" that many simulated ones
    (unless JAX already runs with enough, e.g. under the tests); on "tpu" the host's chips, with
    JAX's CPU beside them. Exits naming what JAX has when that cannot be."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    before, wanted = jax.config.jax_platforms, "cpu" if platform == "cpu" else f"{platform},cpu"
    if before != wanted:  # read once, when the first backend starts
        jax.config.update("jax_platforms", wanted)
    if platform == "cpu" and devices > 1:
        with contextlib.suppress(RuntimeError):  # raised when the backend is up already
            jax.config.update("jax_num_cpu_devices", devices)
    try:
        found = jax.devices(platform)
    except RuntimeError as error:
        jax.config.update("jax_platforms", before)
        raise SystemExit(
            f"--platform {platform}: JAX finds no {platform} device ({error})"
        ) from None
    if len(found) < devices:
        raise SystemExit(f"a mesh of {devices} devices: JAX has {len(found)} {platform} devices")


def plain_metrics(out: dict[str, jax.Array]) -> Metrics:
    """A step's metrics as plain floats and lists."""
    return {k: np.asarray(v).tolist() for k, v in out.items()}


def run_mesh(run: Run):
    """`run`'s mesh; None for one device (JAX's default)."""
    return make_mesh(**dataclasses.asdict(run.mesh)) if run.mesh.devices > 1 else None


def _mesh_and_terms(run: Run, graphdef):
    """`run`'s mesh (None: one device) and its model's terms function."""
    mesh = run_mesh(run)
    terms = model_terms_fn(graphdef, run.config, mesh=mesh)
    return mesh, terms if run.wrap_terms is None else run.wrap_terms(terms)


@functools.cache
def _compiled(run: Run, graphdef) -> StepParts:
    """The train step's two jitted parts for `run` (its fault only where it is `in_the_trace`),
    on its mesh (`model.state.step_parts`)."""
    mesh, terms = _mesh_and_terms(run, graphdef)
    wrap = None if run.fault is None else run.fault.traced_with
    return step_parts(run.config, graphdef, mesh, terms_fn=terms, wrap_accumulate=wrap)


@functools.cache
def _whole(run: Run, graphdef):
    """The whole train step for `run` in one program on its mesh, taking over the state's
    buffers (`model.state.compiled_train_step`)."""
    mesh, terms = _mesh_and_terms(run, graphdef)
    return compiled_train_step(run.config, graphdef, mesh, terms_fn=terms, donate=True)


def parts_at(run: Run, graphdef, step: int) -> tuple[StepParts, InjectedFault | None]:
    """The train step's two jitted parts at trainer step `step` (from 1), in the config
    `run.fault` sets there, and the fault when it acts there."""
    fault = run.fault if run.fault is not None and run.fault.acts_at(step) else None
    config = run.config if fault is None else fault.config(run.config)
    traced = fault if fault is not None and fault.in_the_trace else None
    return _compiled(dataclasses.replace(run, config=config, fault=traced), graphdef), fault


def take_step(run: Run, graphdef, state: ts.TrainState, micro_batches):
    """One whole step (`model.state.StepParts`), `run.fault` acting where it says. Returns
    (state, metrics as `model.train_step.train_step` reports them, gradients before clipping)."""
    step = int(state.step) + 1  # the trainer's count: this step's number, from 1
    parts, fault = parts_at(run, graphdef, step)
    adjust = None if fault is None else (lambda grads: fault.scale_grads(grads, run.config))
    return parts(state, micro_batches, adjust_grads=adjust)


def train_step(run: Run, graphdef, state: ts.TrainState, micro_batches):
    """One step as free-running and the trainer (`parity.train`) take it: the whole step in one
    program that takes over `state`'s buffers, or, at a step where `run.fault` acts,
    `take_step`'s two parts. Returns (state, metrics)."""
    if run.fault is not None and run.fault.acts_at(int(state.step) + 1):
        return take_step(run, graphdef, state, micro_batches)[:2]
    return _whole(dataclasses.replace(run, fault=None), graphdef)(state, micro_batches)


def release_compiled() -> None:
    """Drop every compiled train step (each holds its own LLVM code)."""
    _compiled.cache_clear()
    _whole.cache_clear()
    jax.clear_caches()


def _model(trace: GoldenTrace, run: Run, step: int):
    return nnx.split(from_olmo_core(trace.params(step), run.config.model, flags=run.config.flags))


def micro_batches(trace: GoldenTrace, run: Run, step: int) -> dict[str, np.ndarray]:
    """The trace's micro-batches of `step`, with `run.draws`' EMO draws if it has them."""
    batch = trace.micro_batches(step, run.config.flags)
    if run.draws is not None:
        batch["pool_draws"] = run.draws(step, batch["pool_draws"].shape)
    return batch


def free_running(
    trace: GoldenTrace, run: Run, *, steps: int, on_step: Callable[[int, Metrics], None] = print
) -> tuple[list[Metrics], dict[int, dict[str, np.ndarray]]]:
    """Steps 1..`steps` from OLMo-core's step-0 weights. Returns each step's metrics and our
    params (as an OLMo-core state dict) at the trace's saved steps."""
    graphdef, params = _model(trace, run, 0)
    state = placed(ts.init_state(params, run.config), run.config, run_mesh(run))
    rows, saved = [], {}
    for step in range(1, steps + 1):
        state, out = train_step(run, graphdef, state, micro_batches(trace, run, step))
        rows.append(plain_metrics(out))
        if step in trace.snapshot_steps:
            saved[step] = to_olmo_core(nnx.merge(graphdef, state.params))
        on_step(step, rows[-1])
    return rows, saved


def teacher_forced(trace: GoldenTrace, run: Run, *, steps: int) -> list[tuple[int, Metrics]]:
    """For each saved step s < `steps`: step s + 1 computed from OLMo-core's params at s (LR at
    step s + 1; the metrics are those before the update). Returns [(s + 1, metrics)]."""
    out = []
    for start in (s for s in trace.snapshot_steps if s < steps):
        graphdef, params = _model(trace, run, start)
        state = ts.TrainState(params, optim.init(params, run.config), jnp.asarray(start, jnp.int32))
        _, metrics, _ = take_step(run, graphdef, state, micro_batches(trace, run, start + 1))
        out.append((start + 1, plain_metrics(metrics)))
    return out
