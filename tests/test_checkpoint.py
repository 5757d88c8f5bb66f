"""parity.checkpoint on the 8 simulated CPU devices: what a save writes comes back bitwise on
another mesh; a checkpoint that is incomplete, damaged, made for another config or cut short by
SIGKILL is never restored. The pytree is the trainer's in miniature (a TrainState of nnx params
[64, 1024] and [8, 16], Adam moments and masked weight decay's empty state, an int32 step; RNG
key data); no model is built."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from model.train_step import TrainState
from parity import checkpoint
from parity.checkpoint import CheckpointError

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"model": {"d_model": 64, "n_layers": 2}, "train": {"lr": 1e-3, "betas": [0.9, 0.95]}}
META = {"config": CONFIG, "step": 3, "data": {"epoch": 0, "batch": 3}}


def _one_device(x: jax.Array) -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[0])


def _data8(x: jax.Array) -> NamedSharding:
    """Rows over a mesh of all 8 devices; scalars and vectors replicated."""
    return NamedSharding(jax.make_mesh((8,), ("data",)), P("data") if x.ndim == 2 else P())


def _fsdp4_expert2(x: jax.Array) -> NamedSharding:
    """Rows over 2, columns over 4: another mesh and another split than _data8's."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "expert"))
    return NamedSharding(mesh, P("expert", "fsdp") if x.ndim == 2 else P())


def _arrays(sharding_of) -> dict:
    """{"state": TrainState after one Adam step, "rng": key data}, each leaf put as
    `sharding_of(leaf)` says."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = nnx.State(
        {
            "embed": {"embedding": nnx.Param(jax.random.normal(keys[0], (64, 1024)))},
            "blocks": {"0": {"w": nnx.Param(jax.random.normal(keys[1], (8, 16)))}},
        }
    )
    tx = optax.chain(
        optax.scale_by_adam(),
        optax.add_decayed_weights(0.1, mask=lambda p: jax.tree.map(lambda _: True, p)),
    )
    grads = jax.tree.map(lambda p: jax.random.normal(keys[2], p.shape), params)
    _, opt_state = tx.update(grads, tx.init(params), params)
    tree = {
        "state": TrainState(params, opt_state, jnp.int32(3)),
        "rng": jax.random.key_data(jax.random.key(7)),
    }
    return jax.tree.map(lambda x: jax.device_put(x, sharding_of(x)), tree)


def _target(tree, sharding_of):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)), tree
    )


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _assert_same(expected, actual) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_round_trip_one_device(tmp_path):
    """Every leaf comes back bitwise in the saved tree's structure, and meta as saved; a config
    given with tuples where the JSON has lists is the same config."""
    arrays = _arrays(_one_device)
    folder = checkpoint.save(tmp_path, 3, arrays, META, keep=1)
    assert folder == tmp_path / "step_00000003"
    config = {**CONFIG, "train": {**CONFIG["train"], "betas": (0.9, 0.95)}}
    restored, meta = checkpoint.restore(tmp_path, 3, _target(arrays, _one_device), config=config)
    _assert_same(arrays, restored)
    assert isinstance(restored["state"], TrainState)
    assert meta == META


@pytest.mark.parametrize("sharding_of", [_fsdp4_expert2, _one_device], ids=["mesh4x2", "one"])
def test_restore_onto_another_mesh(tmp_path, sharding_of):
    """Saved split over data=8, restored split as the target says: values bitwise equal, each
    leaf laid out with the target's sharding."""
    arrays = _arrays(_data8)
    embedding = arrays["state"].params["embed"]["embedding"][...]
    assert len({str(s.index) for s in embedding.addressable_shards}) == 8
    checkpoint.save(tmp_path, 1, arrays, META, keep=1)
    target = _target(arrays, sharding_of)
    restored, _ = checkpoint.restore(tmp_path, 1, target, config=CONFIG)
    _assert_same(arrays, restored)
    for t, r in zip(jax.tree.leaves(target), jax.tree.leaves(restored), strict=True):
        assert r.sharding == t.sharding


def test_keep_only_newest(tmp_path):
    """keep=2 after steps 1..4 leaves steps 3 and 4 on disk and nothing else."""
    arrays = _arrays(_one_device)
    for step in range(1, 5):
        checkpoint.save(tmp_path, step, arrays, {**META, "step": step}, keep=2)
    assert checkpoint.steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        checkpoint.save(tmp_path, 5, arrays, META, keep=0)


def test_leftover_of_a_killed_save(tmp_path):
    """A killed save's temporary folder (a copy of a checkpoint without integrity.json) is not
    listed; the next save removes it."""
    arrays = _arrays(_one_device)
    checkpoint.save(tmp_path, 1, arrays, META, keep=5)
    leftover = tmp_path / ".tmp-step_00000002-4242"
    shutil.copytree(tmp_path / "step_00000001", leftover)
    (leftover / "integrity.json").unlink()
    assert checkpoint.steps(tmp_path) == [1]
    assert checkpoint.latest(tmp_path) == 1
    checkpoint.save(tmp_path, 2, arrays, META, keep=5)
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_folder_without_integrity_is_not_complete(tmp_path):
    """A step folder with every file but integrity.json is neither listed, restored nor
    overwritten."""
    arrays = _arrays(_one_device)
    checkpoint.save(tmp_path, 1, arrays, META, keep=5)
    shutil.copytree(tmp_path / "step_00000001", tmp_path / "step_00000002")
    (tmp_path / "step_00000002" / "integrity.json").unlink()
    assert checkpoint.steps(tmp_path) == [1]
    assert checkpoint.latest(tmp_path) == 1
    with pytest.raises(CheckpointError, match=r"step_00000002 has no integrity\.json"):
        checkpoint.restore(tmp_path, 2, _target(arrays, _one_device), config=CONFIG)
    with pytest.raises(CheckpointError, match=r"step_00000002 exists without integrity\.json"):
        checkpoint.save(tmp_path, 2, arrays, META, keep=5)
    with pytest.raises(CheckpointError, match=r"step_00000009; the complete steps in .*: \[1\]"):
        checkpoint.restore(tmp_path, 9, _target(arrays, _one_device), config=CONFIG)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [(_truncate, "truncated"), (Path.unlink, "missing"), (_flip_a_byte, "changed")],
    ids=["truncated", "missing", "changed"],
)
def test_damaged_file(tmp_path, damage, said):
    """The largest file, truncated by half, deleted or with one byte flipped: restore names it
    and what happened. That file is array data (orbax's OCDBT data files, `d/`; how many it
    writes varies), which orbax reads with no checksum of its own."""
    arrays = _arrays(_one_device)
    folder = checkpoint.save(tmp_path, 1, arrays, META, keep=1)
    sizes = {p: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    largest = max(sizes, key=sizes.get)
    assert largest.parent.name == "d" and "arrays" in largest.relative_to(folder).parts
    damage(largest)
    relative = largest.relative_to(folder).as_posix()
    with pytest.raises(CheckpointError, match=f"{relative}: {said}"):
        checkpoint.restore(tmp_path, 1, _target(arrays, _one_device), config=CONFIG)


def test_another_config(tmp_path):
    """A config one nested field off raises naming the dotted key and both values, and leaves
    every file as it was."""
    arrays = _arrays(_one_device)
    folder = checkpoint.save(tmp_path, 1, arrays, META, keep=1)
    before = _files(folder)
    config = {**CONFIG, "model": {**CONFIG["model"], "d_model": 128}}
    with pytest.raises(CheckpointError, match=r"model\.d_model: saved 64, this run 128"):
        checkpoint.restore(tmp_path, 1, _target(arrays, _one_device), config=config)
    assert _files(folder) == before
    checkpoint.verify(tmp_path, 1)


def test_another_shape(tmp_path):
    """A target whose one array has another shape raises naming that array's path."""
    arrays = _arrays(_one_device)
    checkpoint.save(tmp_path, 1, arrays, META, keep=1)
    wide = "['state'].params['blocks']['0']['w'].value"
    target = jax.tree_util.tree_map_with_path(
        lambda path, x: x if jax.tree_util.keystr(path) != wide else x.update(shape=(8, 32)),
        _target(arrays, _one_device),
    )
    said = r"state\.params\.blocks\.0\.w\.value: saved float32\[8, 16\], this run float32\[8, 32\]$"
    with pytest.raises(CheckpointError, match=said):
        checkpoint.restore(tmp_path, 1, target, config=CONFIG)


def test_no_overwrite(tmp_path):
    """Saving onto a complete step raises and leaves it byte for byte as it was."""
    arrays = _arrays(_one_device)
    folder = checkpoint.save(tmp_path, 1, arrays, META, keep=5)
    before = _files(folder)
    other = jax.tree.map(lambda x: x + 1, arrays)
    with pytest.raises(CheckpointError, match="step_00000001 holds a complete checkpoint"):
        checkpoint.save(tmp_path, 1, other, {**META, "step": 99}, keep=5)
    assert _files(folder) == before
    checkpoint.verify(tmp_path, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


SAVER = """
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from parity import checkpoint

rows = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
for step in range(1, 1000):
    w = jnp.arange(5000 * 2500, dtype=jnp.int32).reshape(5000, 2500) + step
    arrays = {"w": jax.device_put(w, rows), "step": jnp.int32(step)}
    checkpoint.save(Path(sys.argv[1]), step, arrays, {"config": {}, "step": step}, keep=3)
"""


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the saver exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()}"
        time.sleep(0.001)


def test_sigkill_mid_save(tmp_path):
    """A process saving 50 MB checkpoints in a loop, SIGKILLed while its `.tmp-` folder is being
    written: every listed step restores with its own values, the killed one is not listed, and
    the next save removes its folder."""
    directory, log = tmp_path / "ckpt", tmp_path / "saver.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(directory)],
            cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: checkpoint.latest(directory) is not None, proc, log)
        _wait_for(lambda: any(directory.glob(".tmp-step_*")), proc, log)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed = list(directory.glob(".tmp-step_*"))
    assert killed, "the kill landed outside a save"
    listed = checkpoint.steps(directory)
    assert listed
    assert int(killed[0].name.split("_")[1].split("-")[0]) not in listed

    one = SingleDeviceSharding(jax.devices()[0])
    target = {
        "w": jax.ShapeDtypeStruct((5000, 2500), jnp.int32, sharding=one),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
    }
    for step in listed:
        restored, meta = checkpoint.restore(directory, step, target, config={})
        assert meta["step"] == step == int(restored["step"])
        w = np.arange(5000 * 2500, dtype=np.int32).reshape(5000, 2500) + step
        np.testing.assert_array_equal(np.asarray(restored["w"]), w)

    checkpoint.save(directory, listed[-1] + 10, restored, meta, keep=10)
    assert not list(directory.glob(".tmp-*"))
