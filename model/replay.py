"""`python -m model.replay` (`olmo-parity-replay`): train the JAX model step for step on OLMo-core's
golden trace and compare every step.

Free-running: the golden step-0 weights through `model.convert.from_olmo_core`, the golden data
order, OLMo-core's EMO draws, every OLMo-core flag, then only the JAX optimizer moves the params.
Each step's CE, z-loss, LB and router z-loss (total and per MoE block), LR, grad norm and skip flag
are compared with the trace, and each parameter tensor at the trace's saved steps with its
snapshots. A metric (each MoE layer's LB and router z-loss too) passes a step when its relative gap
is within the issue's bar (`REPLAY_CE`, `REPLAY_METRIC`, `REPLAY_PARAMS`) or within
`REPLAY_SPREAD_FACTOR` times the spread OLMo-core shows against itself when its step-0 weights move
by one ulp (goldens.envelope: that metric's or layer's largest gap up to that step, that tensor's
distance at that step).

`--teacher-forced` adds a second view, reported separately: each saved step s restarts from
OLMo-core's params at s and is compared at step s + 1 with the issue's bars alone.
`--flags maxtext` runs with every flag at MaxText's default (the golden data order stays: the
replay needs OLMo-core's batches to compare anything), to show what the seed fixed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from goldens.envelope import metric_spread, norm_gap, param_spread, rel_gap
from goldens.tolerances import REPLAY_CE, REPLAY_METRIC, REPLAY_PARAMS, REPLAY_SPREAD_FACTOR
from model import optim
from model import train_step as ts
from model.config import Config, Flags
from model.convert import from_olmo_core, to_olmo_core
from model.golden_trace import METRICS, PER_LAYER, GoldenTrace, load_trace
from model.objective import model_terms_fn
from model.router import draw_pools, set_logits_dtype
from model.sharding import make_mesh

BARS = {name: REPLAY_CE if name == "ce" else REPLAY_METRIC for name in METRICS}
DRAWS = ("olmo_core", "jax")
DRAW_SEED = 2026
"""`Run.draws == "jax"`: step s draws from `fold_in(key(DRAW_SEED), s)`."""


@dataclasses.dataclass(frozen=True)
class Run:
    """How the JAX side runs. The defaults are OLMo-core's; the others are the MaxText
    behaviours `model.diagnosis` measures one at a time."""

    config: Config
    devices: int = 1
    """Data devices; the routed MoE runs in `shard_map` over them when > 1."""
    ga_reporting: str = "batch"
    """`model.train_step.accumulate`'s."""
    aux_loss_div: str = "batch_labels"
    """`model.objective.model_terms_fn`'s."""
    router_logits_dtype: str = "float32"
    """`model.router.set_logits_dtype`'s."""
    draws: str = "olmo_core"
    """EMO pool draws: OLMo-core's recorded ones, or "jax": the same distribution drawn with
    `model.router.draw_pools` from a JAX key per step (other values)."""

    def __post_init__(self):
        if self.draws not in DRAWS:
            raise ValueError(f"Run.draws must be one of {DRAWS}, got {self.draws!r}")
        if self.devices < 1:
            raise ValueError(f"Run.devices must be >= 1, got {self.devices}")


def maxtext_config(config: Config) -> Config:
    """`config` with every flag at MaxText's default but the golden data order."""
    return dataclasses.replace(
        config, flags=Flags(olmo_global_indices_path=config.flags.olmo_global_indices_path)
    )


def _metrics(out: dict[str, Any]) -> dict[str, Any]:
    """A train step's metrics as plain floats and lists."""
    return {k: np.asarray(v).tolist() for k, v in out.items()}


@functools.cache
def _step_fn(run: Run, graphdef):
    mesh = make_mesh(data=run.devices) if run.devices > 1 else None
    terms = model_terms_fn(graphdef, run.config, mesh=mesh, aux_loss_div=run.aux_loss_div)
    return jax.jit(
        functools.partial(
            ts.train_step, cfg=run.config, terms_fn=terms, ga_reporting=run.ga_reporting
        )
    )


def release_compiled() -> None:
    """Drop every compiled train step (each holds its own LLVM code)."""
    _step_fn.cache_clear()
    jax.clear_caches()


def _model(trace: GoldenTrace, run: Run, step: int):
    model = from_olmo_core(trace.params(step), run.config.model, flags=run.config.flags)
    set_logits_dtype(model, run.router_logits_dtype)
    return nnx.split(model)


def micro_batches(trace: GoldenTrace, run: Run, step: int) -> dict[str, np.ndarray]:
    """The trace's micro-batches of `step`, with JAX's own EMO draws when `run.draws` says so."""
    batch = trace.micro_batches(step, run.config.flags)
    if run.draws == "jax":
        key = jax.random.fold_in(jax.random.key(DRAW_SEED), step)
        shape = batch["pool_draws"].shape  # [GA, b, MoE layers, T]
        flat = draw_pools(key, (int(np.prod(shape[:-1])), shape[-1]), emo=run.config.model.moe.emo)
        batch["pool_draws"] = np.asarray(flat).reshape(shape)
    return batch


def free_running(
    trace: GoldenTrace, run: Run, *, steps: int, on_step: Callable[[int, dict], None] = print
) -> tuple[list[dict], dict[int, dict[str, np.ndarray]]]:
    """Steps 1..`steps` from OLMo-core's step-0 weights. Returns each step's metrics and our
    params (as an OLMo-core state dict) at the trace's saved steps."""
    graphdef, params = _model(trace, run, 0)
    step_fn = _step_fn(run, graphdef)
    state = ts.init_state(params, run.config)
    rows, saved = [], {}
    for step in range(1, steps + 1):
        state, out = step_fn(state, micro_batches(trace, run, step))
        rows.append(_metrics(out))
        if step in trace.snapshot_steps:
            saved[step] = to_olmo_core(nnx.merge(graphdef, state.params))
        on_step(step, rows[-1])
    return rows, saved


def teacher_forced(trace: GoldenTrace, run: Run, *, steps: int) -> list[tuple[int, dict]]:
    """For each saved step s < `steps`: step s + 1 computed from OLMo-core's params at s (LR at
    step s + 1; the metrics are those before the update). Returns [(s + 1, metrics)]."""
    out = []
    for start in (s for s in trace.snapshot_steps if s < steps):
        graphdef, params = _model(trace, run, start)
        state = ts.TrainState(params, optim.init(params, run.config), jnp.asarray(start, jnp.int32))
        _, metrics = _step_fn(run, graphdef)(state, micro_batches(trace, run, start + 1))
        out.append((start + 1, _metrics(metrics)))
    return out


# --- comparison -------------------------------------------------------------------------------


def spread(trace: GoldenTrace, name: str) -> np.ndarray:
    """[steps, ...]: OLMo-core's own spread of metric `name` (or "<name>_per_block") up to each
    step: the largest relative gap of its one-ulp-perturbed runs to the trace."""
    return metric_spread(trace.perturbed[name], trace.metrics[name])


def _checked(ours, golden, own, bar: float) -> dict:
    """ours/golden/rel_gap/spread/tolerance/ok of a metric (a float, or a list per layer): within
    `bar` or `REPLAY_SPREAD_FACTOR` times OLMo-core's own spread."""
    gap = rel_gap(ours, golden)
    tol = np.maximum(bar, REPLAY_SPREAD_FACTOR * np.asarray(own))
    ok = gap <= tol
    plain = lambda a: np.asarray(a).tolist()  # noqa: E731
    return {
        "ours": ours,
        "golden": plain(golden),
        "rel_gap": plain(gap),
        "spread": plain(own),
        "tolerance": plain(tol),
        "ok": plain(ok),
    }


def _worst_layer(trace: GoldenTrace, layers: dict) -> int:
    """OLMo-core block index of the MoE layer whose LB or router z-loss is farthest over (or
    nearest) its tolerance."""
    over = np.max([np.divide(layers[n]["rel_gap"], layers[n]["tolerance"]) for n in PER_LAYER], 0)
    return trace.moe_blocks[int(np.argmax(over))]


def compare_step(trace: GoldenTrace, step: int, ours: dict, *, free: bool) -> dict:
    """One step's record: every metric and each MoE layer's LB and router z-loss
    ours/golden/rel_gap/spread (OLMo-core's own up to this step; 0 unless `free`)/tolerance/ok,
    and the skip flags."""
    i = step - 1
    own = lambda key: spread(trace, key)[i] if free else np.zeros_like(trace.metrics[key][i])  # noqa: E731
    metrics = {
        name: _checked(ours[name], float(trace.metrics[name][i]), float(own(name)), BARS[name])
        for name in METRICS
    }
    layers = {
        name: _checked(
            ours[f"{name}_per_layer"],
            trace.metrics[f"{name}_per_block"][i],
            own(f"{name}_per_block"),
            BARS[name],
        )
        for name in PER_LAYER
    }
    skipped = {"ours": bool(ours["skipped"]), "golden": bool(trace.metrics["skipped"][i])}
    return {"step": step, "metrics": metrics, "layers": layers, "skipped": skipped}


def _divergence(trace: GoldenTrace, entry: dict) -> dict | None:
    """The first metric over its tolerance at this step (totals first, then each MoE layer's
    "<name>_per_layer"), the skip flag, and the MoE block farthest over."""
    bad = [name for name in METRICS if not entry["metrics"][name]["ok"]]
    bad += [f"{n}_per_layer" for n in PER_LAYER if not all(entry["layers"][n]["ok"])]
    if entry["skipped"]["ours"] != entry["skipped"]["golden"]:
        bad.append("skipped")
    if not bad:
        return None
    return {"step": entry["step"], "metric": bad[0], "layer": _worst_layer(trace, entry["layers"])}


def compare_params(trace: GoldenTrace, step: int, ours: dict[str, np.ndarray]) -> dict:
    """Each parameter tensor's |ours - golden| / |golden| at a saved step against
    max(REPLAY_PARAMS, REPLAY_SPREAD_FACTOR x its own spread: the farthest perturbed run's
    distance for that tensor); the whole model's gap for reference."""
    golden = trace.params(step)
    names = trace.param_names
    gaps = np.array([norm_gap(ours[n], golden[n]) for n in names])
    own = param_spread(trace.perturbed[f"params_rel_diff_step{step}"])
    tol = np.maximum(REPLAY_PARAMS, REPLAY_SPREAD_FACTOR * own)
    worst = int(np.argmax(gaps / tol))
    whole = norm_gap(
        np.concatenate([np.ravel(ours[n]) for n in names]),
        np.concatenate([np.ravel(golden[n]) for n in names]),
    )
    return {
        "step": step,
        "rel_gap": whole,
        "ok": bool(np.all(gaps <= tol)),
        "over": [names[i] for i in np.flatnonzero(gaps > tol)],
        "worst": names[worst],
        "worst_rel_gap": float(gaps[worst]),
        "worst_spread": float(own[worst]),
        "worst_tolerance": float(tol[worst]),
        "tensors": {
            n: {"rel_gap": float(g), "spread": float(o), "tolerance": float(t)}
            for n, g, o, t in zip(names, gaps, own, tol, strict=True)
        },
    }


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def record(trace: GoldenTrace, rows: list[dict], params: dict, *, flags: str) -> dict:
    """The `replay.json` record of a free-running replay."""
    steps = [compare_step(trace, i + 1, row, free=True) for i, row in enumerate(rows)]
    checks = [compare_params(trace, s, params[s]) for s in sorted(params)]
    first = None
    for entry in steps:
        saved = [p for p in checks if p["step"] == entry["step"] and not p["ok"]]
        first = _divergence(trace, entry)
        if first is None and saved:
            first = {
                "step": entry["step"],
                "metric": "params",
                "layer": _block_of(saved[0]["worst"]),
            }
        if first is not None:
            break
    return {
        "flags": flags,
        "steps": steps,
        "params": checks,
        "passed": first is None,
        "first_divergence": first,
        "tolerances": {
            "bars": BARS,
            "params": REPLAY_PARAMS,
            "spread_factor": REPLAY_SPREAD_FACTOR,
        },
    }


def teacher_forced_record(trace: GoldenTrace, results: list[tuple[int, dict]]) -> dict:
    steps = [compare_step(trace, step, row, free=False) for step, row in results]
    first = next((d for d in (_divergence(trace, e) for e in steps) if d is not None), None)
    return {"steps": steps, "passed": first is None, "first_divergence": first}


# --- command line -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model.replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=None, help="steps to replay (default: all)")
    parser.add_argument(
        "--flags",
        choices=("olmo_core", "maxtext"),
        default="olmo_core",
        help="every parity flag at OLMo-core's (default) or at MaxText's defaults",
    )
    parser.add_argument("--out", type=Path, default=Path("replay"), help="folder for the record")
    parser.add_argument("--window", type=int, default=10, help="steps per reporting window")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="simulated CPU data devices; the routed MoE runs in shard_map over them",
    )
    parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="also restart from each of OLMo-core's saved params (reported separately)",
    )
    return parser


def _use_devices(n: int) -> None:
    """Simulate n CPU devices, unless JAX already runs with enough (e.g. under the tests)."""
    if n <= 1:
        return
    with contextlib.suppress(RuntimeError):  # raised when the backend is up already
        jax.config.update("jax_num_cpu_devices", n)
    if len(jax.devices()) < n:
        raise SystemExit(f"--devices {n}: JAX has {len(jax.devices())} devices")


def main(argv: list[str] | None = None) -> int:
    """Run the replay, print the tables and the verdict, write replay.json and replay.png.
    Returns the exit code: 0 when every step is within tolerance, 1 otherwise."""
    import json

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from model import replay_report

    args = _parser().parse_args(argv)
    _use_devices(args.devices)
    trace = load_trace()
    steps = trace.steps if args.steps is None else args.steps
    if not 1 <= steps <= trace.steps:
        raise SystemExit(
            f"--steps must lie in 1..{trace.steps} (the golden trace's steps), got {steps}"
        )
    if args.window < 1:
        raise SystemExit(f"--window must be >= 1, got {args.window}")
    config = trace.config if args.flags == "olmo_core" else maxtext_config(trace.config)
    run = Run(config, devices=args.devices)
    console = Console()
    console.print(
        f"Replaying {steps} steps of OLMo-core's trace (micro config, GA {config.train.ga_steps}, "
        f"flags {args.flags}, {args.devices} device(s)); the first step compiles."
    )
    window: list[dict] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[gap]}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("replay", total=steps, gap="")

        def on_step(step: int, row: dict) -> None:
            entry = compare_step(trace, step, row, free=True)
            window.append(entry)
            progress.update(task, advance=1, gap=f"CE gap {entry['metrics']['ce']['rel_gap']:.1e}")
            if len(window) == args.window or step == steps:
                title = f"steps {window[0]['step']}-{step}"
                progress.console.print(replay_report.window_table(window, title=title))
                window.clear()

        rows, params = free_running(trace, run, steps=steps, on_step=on_step)
    result = record(trace, rows, params, flags=args.flags)
    for check in result["params"]:
        console.print(replay_report.params_line(check))
    console.print(replay_report.verdict(result, what="free-running"))
    passed = result["passed"]
    if args.teacher_forced:
        forced = teacher_forced_record(trace, teacher_forced(trace, run, steps=steps))
        for entry in forced["steps"]:
            console.print(
                replay_report.window_table([entry], title=f"teacher-forced step {entry['step']}")
            )
        console.print(replay_report.verdict(forced, what="teacher-forced"))
        result["teacher_forced"] = forced
        passed = passed and forced["passed"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.json").write_text(json.dumps(result, indent=1))
    replay_report.plot(result, args.out / "replay.png")
    console.print(f"wrote {args.out / 'replay.json'} and {args.out / 'replay.png'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
