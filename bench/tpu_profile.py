"""`python -m bench tpu-profile`: where the chip's time goes in the slice's train step
(`bench.tpu_step`'s slice at matmul precision "default"): `STEPS` steps after `WARMUP` traced by
`jax.profiler` and split by op family (`parity.profile`).

`python -m bench.tpu_profile capture DIR` (on a TPU host) writes DIR/step.xplane.pb, the compiled
module's ops (DIR/ops.json) and DIR/capture.json; `python -m bench.tpu_profile table DIR`
(anywhere) prints the split they hold.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.tpu_step import slice_config, slice_step
from model.flops import scope_flops
from parity.profile import FamilyTime, HloOp, device_ops, family_flops, hlo_ops, split

STEPS, WARMUP = 3, 2
VARIANT = "default"
"""The `bench.tpu_step` variant profiled."""


def _split(work: Path) -> list[FamilyTime]:
    """The split of a capture in `work`."""
    capture = json.loads((work / "capture.json").read_text())
    ops = json.loads((work / "ops.json").read_text())
    ops = {name: HloOp(op["opcode"], op["op_name"], tuple(op["inner"])) for name, op in ops.items()}
    ran = device_ops(work / "step.xplane.pb")
    return split(ops, ran, steps=capture["steps"], step_s=capture["step_s"])


def capture(work: Path) -> None:
    """Trace `STEPS` steps of the slice after `WARMUP` on this host's TPU into `work`."""
    import jax

    _, state, batch, compiled, _ = slice_step(VARIANT, "tpu-profile")
    ops = {name: dataclasses.asdict(op) for name, op in hlo_ops(compiled.as_text()).items()}
    (work / "ops.json").write_text(json.dumps(ops))
    for _ in range(WARMUP):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    trace = work / "trace"
    with jax.profiler.trace(str(trace)):
        start = time.perf_counter()
        for _ in range(STEPS):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - start) / STEPS
    shutil.move(next(trace.rglob("*.xplane.pb")), work / "step.xplane.pb")
    shutil.rmtree(trace)
    record = {"steps": STEPS, "step_s": step_s, "device": jax.devices()[0].device_kind}
    (work / "capture.json").write_text(json.dumps(record))


def run() -> dict[str, float]:
    """A capture in a child process (which holds the chip), then its split: figures named
    "<family>.seconds|share", and "<family>.flops", the step's model FLOPs the family computes
    (`model.flops.scope_flops`), where it has any."""
    with tempfile.TemporaryDirectory() as work:
        child = [sys.executable, "-m", "bench.tpu_profile", "capture", work]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench tpu-profile failed:\n{done.stderr[-3000:]}")
        rows = _split(Path(work))
    flops = family_flops(scope_flops(slice_config(VARIANT)))
    return {
        f"{row.family}.{key}": getattr(row, key) for row in rows for key in ("seconds", "share")
    } | {f"{family}.flops": value for family, value in flops.items()}


def summary(figures: dict[str, float]) -> list[str]:
    shares = {k.rsplit(".", 1)[0]: v for k, v in figures.items() if k.endswith(".share")}
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
    return ["tpu-profile: " + ", ".join(f"{family} {share:.0%}" for family, share in top)]


if __name__ == "__main__":
    verb, work = sys.argv[1], Path(sys.argv[2])
    if verb == "capture":
        work.mkdir(parents=True, exist_ok=True)
        capture(work)
    else:
        for row in _split(work):
            print(f"{row.family:42s} {row.seconds * 1e3:9.1f} ms {row.share:6.1%}")
