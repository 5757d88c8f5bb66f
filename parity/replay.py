"""`python -m parity.replay` (`olmo-parity replay`): train the JAX model step for step on
OLMo-core's golden trace and compare every step.

Free-running (`parity.run`): the golden step-0 weights, the golden data order, OLMo-core's EMO
draws and every OLMo-core flag; then only the JAX optimizer moves the params. Each step's CE,
z-loss, LB and router z-loss (total and per MoE block), LR, grad norm and skip flag are compared
with the trace, and each parameter tensor at the trace's saved steps with its snapshots
(`parity.compare`: the issue's bars, or OLMo-core's own one-ulp spread times a factor).

`--teacher-forced` adds a second view, reported separately: each saved step s restarts from
OLMo-core's params at s and is compared at step s + 1 with the issue's bars alone.
`--flags maxtext` runs with every flag at MaxText's default (the golden data order stays: the
replay needs OLMo-core's batches to compare anything), to show what the seed fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from model.config import Config, Flags
from parity import report
from parity.compare import compare_step, free_running_record, teacher_forced_record
from parity.records import StepCheck
from parity.run import Metrics, Run, free_running, teacher_forced, use_devices
from parity.trace import load_trace


def maxtext_config(config: Config) -> Config:
    """`config` with every flag at MaxText's default but the golden data order."""
    return dataclasses.replace(
        config, flags=Flags(olmo_global_indices_path=config.flags.olmo_global_indices_path)
    )


def parser(prog: str = "python -m parity.replay") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
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


def run(args: argparse.Namespace) -> int:
    """Run the replay, print the tables and the verdict, write replay.json and replay.png.
    Returns the exit code: 0 when every step is within tolerance, 1 otherwise."""
    use_devices(args.devices)
    trace = load_trace()
    steps = trace.steps if args.steps is None else args.steps
    if not 1 <= steps <= trace.steps:
        raise SystemExit(
            f"--steps must lie in 1..{trace.steps} (the golden trace's steps), got {steps}"
        )
    if args.window < 1:
        raise SystemExit(f"--window must be >= 1, got {args.window}")
    config = trace.config if args.flags == "olmo_core" else maxtext_config(trace.config)
    setup = Run(config, devices=args.devices)
    console = Console()
    console.print(
        f"Replaying {steps} steps of OLMo-core's trace (micro config, GA {config.train.ga_steps}, "
        f"flags {args.flags}, {args.devices} device(s)); the first step compiles."
    )
    window: list[StepCheck] = []
    columns = (BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[gap]}"))
    with Progress(
        TextColumn("{task.description}"), *columns, TimeRemainingColumn(), console=console
    ) as progress:
        task = progress.add_task("replay", total=steps, gap="")

        def on_step(step: int, row: Metrics) -> None:
            check = compare_step(trace, step, row, free=True)
            window.append(check)
            progress.update(task, advance=1, gap=f"CE gap {check.metrics['ce'].rel_gap:.1e}")
            if len(window) == args.window or step == steps:
                title = f"steps {window[0].step}-{step}"
                progress.console.print(report.window_table(window, title=title))
                window.clear()

        rows, params = free_running(trace, setup, steps=steps, on_step=on_step)
    record = free_running_record(trace, rows, params, flags=args.flags)
    for check in record.params:
        console.print(report.params_line(check))
    console.print(report.verdict(record, what="free-running"))
    if args.teacher_forced:
        forced = teacher_forced_record(trace, teacher_forced(trace, setup, steps=steps))
        for check in forced.steps:
            console.print(report.window_table([check], title=f"teacher-forced step {check.step}"))
        console.print(report.verdict(forced, what="teacher-forced"))
        record = dataclasses.replace(record, teacher_forced=forced)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.json").write_text(json.dumps(record.to_json(), indent=1))
    report.plot(record, args.out / "replay.png")
    console.print(f"wrote {args.out / 'replay.json'} and {args.out / 'replay.png'}")
    forced_ok = record.teacher_forced is None or record.teacher_forced.passed
    return 0 if record.passed and forced_ok else 1


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
