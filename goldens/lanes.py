"""goldens-check's exports in parallel lanes, one lane per core this process may use: each
component exported alone by its own `python -m goldens.export <component> --out <folder>` process
(one torch thread, as every export), longest first (`EXPORT_SECONDS`), while this process runs a
job of its own in the first lane (the saved steps: OLMo-core's `Trainer` must run in a main
thread); then every folder's goldens and manifest entries are moved into one. An exporter that
reads goldens reads the committed ones (goldens.store's default root), as it does exporting
everything into another folder in one process, so no export waits for another; the bytes and
entries are the ones each export gives alone."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from goldens.source import REPO
from goldens.store import GoldenError, read_manifest, resolve, write_manifest
from goldens.trace import process_group_backend

EXPORT_SECONDS: dict[str, float] = {
    "rms_norm": 7,
    "kda": 7,
    "kda_trained": 401,
    "data": 8,
    "segment_ids": 7,
    "attention": 8,
    "router": 7,
    "moe": 8,
    "optim": 8,
    "loss": 9,
    "trace": 539,
    "oracle": 58,
}
"""Seconds each component's export took on a 2-core AMD EPYC, the other core running tests (about
7 s of them starting its process): the lanes take the longest first."""
POLL_SECONDS = 0.5

T = TypeVar("T")


@dataclass(frozen=True)
class Lane:
    """One lane's jobs in the order it ran them, with each one's seconds, and its wall time from
    the start of all lanes to the end of its last job."""

    jobs: tuple[tuple[str, float], ...]
    seconds: float

    def describe(self) -> str:
        jobs = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.jobs)
        return f"done after {self.seconds:.0f} s: {jobs}"


class ExportFailed(Exception):
    """A component's export process exited non-zero; the message names it and holds its
    stderr."""


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def longest_first(components: Sequence[str]) -> list[str]:
    return sorted(components, key=lambda c: -EXPORT_SECONDS[c])


def export_command(component: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "goldens.export", component, "--out", str(out)]


def export_env(base: dict[str, str]) -> dict[str, str]:
    """`base` with the gloo process group (the trace's) on a port free now: an export never
    shares one with this process's saved steps or another export."""
    if process_group_backend() != "gloo":
        return base
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {**base, "MASTER_PORT": str(s.getsockname()[1])}


@dataclass(frozen=True)
class _Export:
    """A component's export process, the file its stderr goes to, and when it started."""

    component: str
    process: subprocess.Popen
    stderr: Path
    started: float


def _launch(component: str, folder: Path, env: dict[str, str]) -> _Export:
    stderr = folder.with_suffix(".stderr")
    with stderr.open("wb") as file:
        process = subprocess.Popen(
            export_command(component, folder),
            cwd=REPO,
            env=export_env(env),
            stdout=subprocess.DEVNULL,
            stderr=file,
        )
    return _Export(component, process, stderr, time.monotonic())


def _check(export: _Export) -> None:
    """Raises ExportFailed with the stderr of an export that exited non-zero."""
    if export.process.returncode:
        raise ExportFailed(
            f"`python -m goldens.export {export.component}` failed (exit "
            f"{export.process.returncode}):\n{export.stderr.read_text(errors='replace')}"
        )


def merge(folders: Sequence[Path], out: Path) -> None:
    """Move every golden of `folders` into `out` and write their manifest entries into its
    manifest; a path two folders export is an error."""
    manifest = read_manifest(out)
    for folder in folders:
        for path, entry in read_manifest(folder)["files"].items():
            if path in manifest["files"]:
                raise GoldenError(f"goldens/{path} is exported by two components")
            target = resolve(path, out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(resolve(path, folder), target)
            manifest["files"][path] = entry
    write_manifest(manifest, out)


def export_in_lanes(
    components: Sequence[str],
    out: Path,
    alongside: tuple[str, Callable[[], T]],
    *,
    workers: int,
) -> tuple[T, list[Lane]]:
    """Export `components` into `out`, at most `workers` at once, while the first lane runs
    `alongside` (name, job) in this process; (its result, the lanes). Raises ExportFailed naming
    the first export that fails, after stopping the others."""
    todo = longest_first(components)
    env, start = dict(os.environ), time.monotonic()
    jobs: list[list[tuple[str, float]]] = [[] for _ in range(workers)]
    ends = [start] * workers
    running: dict[int, _Export] = {}
    with tempfile.TemporaryDirectory(prefix="goldens-lanes-") as tmp:

        def fill(lanes: range) -> None:
            for lane in lanes:
                if lane not in running and todo:
                    component = todo.pop(0)
                    running[lane] = _launch(component, Path(tmp, component), env)

        try:
            fill(range(1, workers))
            name, job = alongside
            result = job()
            ends[0] = time.monotonic()
            jobs[0].append((name, ends[0] - start))
            while todo or running:
                fill(range(workers))
                time.sleep(POLL_SECONDS)
                for lane, export in list(running.items()):
                    if export.process.poll() is not None:
                        ends[lane] = time.monotonic()
                        jobs[lane].append((export.component, ends[lane] - export.started))
                        del running[lane]
                        _check(export)
        finally:
            for export in running.values():
                export.process.kill()
                export.process.wait()
        merge([Path(tmp, c) for c in components], out)
    lanes = [Lane(tuple(done), end - start) for done, end in zip(jobs, ends, strict=True)]
    return result, lanes
