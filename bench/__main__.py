"""`python -m bench [name ...] [--record PATH]`: run the benchmarks (all those for this CPU by
default) and print their figures; `--record` also writes them as JSON. The CPU is split into as
many simulated devices as the most any named benchmark needs: one, the real CPU, unless `memory`
(8) is among them. `tpu-step`, `tpu-train` and `tpu-profile` run on a TPU host only, when named."""

import argparse
import importlib
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCHES = {
    "rms_norm": ("bench.rms_norm", 1),
    "kda_inverse": ("bench.kda_inverse", 1),
    "memory": ("bench.memory", 8),
    "step": ("bench.step", 1),
    "tpu-step": ("bench.tpu_step", 1),
    "tpu-train": ("bench.tpu_train", 1),
    "tpu-profile": ("bench.tpu_profile", 1),
}
"""name: (module, simulated CPU devices it needs)."""
ON_A_TPU_HOST = ("tpu-step", "tpu-train", "tpu-profile")
"""Left out unless named."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "names",
        nargs="*",
        choices=[[], *BENCHES],
        metavar="name",
        help=f"any of {', '.join(BENCHES)} (default: all but {', '.join(ON_A_TPU_HOST)})",
    )
    parser.add_argument("--record", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    names = args.names or [name for name in BENCHES if name not in ON_A_TPU_HOST]
    devices = max(BENCHES[name][1] for name in names)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    table, closing, record = Table("bench", "figure", "value"), [], {}
    for name in names:
        bench = importlib.import_module(BENCHES[name][0])
        figures = record[name] = bench.run()
        for figure, value in figures.items():
            table.add_row(name, figure, f"{value:.3g}")
        if hasattr(bench, "summary"):
            closing += bench.summary(figures)
    Console().print(table)
    print("\n".join(closing))
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
