"""`python -m parity.diagnosis` (`olmo-parity diagnosis`): which MaxText behaviour makes the seed's
aux loss and grad norm high? Replays OLMo-core's golden trace with one behaviour at a time switched
to its MaxText form (all else OLMo-core's) and writes docs/diagnosis.md (table, plots, conclusion)
and docs/diagnosis.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.diagnosis.ablation import UnknownCandidateError, run_all
from parity.diagnosis.candidates import DEVICES
from parity.diagnosis.report import plot, report, verdict
from parity.run import use_platform
from parity.trace import load_trace


def parser(prog: str = "python -m parity.diagnosis") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps (default: the whole trace)")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder of the report")
    parser.add_argument("--only", nargs="*", default=None, help="candidate names (default: all)")
    return parser


def run(args: argparse.Namespace) -> int:
    use_platform("cpu", DEVICES)
    trace = load_trace()
    steps = trace.steps if args.steps is None else args.steps
    if not 1 <= steps <= trace.steps:
        raise SystemExit(f"--steps must lie in 1..{trace.steps}, got {steps}")
    try:
        results = run_all(trace, steps=steps, names=args.only)
    except UnknownCandidateError as error:
        raise SystemExit(f"--only: {error}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnosis.md").write_text(report(trace, results, steps=steps))
    plot(results, args.out / "diagnosis.png")
    kept = [
        {"name": r.name, "what": r.what, "gaps": r.gaps, "verdict": verdict(r)} for r in results
    ]
    (args.out / "diagnosis.json").write_text(
        json.dumps({"steps": steps, "candidates": kept}, indent=1)
    )
    print(f"wrote {args.out / 'diagnosis.md'}, diagnosis.png and diagnosis.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
