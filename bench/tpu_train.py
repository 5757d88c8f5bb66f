"""`python -m bench tpu-train`: the hero-width slice (`model.config.olmo35_slice`) trained by
`olmo-parity train` on one TPU chip: 100 steps straight with a checkpoint at 50, then a second
process resuming from that checkpoint to step 100; the two step-100 checkpoints compared bit for
bit (params, Adam moments and count, skip history, key) and the resumed steps' metrics with the
straight run's.

Data: the bundled corpus's tokens (`parity.trace.bundled_data`) at the slice's 4096 tokens a
sequence: 150 instances, 18 global batches of 8 an epoch, so 100 steps are 5.6 epochs, each
shuffled as OLMo-core's loader shuffles it. Each child holds the chip in turn; this process reads
the checkpoints on the CPU. A slice's checkpoint is 6.4 GB, so each step-100 checkpoint is
reduced to a sha256 per array and removed before the next run writes its own.

`python -m bench.tpu_train straight|resumed WORK [STEPS SAVE]` runs one half (the chip's calls
are limited in time): `straight` leaves the checkpoint of SAVE under WORK/resumed/ and the
straight run's digests and metrics, `resumed` finishes and writes WORK/tpu-train.json with the
figures `run` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

STEPS, SAVE = 100, 50
TIMINGS = ("seconds", "tokens_per_s", "fraction_of_peak")


def _train(work: Path, name: str, steps: int, save: int, *extra: str) -> list[dict]:
    """`olmo-parity train` of the slice in a child process, its checkpoints under WORK/<name>;
    returns its metrics rows."""
    command = [sys.executable, "-m", "parity.train", "--config", "slice", "--platform", "tpu"]
    command += ["--steps", str(steps), "--save-every", str(save), "--keep", "2"]
    command += ["--checkpoint-dir", str(work / name), "--out", str(work / f"{name}-out"), *extra]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    lines = (work / f"{name}-out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _digests(directory: Path, step: int) -> dict[str, str]:
    """sha256 of each array of the checkpoint of `step` under `directory`, read on this CPU."""
    from parity.trace import bundled_data
    from parity.train import PRESETS, Checkpointing, Plan, restore_checkpoint
    from parity.train_data import DataFiles

    plan = Plan(
        PRESETS["slice"](),
        steps=step,
        data=DataFiles(tuple(bundled_data()[0]), None, "uint16"),
        checkpoints=Checkpointing(directory, resume=True),
    )
    state, key, _ = restore_checkpoint(plan, None, step)
    flat = jax.tree_util.tree_flatten_with_path({"state": state, "key": jax.random.key_data(key)})
    return {
        jax.tree_util.keystr(path): hashlib.sha256(
            f"{x.dtype}{x.shape}".encode() + np.asarray(x).tobytes()
        ).hexdigest()
        for path, x in flat[0]
    }


def _numbers(row: dict) -> dict:
    """A metrics row without its timings."""
    return {k: v for k, v in row.items() if k not in TIMINGS}


def straight(work: Path, steps: int = STEPS, save: int = SAVE) -> None:
    jax.config.update("jax_platforms", "cpu")  # this process never opens the chip
    rows = _train(work, "straight", steps, save)
    digests = _digests(work / "straight", steps)
    (work / "straight.json").write_text(json.dumps({"rows": rows, "digests": digests}))
    shutil.rmtree(work / "straight" / f"step_{steps:08d}")
    (work / "resumed").mkdir()
    (work / "straight" / f"step_{save:08d}").rename(work / "resumed" / f"step_{save:08d}")


def resumed(work: Path, steps: int = STEPS, save: int = SAVE) -> dict[str, float]:
    jax.config.update("jax_platforms", "cpu")
    rows = _train(work, "resumed", steps, save, "--resume")
    before = json.loads((work / "straight.json").read_text())
    first, digests = before["rows"], before["digests"]
    steady = first[1:]
    figures = {
        "steps": steps,
        "resumed_at": save,
        "first_step_s": first[0]["seconds"],
        "step_s": statistics.median(r["seconds"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "fraction_of_peak": statistics.median(r["fraction_of_peak"] for r in steady),
        "ce_first": first[0]["ce"],
        "ce_resumed_at": first[save - 1]["ce"],
        "ce_last": first[-1]["ce"],
        "resumed_first_step_s": rows[0]["seconds"],
        "epochs": first[-1]["epoch"],
        "state_bit_identical": float(_digests(work / "resumed", steps) == digests),
        "metrics_bit_identical": float(
            [_numbers(r) for r in first[save:]] == [_numbers(r) for r in rows]
        ),
    }
    (work / "tpu-train.json").write_text(json.dumps({"tpu-train": figures}, indent=1))
    return figures


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as work:
        straight(Path(work))
        return resumed(Path(work))


def summary(figures: dict[str, float]) -> list[str]:
    same = "bit for bit" if figures["state_bit_identical"] else "NOT bit for bit"
    return [
        f"tpu-train: {figures['steps']} steps straight and resumed at {figures['resumed_at']} "
        f"agree {same}; "
        f"{figures['step_s']:.3f} s a step, {figures['fraction_of_peak']:.1%} of the chip's peak"
    ]


if __name__ == "__main__":
    half, work, *sizes = sys.argv[1:]
    Path(work).mkdir(parents=True, exist_ok=True)
    halves = {"straight": straight, "resumed": resumed}
    print(json.dumps(halves[half](Path(work), *map(int, sizes))))
