"""The trainer at length (`tox -e slow`): a NaN step is skipped as OLMo-core's rule says and the
run goes on; a run killed (SIGKILL) in the middle of a save resumes in a new process from its last
complete checkpoint to the straight run's state bit for bit (a new process compiles its step
afresh: the program must be the same). Its 50 steps against free-running's are in
tests/test_replay_full.py, which shares their run."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from parity import checkpoint
from parity.faults import InjectedFault
from parity.trace import bundled_data, load_trace
from parity.train import Checkpointing, Plan, restore_checkpoint, train
from parity.train_data import DataFiles

pytestmark = pytest.mark.slow

STEPS = 6
ROOT = Path(__file__).resolve().parents[1]


def test_a_nan_step_is_skipped_and_the_run_goes_on():
    """With the skip rule's window at 4 (it acts once 2 steps are recorded; at step 3 the grad
    norm's jump already crosses 6 sigma of two steps), a NaN gradient at step 4 only: step 4 is
    skipped, and so are steps 5 and 6, whose history still holds the NaN (`model.optim`,
    OLMo-core's rule); the run goes on, and its params are those after step 3."""
    trace = load_trace()
    tokens, indices = bundled_data()
    config = dataclasses.replace(
        trace.config, train=dataclasses.replace(trace.config.train, skip_step_window=4)
    )
    data = DataFiles(tuple(tokens), indices, "uint16")
    fault = InjectedFault(first=4, last=4, grad_scale=("lm_head.w_out.weight", float("nan")))
    plan = Plan(config, steps=6, data=data, init="trace", fault=fault)
    state, rows = train(plan, log=lambda _: None)
    assert [r["skipped"] for r in rows][3:] == [True, True, True]
    assert math.isnan(rows[3]["grad_norm"]) and all(math.isfinite(r["ce"]) for r in rows)
    after_3, _ = train(dataclasses.replace(plan, steps=3), log=lambda _: None)
    leaves = jax.tree.leaves(state.params), jax.tree.leaves(after_3.params)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*leaves, strict=True))


def _command(directory: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "parity.train",
        "--steps",
        str(STEPS),
        "--checkpoint-dir",
        str(directory),
        "--save-every",
        "1",
        "--keep",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def _env() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir or ""
    return env


def _kill_mid_save(directory: Path, out: Path) -> bool:
    """Start the run, SIGKILL it while it writes a checkpoint after step 2; whether the kill
    landed in a save (a temporary folder left behind)."""
    process = subprocess.Popen(
        _command(directory, out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600
    while 2 not in checkpoint.steps(directory):
        assert process.poll() is None and time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.05)
    while not any(p.name.startswith(".tmp-") for p in directory.iterdir()):
        if process.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it was killed"
    return any(p.name.startswith(".tmp-") for p in directory.iterdir())


def _leaves(plan: Plan) -> dict[str, np.ndarray]:
    state, key, _ = restore_checkpoint(plan, None, STEPS)
    flat = jax.tree_util.tree_flatten_with_path({"state": state, "key": jax.random.key_data(key)})
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat[0]}


def test_killed_mid_save_resumes_bit_exact(tmp_path):
    straight = subprocess.run(
        _command(tmp_path / "a", tmp_path / "a-out"), cwd=ROOT, env=_env(), capture_output=True
    )
    assert straight.returncode == 0, straight.stderr.decode()[-3000:]
    mid_save = _kill_mid_save(tmp_path / "b", tmp_path / "b-out")
    last = checkpoint.latest(tmp_path / "b")
    resumed = subprocess.run(
        _command(tmp_path / "b", tmp_path / "b-out", "--resume"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = next(line for line in resumed.stdout.splitlines() if line.startswith("step "))
    assert first.startswith(f"step {last + 1}/{STEPS}"), (mid_save, last, first)
    tokens, indices = bundled_data()
    data = DataFiles(tuple(tokens), indices, "uint16")
    plans = [
        Plan(load_trace().config, STEPS, data, checkpoints=Checkpointing(tmp_path / d, 1, 2, True))
        for d in ("a", "b")
    ]
    a, b = _leaves(plans[0]), _leaves(plans[1])
    assert a.keys() == b.keys()
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []
    rows = {
        name: [json.loads(line) for line in (tmp_path / f"{name}-out" / "metrics.jsonl").open()]
        for name in ("a", "b")
    }
    assert [r["step"] for r in rows["b"]] == list(range(1, STEPS + 1))
    assert [r["ce"] for r in rows["b"]] == [r["ce"] for r in rows["a"]]
