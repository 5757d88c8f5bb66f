"""`python -m bench [name ...]`: run the benchmarks (all by default) and print their figures.
The CPU is split into as many simulated devices as the most any named benchmark needs: one, the
real CPU, unless `memory` (8) is among them."""

import argparse
import importlib
import os

from rich.console import Console
from rich.table import Table

BENCHES = {
    "rms_norm": ("bench.rms_norm", 1),
    "kda_inverse": ("bench.kda_inverse", 1),
    "memory": ("bench.memory", 8),
    "step": ("bench.step", 1),
}
"""name: (module, simulated CPU devices it needs)."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "names",
        nargs="*",
        choices=[[], *BENCHES],
        metavar="name",
        help=f"any of {', '.join(BENCHES)} (default: all)",
    )
    names = parser.parse_args().names or list(BENCHES)
    devices = max(BENCHES[name][1] for name in names)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    table, closing = Table("bench", "figure", "value"), []
    for name in names:
        bench = importlib.import_module(BENCHES[name][0])
        figures = bench.run()
        for figure, value in figures.items():
            table.add_row(name, figure, f"{value:.3g}")
        if hasattr(bench, "summary"):
            closing += bench.summary(figures)
    Console().print(table)
    print("\n".join(closing))


if __name__ == "__main__":
    main()
