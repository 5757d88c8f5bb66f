"""`python -m parity.replay` (`olmo-parity replay`): hold the JAX train step to OLMo-core's,
step by step, in one of three views (`--view`), each reported on its own.

lockstep (default, `parity.lockstep`): OLMo-core's own train module trains beside the JAX step;
every step both start from OLMo-core's state (params, Adam moments, skip history) and the same
batch and EMO draws, and every metric, MoE layer, gradient, update and moment is compared with
tolerances measured for one step (`parity.lockstep_check`). Runs past the trace's 50 steps, up to
the data's first epoch, or from a saved training state of the trace (`--from-step`); the JAX step
runs beside OLMo-core's next one unless `--sequential`. OLMo-core's metrics are also checked
against the golden trace: bit for bit where this CPU reproduces it, within its envelope elsewhere.

free-running (`parity.run`): from OLMo-core's step-0 weights only the JAX optimizer moves the
params; each step's metrics are compared with the trace, and each parameter tensor at the saved
steps (`parity.compare`: the issue's bars, or OLMo-core's own one-ulp spread times a factor).

teacher-forced: each saved step s restarts from OLMo-core's params at s and is compared at step
s + 1 with the issue's bars alone.

`--flags maxtext` runs with every flag at MaxText's default (the golden data order stays: the
replay needs OLMo-core's batches to compare anything), to show what the seed fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from goldens.trace import process_group_backend
from model.config import MATMUL_PRECISIONS, Config, Flags
from model.kernels import step_kernels
from model.precision import matmul_precision
from parity import report
from parity.compare import compare_step, free_running_record, teacher_forced_record
from parity.lockstep import lockstep
from parity.lockstep_check import check_step, lockstep_record, over_tolerance
from parity.records import LockstepStep
from parity.run import (
    PLATFORMS,
    MeshShape,
    Metrics,
    Run,
    free_running,
    teacher_forced,
    use_platform,
)
from parity.tpu_runtime import TRANSCENDENTALS, use_transcendentals
from parity.trace import GoldenTrace, load_trace


def maxtext_config(config: Config) -> Config:
    """`config` with every flag at MaxText's default but the golden data order."""
    return dataclasses.replace(
        config, flags=Flags(olmo_global_indices_path=config.flags.olmo_global_indices_path)
    )


def parser(prog: str = "python -m parity.replay") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--view",
        choices=list(VIEWS),
        default="lockstep",
        help="lockstep (default): OLMo-core beside us, every step from its state; free-running: "
        "our own optimizer from its step-0 weights; teacher-forced: from its saved params",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the last step (default: the trace's 50; lockstep may run to the end of the data's "
        "epoch)",
    )
    parser.add_argument(
        "--from-step",
        type=int,
        default=1,
        help="lockstep: start at this step, OLMo-core from the trace's saved training state "
        "before it (1, the default, 10 or 50)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="lockstep: OLMo-core's step and the JAX step one after the other (default: the JAX "
        "step s on a thread beside OLMo-core's step s + 1)",
    )
    parser.add_argument(
        "--flags",
        choices=("olmo_core", "maxtext"),
        default="olmo_core",
        help="every parity flag at OLMo-core's (default) or at MaxText's defaults",
    )
    parser.add_argument("--out", type=Path, default=Path("replay"), help="folder for the record")
    parser.add_argument("--window", type=int, default=10, help="steps per reporting window")
    parser.add_argument(
        "--mesh",
        type=MeshShape.argument,
        default=MeshShape(),
        help="data=D,fsdp=F,expert=E: train the JAX side on D x F x E devices (simulated CPU "
        "ones, or --platform's), rows over all, weights over fsdp, routed experts over expert "
        "(default: one device)",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cpu",
        help="where the JAX side runs: this CPU (default) or a TPU host's chips; OLMo-core always "
        "runs on the CPU",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=MATMUL_PRECISIONS,
        default=None,
        help="the JAX side's matmul precision (ScaleConfig.matmul_precision; default: highest, "
        "float32's)",
    )
    parser.add_argument(
        "--tpu-transcendentals",
        choices=TRANSCENDENTALS,
        default=None,
        help="with --platform tpu: the chip's float32 exp, log, pow and sigmoid, libtpu's "
        "accurate ones (default; a CPU's 1-3 ulps) or its default ones (up to 4,000 ulps; "
        "parity.tpu_runtime)",
    )
    return parser


def _steps(args: argparse.Namespace, trace: GoldenTrace) -> int:
    most = trace.data.num_batches if args.view == "lockstep" else trace.steps
    steps = trace.steps if args.steps is None else args.steps
    if not args.from_step <= steps <= most:
        what = "the data's first epoch" if args.view == "lockstep" else "the golden trace's steps"
        raise SystemExit(
            f"--steps must lie in {args.from_step}..{most} ({what}) for {args.view}, got {steps}"
        )
    return steps


def _lockstep_options(args: argparse.Namespace, trace: GoldenTrace) -> None:
    """Exits naming the option when --from-step or --sequential cannot be."""
    if args.view != "lockstep":
        for given, option in (
            (args.from_step != 1, "--from-step"),
            (args.sequential, "--sequential"),
        ):
            if given:
                raise SystemExit(f"{option} is lockstep's, not {args.view}'s")
    if args.from_step not in trace.starts:
        raise SystemExit(
            f"--from-step must be one of {list(trace.starts)} (the trace keeps OLMo-core's "
            f"training state after steps {list(trace.state_steps)}), got {args.from_step}"
        )


def _progress(console: Console) -> Progress:
    columns = (BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[gap]}"))
    return Progress(
        TextColumn("{task.description}"), *columns, TimeRemainingColumn(), console=console
    )


def _windows(window: int, steps: int, progress: Progress, task, table) -> Callable:
    """A step callback: advance the bar, print `table(checks, title)` every `window` steps."""
    pending: list = []

    def add(check, gap: str) -> None:
        pending.append(check)
        progress.update(task, advance=1, gap=gap)
        if len(pending) == window or check.step == steps:
            progress.console.print(table(pending, title=f"steps {pending[0].step}-{check.step}"))
            pending.clear()

    return add


def _lockstep(args, trace: GoldenTrace, setup: Run, steps: int, console: Console):
    checks: list[LockstepStep] = []
    with _progress(console) as progress:
        task = progress.add_task("lockstep", total=steps - args.from_step + 1, gap="")
        add = _windows(args.window, steps, progress, task, report.lockstep_table)

        def on_step(olmo_core, ours) -> None:
            check = check_step(trace, olmo_core, ours)
            checks.append(check)
            over = over_tolerance(trace, check, checks[:-1])
            for line in report.failing_step(check, over):
                progress.console.print(line)
            add(check, f"CE gap {check.metrics['ce'].rel_gap:.1e}")

        lockstep(
            trace,
            setup,
            steps=steps,
            on_step=on_step,
            first=args.from_step,
            overlap=not args.sequential,
        )
    record = lockstep_record(trace, checks)
    console.print(report.lockstep_verdict(record))
    report.plot_lockstep(record, args.out / "replay.png")
    return record


def _free_running(args, trace: GoldenTrace, setup: Run, steps: int, console: Console):
    with _progress(console) as progress:
        task = progress.add_task("replay", total=steps, gap="")
        add = _windows(args.window, steps, progress, task, report.window_table)

        def on_step(step: int, row: Metrics) -> None:
            check = compare_step(trace, step, row, free=True)
            add(check, f"CE gap {check.metrics['ce'].rel_gap:.1e}")

        rows, params = free_running(trace, setup, steps=steps, on_step=on_step)
    record = free_running_record(trace, rows, params, flags=args.flags)
    for check in record.params:
        console.print(report.params_line(check))
    console.print(report.verdict(record, what="free-running"))
    report.plot(record, args.out / "replay.png")
    return record


def _teacher_forced(args, trace: GoldenTrace, setup: Run, steps: int, console: Console):
    record = teacher_forced_record(trace, teacher_forced(trace, setup, steps=steps))
    for check in record.steps:
        console.print(report.window_table([check], title=f"teacher-forced step {check.step}"))
    console.print(report.verdict(record, what="teacher-forced"))
    return record


VIEWS = {"lockstep": _lockstep, "free-running": _free_running, "teacher-forced": _teacher_forced}


def _transcendentals(args: argparse.Namespace) -> str | None:
    """--tpu-transcendentals on a TPU ("accurate" unless given), None elsewhere."""
    if args.platform != "tpu":
        if args.tpu_transcendentals is not None:
            raise SystemExit(f"--tpu-transcendentals needs --platform tpu, not {args.platform}")
        return None
    return args.tpu_transcendentals or "accurate"


def run(args: argparse.Namespace) -> int:
    """Run the view, print its tables and verdict, write replay.json (and replay.png, but for
    the teacher-forced view). Returns the exit code: 0 when every step is within tolerance."""
    if args.window < 1:
        raise SystemExit(f"--window must be >= 1, got {args.window}")
    transcendentals = _transcendentals(args)
    if transcendentals is not None:
        use_transcendentals(transcendentals)
    use_platform(args.platform, args.mesh.devices)
    trace = load_trace()
    _lockstep_options(args, trace)
    steps = _steps(args, trace)
    config = trace.config if args.flags == "olmo_core" else maxtext_config(trace.config)
    scale = dataclasses.replace(config.scale, matmul_precision=args.matmul_precision)
    config = dataclasses.replace(config, scale=scale)
    device = jax.devices(args.platform)[0].device_kind
    precision = matmul_precision(config)
    console = Console()
    on_tpu = f", {transcendentals} transcendentals" if transcendentals else ""
    which = f"steps {args.from_step}-{steps}" if args.from_step > 1 else f"{steps} steps"
    console.print(
        f"{args.view}: {which} of OLMo-core's micro config (GA {config.train.ga_steps}, "
        f"flags {args.flags}, mesh {args.mesh}, JAX on {device} at matmul precision "
        f"{precision}{on_tpu}); the first step compiles."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    record = VIEWS[args.view](args, trace, Run(config, mesh=args.mesh), steps, console)
    written = record.to_json() | {
        "mesh": dataclasses.asdict(args.mesh),
        "platform": args.platform,
        "device": device,
        "matmul_precision": precision,
        "tpu_transcendentals": transcendentals,
        "kernels": dataclasses.asdict(step_kernels(config, args.platform)),
    }
    if args.view == "lockstep":
        written["olmo_core_process_group"] = process_group_backend()
    (args.out / "replay.json").write_text(json.dumps(written, indent=1))
    console.print(f"wrote {args.out / 'replay.json'}")
    return 0 if record.passed else 1


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
