"""`python -m bench [name ...]`: run the benchmarks (all by default) and print their figures.
Like the tests, benchmarks see 8 simulated CPU devices."""

import argparse
import importlib
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from rich.console import Console
from rich.table import Table

BENCHES = {
    "rms_norm": "bench.rms_norm",
    "kda_inverse": "bench.kda_inverse",
    "memory": "bench.memory",
    "step": "bench.step",
}


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
    table, closing = Table("bench", "figure", "value"), []
    for name in names:
        bench = importlib.import_module(BENCHES[name])
        figures = bench.run()
        for figure, value in figures.items():
            table.add_row(name, figure, f"{value:.3g}")
        if hasattr(bench, "summary"):
            closing += bench.summary(figures)
    Console().print(table)
    print("\n".join(closing))


if __name__ == "__main__":
    main()
