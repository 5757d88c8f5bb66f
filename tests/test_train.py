"""The trainer (`parity.train`) on the micro config: it trains as free-running replays (the same
step, bit for bit), resumes bit for bit on one device and on an 8-device mesh, restores a
checkpoint saved on one mesh onto another, and names every bad input before it writes anything.

One straight run a mesh saves after each of its steps; resuming from its step-1 checkpoint gives
"k steps, a restart, N - k steps" without a second straight run. On one device the compiled step
is the free-running replay's (tests/test_replay.py); on the mesh the model is the micro config cut
to two blocks (the trace's first and last), whose step compiles in a fraction of the micro
model's time."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from goldens.store import resolve
from goldens.tolerances import BITWISE
from model.config import Config
from parity import checkpoint
from parity.lockstep_check import bounds
from parity.run import MeshShape, Run, free_running
from parity.trace import STATE, bundled_data, load_trace
from parity.train import (
    Checkpointing,
    Plan,
    TrainingError,
    initial_state,
    main,
    plan_mesh,
    restore_checkpoint,
    save_checkpoint,
    train,
)
from parity.train_data import DataFiles
from tests.compare import assert_close

STEPS = 3
MESH = MeshShape(data=2, fsdp=2, expert=2)
"""Lockstep's gate mesh."""
MESH_STEPS = 2
"""On the mesh each save takes seconds (orbax writes every shard of every array)."""


def _data() -> DataFiles:
    tokens, indices = bundled_data()
    return DataFiles(tuple(tokens), indices, "uint16")


ONE = MeshShape()


def _two_blocks() -> Config:
    """The micro config cut to its first block (KDA, the dense feed-forward) and its last
    (attention, the MoE)."""
    cfg = load_trace().config
    layers = (cfg.model.layer_types[0], cfg.model.layer_types[-1])
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, n_layers=2, layer_types=layers)
    )


def _two_block_weights(tmp) -> str:
    """The trace's step-0 weights of blocks 0 and 7 as blocks 0 and 1, an OLMo-core state dict
    in safetensors (`--init PATH`): no init to compile."""
    last = f"blocks.{load_trace().config.model.n_layers - 1}."
    weights = {
        name.replace(last, "blocks.1."): w
        for name, w in load_trace().params(0).items()
        if not name.startswith("blocks.") or name.startswith(("blocks.0.", last))
    }
    path = tmp / "two_blocks.safetensors"
    safetensors.numpy.save_file(weights, str(path))
    return str(path)


def _plan(tmp, *, mesh=ONE, steps=STEPS, config=None, init="trace", **kw) -> Plan:
    return Plan(
        config=load_trace().config if config is None else config,
        steps=steps,
        data=_data(),
        mesh=mesh,
        init=init,
        checkpoints=Checkpointing(tmp / "checkpoints", save_every=1, keep=STEPS),
        out=tmp / "out",
        **kw,
    )


def _resumed_from(straight_plan: Plan, tmp, step: int) -> Plan:
    """A plan resuming from `straight_plan`'s checkpoint of `step` (copied: the straight run's
    folder is left as it is)."""
    shutil.copytree(
        straight_plan.checkpoints.directory / f"step_{step:08d}",
        tmp / "checkpoints" / f"step_{step:08d}",
    )
    return dataclasses.replace(
        straight_plan,
        checkpoints=dataclasses.replace(
            straight_plan.checkpoints, directory=tmp / "checkpoints", resume=True
        ),
        out=tmp / "out",
    )


def _leaves(state) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    plan = _plan(tmp_path_factory.mktemp("one_device"))
    state, rows = train(plan, log=lambda _: None)
    return plan, state, rows


@pytest.fixture(scope="module")
def on_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    plan = _plan(
        tmp, mesh=MESH, steps=MESH_STEPS, config=_two_blocks(), init=_two_block_weights(tmp)
    )
    state, rows = train(plan, log=lambda _: None)
    return plan, state, rows


@pytest.fixture(scope="module")
def free_running_rows():
    trace = load_trace()
    return free_running(trace, Run(trace.config), steps=STEPS, on_step=lambda *_: None)[0]


def _differing_steps(rows: list[dict], expected: list[dict]) -> list[int]:
    """The steps at which any of free-running's metrics differs from the trainer's, by a bit."""
    return [
        row["step"]
        for row, want in zip(rows, expected, strict=True)
        if {k: row[k] for k in want} != want
    ]


def test_trains_as_free_running(one_device, free_running_rows):
    """The micro config from the trace's step-0 weights on its data: every metric of every step
    is free-running's, bit for bit (one step, one code path)."""
    _, _, rows = one_device
    assert [row["draws"] for row in rows] == ["olmo-core"] * STEPS
    assert _differing_steps(rows, free_running_rows) == []


def test_one_ulp_is_seen(one_device, free_running_rows):
    """Power: a grad norm one float32 ulp off at step 2 is a differing step."""
    _, _, rows = one_device
    shifted = [dict(row) for row in rows]
    norm = np.float32(shifted[1]["grad_norm"])
    shifted[1]["grad_norm"] = float(np.nextafter(norm, np.float32(np.inf)))
    assert _differing_steps(shifted, free_running_rows) == [2]


@pytest.mark.parametrize("fixture", ["one_device", "on_mesh"])
def test_resume_is_bit_exact(fixture, tmp_path, request):
    """Steps 1..N straight equal step 1, a restart from its checkpoint and steps 2..N: every
    param, moment, count and the skip history bit for bit; the metrics file holds each step
    once."""
    plan, straight, rows = request.getfixturevalue(fixture)
    resumed_plan = _resumed_from(plan, tmp_path, 1)
    (tmp_path / "out").mkdir()
    shutil.copy(plan.out / "metrics.jsonl", tmp_path / "out" / "metrics.jsonl")
    resumed, resumed_rows = train(resumed_plan, log=lambda _: None)
    assert_close("resumed state", expected=_leaves(straight), actual=_leaves(resumed), tol=BITWISE)
    assert [r["ce"] for r in resumed_rows] == [r["ce"] for r in rows[1:]]
    written = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert [r["step"] for r in written] == list(range(1, plan.steps + 1))
    assert checkpoint.steps(tmp_path / "checkpoints") == list(range(1, plan.steps + 1))


def test_restored_onto_another_mesh(tmp_path, on_mesh):
    """The step-0 state saved on data=8 and resumed on data=2,fsdp=2,expert=2: its step 1 there is
    the straight run's step 1 on that mesh, bit for bit, laid out as that mesh lays it out."""
    plan, _, _ = on_mesh
    saving = _with_dir(dataclasses.replace(plan, mesh=MeshShape(data=8)), tmp_path, resume=False)
    state0 = initial_state(saving, plan_mesh(saving))
    assert not any(axis for x in jax.tree.leaves(state0.params) for axis in x.sharding.spec)
    save_checkpoint(saving, 0, state0, jax.random.key(saving.seed))
    resumed = dataclasses.replace(_with_dir(plan, tmp_path, resume=True), steps=1, out=None)
    state, _ = train(resumed, log=lambda _: None)
    expected, _, _ = restore_checkpoint(plan, plan_mesh(plan), 1)
    assert_close("restored", expected=_leaves(expected), actual=_leaves(state), tol=BITWISE)
    shardings = jax.tree.map(lambda x: x.sharding, expected)
    assert jax.tree.map(lambda x: x.sharding, state) == shardings


def test_from_olmo_core_state_and_back(tmp_path, one_device):
    """From OLMo-core's training state after step 49 (the trace's): step 50's CE is OLMo-core's
    within lockstep's bound; the params come out under OLMo-core's names and shapes."""
    plan, _, _ = one_device
    trace = load_trace()
    start = dataclasses.replace(
        plan,
        steps=50,
        init_state=resolve(STATE.format(49)),
        init_step=49,
        checkpoints=None,
        out=None,
        export=tmp_path / "params.safetensors",
    )
    _, rows = train(start, log=lambda _: None)
    ce = trace.metrics["ce"][49]
    assert abs(rows[0]["ce"] - ce) <= bounds(50, []).metric * abs(ce)
    exported = safetensors.numpy.load_file(tmp_path / "params.safetensors")
    step50 = trace.params(50)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in step50.items()}


def _with_dir(plan: Plan, directory, *, resume: bool) -> Plan:
    return dataclasses.replace(plan, checkpoints=Checkpointing(directory, 1, STEPS, resume))


def _snapshot(directory) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def test_checkpoint_errors(tmp_path, one_device):
    """Each named, and the checkpoints left byte for byte as they were."""
    plan, _, _ = one_device
    folder = plan.checkpoints.directory
    before = _snapshot(folder)
    with pytest.raises(checkpoint.CheckpointError, match="pass --resume"):
        train(dataclasses.replace(plan, steps=STEPS + 1), log=lambda _: None)
    other = dataclasses.replace(
        plan,
        config=dataclasses.replace(
            plan.config, train=dataclasses.replace(plan.config.train, lr=2e-3)
        ),
        checkpoints=dataclasses.replace(plan.checkpoints, resume=True),
        steps=STEPS + 1,
    )
    with pytest.raises(checkpoint.CheckpointError, match=r"train\.lr: saved 0\.001"):
        train(other, log=lambda _: None)
    assert _snapshot(folder) == before
    empty = _with_dir(plan, tmp_path / "none", resume=True)
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        train(empty, log=lambda _: None)


def test_truncated_shard_is_named(tmp_path, one_device):
    plan, _, _ = one_device
    resumed = _resumed_from(plan, tmp_path, STEPS)
    resumed = dataclasses.replace(resumed, steps=STEPS + 1)
    arrays = sorted(
        (p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file() and "arrays" in p.parts),
        key=lambda p: -p.stat().st_size,
    )
    arrays[0].write_bytes(arrays[0].read_bytes()[: arrays[0].stat().st_size // 2])
    with pytest.raises(checkpoint.CheckpointError, match=f"{arrays[0].name}.*truncated"):
        train(resumed, log=lambda _: None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "expert=3"], "16 routed experts do not split over expert=3"),
        (["--config", "hero"], "only compiled ahead of time"),
        (["--init", "trace", "--config", "slice"], "the micro config's"),
        (["--save-every", "2"], "need --checkpoint-dir"),
        (["--synthetic", "--token-dtype", "uint16"], "--synthetic takes no"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys, tmp_path):
    assert main(["--steps", "2", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_mesh_of_more_devices_than_there_are():
    with pytest.raises(SystemExit, match="a mesh of 16 devices: JAX has 8 cpu devices"):
        main(["--steps", "1", "--mesh", "data=16"])


def test_data_that_does_not_match_its_indices(capsys, tmp_path):
    """One of the corpus's five token files against the global indices of all five."""
    tokens, indices = bundled_data()
    argv = ["--steps", "1", "--tokens", str(tokens[0]), "--global-indices", str(indices)]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(indices) in err and "instances" in err


def test_nonfinite_steps_stop_the_run(tmp_path, one_device):
    """OLMo-core weights with one NaN: the CE is NaN from step 1 (the skip rule has too little
    history to skip, as OLMo-core's), and the run stops after --max-nonfinite such steps, naming
    step 1, with no checkpoint saved."""
    plan, _, _ = one_device
    weights = dict(load_trace().params(0))
    weights["embeddings.weight"] = weights["embeddings.weight"].copy()
    weights["embeddings.weight"][:, 0] = np.nan
    safetensors.numpy.save_file(weights, tmp_path / "nan.safetensors")
    broken = dataclasses.replace(
        _with_dir(plan, tmp_path / "checkpoints", resume=False),
        init=str(tmp_path / "nan.safetensors"),
        out=None,
        steps=6,
    )
    with pytest.raises(TrainingError, match="from step 1"):
        train(broken, log=lambda _: None)
    assert checkpoint.steps(tmp_path / "checkpoints") == []
