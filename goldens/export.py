"""`python -m goldens.export [component ...] [--out DIR]`: run OLMo-core 3.0.0 on this CPU and write
the goldens of the named components (all by default) with their manifest entries.

Deterministic: single-threaded torch, deterministic algorithms, a fixed seed per component, no
timestamps; exporting twice on one machine gives identical bytes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from goldens.source import exporter_source
from goldens.store import (
    GOLDENS_DIR,
    PINNED_VERSIONS,
    GoldenFile,
    recording_inputs,
    write_golden,
)

COMPONENTS: dict[str, str] = {
    "rms_norm": "goldens.norms",
    "kda": "goldens.kda",
    "kda_trained": "goldens.kda_trained",
    "data": "goldens.data",
    "segment_ids": "goldens.segment_ids",
    "attention": "goldens.attention",
    "router": "goldens.router",
    "moe": "goldens.moe",
    "optim": "goldens.optim",
    "loss": "goldens.loss",
    "trace": "goldens.trace",
    "oracle": "goldens.oracle",
}
"""Component name -> module whose `export()` returns its `GoldenFile`s. A component comes after
the goldens it reads (the oracles read the trace's params and the data's tokens), so that
exporting everything into goldens/ records the inputs' new sha256."""

RECORDED_PACKAGES = (*PINNED_VERSIONS, "numpy", "safetensors")


def installed_versions() -> dict[str, str]:
    """Versions of the exporter's packages, local tags dropped (torch 2.13.0+cpu -> 2.13.0)."""
    return {p: importlib.metadata.version(p).split("+")[0] for p in RECORDED_PACKAGES}


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
"""/proc/cpuinfo flags that change which float kernels torch picks."""


def machine() -> dict[str, str]:
    """The CPU a golden is made on: its model name, the kernel ISA torch dispatches to
    (`torch.backends.cpu.get_cpu_capability`), its SIMD flags, and the world-size-1 process group
    torch.distributed gets there (`goldens.trace.process_group_backend`)."""
    import platform

    import torch

    from goldens.trace import process_group_backend

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line and line.strip())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", platform.processor() or platform.machine()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "simd": " ".join(f for f in SIMD_FLAGS if f in flags),
        "process_group": process_group_backend(),
    }


def make_torch_deterministic() -> None:
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def exporter(component: str) -> Callable[[], list[GoldenFile]]:
    return importlib.import_module(COMPONENTS[component]).export


def export(components: Sequence[str], out: Path) -> list[str]:
    """Export `components` into `out`; returns the written paths."""
    versions = installed_versions()
    wrong = {p: v for p, v in versions.items() if p in PINNED_VERSIONS and v != PINNED_VERSIONS[p]}
    if wrong:
        raise SystemExit(
            f"goldens.export: installed {wrong}, pinned {PINNED_VERSIONS}; run it through "
            "`tox -e goldens`, which installs the pinned versions"
        )
    make_torch_deterministic()
    cpu = machine()
    written = []
    for component in components:
        with recording_inputs() as inputs:
            goldens = exporter(component)()
        source = exporter_source(COMPONENTS[component])
        for golden in goldens:
            write_golden(
                golden,
                command=f"python -m goldens.export {component}",
                versions=versions,
                machine=cpu,
                inputs=inputs,
                source=source,
                root=out,
            )
            written.append(golden.path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m goldens.export", description=__doc__)
    parser.add_argument(
        "components",
        nargs="*",
        choices=[[], *COMPONENTS],
        metavar="component",
        help=f"any of {', '.join(COMPONENTS)} (default: all)",
    )
    parser.add_argument(
        "--out", type=Path, default=GOLDENS_DIR, help="directory to write into (default: goldens/)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in export(args.components or list(COMPONENTS), args.out):
        print(f"wrote {args.out / path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
