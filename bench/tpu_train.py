"""`python -m bench tpu-train`: the hero-width slice (`model.config.olmo35_slice`) trained by
`olmo-parity train` on one TPU chip: 100 steps straight with a checkpoint at 50, then a second
process resuming from that checkpoint to step 100; the two step-100 checkpoints compared bit for
bit (params, Adam moments and count, skip history, key) and the resumed steps' metrics with the
straight run's.

Data: the bundled corpus's tokens (`parity.trace.bundled_data`) at the slice's 4096 tokens a
sequence: 150 instances, 18 global batches of 8 an epoch, so 100 steps are 5.6 epochs, each
shuffled as OLMo-core's loader shuffles it. Each child holds the chip in turn; this process
compares on the CPU. Figures: the straight run's first step (compile included), its median step,
tokens/s and fraction of the chip's bf16 peak, the CE at steps 1, 50 and 100, the resumed
process's first step, and whether the two runs agree bit for bit.
"""

from __future__ import annotations

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


def _train(directory: Path, out: Path, *extra: str, env: dict) -> None:
    command = [
        sys.executable,
        "-m",
        "parity.train",
        "--config",
        "slice",
        "--platform",
        "tpu",
        "--steps",
        str(STEPS),
        "--checkpoint-dir",
        str(directory),
        "--save-every",
        str(SAVE),
        "--out",
        str(out),
        *extra,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _restored(directory: Path) -> dict[str, np.ndarray]:
    """The step-100 checkpoint under `directory`, on this CPU: every leaf by its path."""
    from parity.trace import bundled_data
    from parity.train import PRESETS, Checkpointing, Plan, restore_checkpoint
    from parity.train_data import DataFiles

    plan = Plan(
        PRESETS["slice"](),
        steps=STEPS,
        data=DataFiles(tuple(bundled_data()[0]), None, "uint16"),
        checkpoints=Checkpointing(directory, resume=True),
    )
    state, key, _ = restore_checkpoint(plan, None, STEPS)
    flat = jax.tree_util.tree_flatten_with_path({"state": state, "key": jax.random.key_data(key)})
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat[0]}


TIMINGS = ("seconds", "tokens_per_s", "fraction_of_peak")


def _numbers(row: dict) -> dict:
    """A metrics row without its timings."""
    return {k: v for k, v in row.items() if k not in TIMINGS}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def run() -> dict[str, float]:
    jax.config.update("jax_platforms", "cpu")  # this process never opens the chip
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache")}
        _train(work / "straight", work / "straight-out", env=env)
        step = f"step_{SAVE:08d}"
        shutil.copytree(work / "straight" / step, work / "resumed" / step)
        _train(work / "resumed", work / "resumed-out", "--resume", env=env)
        straight, resumed = _rows(work / "straight-out"), _rows(work / "resumed-out")
        a, b = _restored(work / "straight"), _restored(work / "resumed")
    same_rows = [_numbers(r) for r in straight[SAVE:]] == [_numbers(r) for r in resumed]
    steady = straight[1:]
    return {
        "first_step_s": straight[0]["seconds"],
        "step_s": statistics.median(r["seconds"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "fraction_of_peak": statistics.median(r["fraction_of_peak"] for r in steady),
        "ce_step1": straight[0]["ce"],
        "ce_step50": straight[SAVE - 1]["ce"],
        "ce_step100": straight[-1]["ce"],
        "resumed_first_step_s": resumed[0]["seconds"],
        "epochs": straight[-1]["epoch"],
        "state_bit_identical": float(a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)),
        "metrics_bit_identical": float(same_rows),
    }


def summary(figures: dict[str, float]) -> list[str]:
    same = "bit for bit" if figures["state_bit_identical"] else "NOT bit for bit"
    return [
        f"tpu-train: {STEPS} steps straight and resumed at {SAVE} agree {same}; "
        f"{figures['step_s']:.3f} s a step, {figures['fraction_of_peak']:.1%} of the chip's peak"
    ]
