"""The trainer's checkpoints: a pytree of jax.Arrays (the train state and the RNG key data) and a
JSON dict of metadata, saved atomically and verified before anything is restored.

One folder per step:

    directory/
      step_00000042/
        arrays/          orbax-checkpoint's own format (OCDBT over tensorstore): each array
                         written shard by shard as it is laid out on its mesh
        meta.json        the caller's `meta`: the run's config, the step, the data position, ...
        integrity.json   every other file's path relative to step_00000042/, size and sha256
      .tmp-step_00000043-<pid>/
                         a save in progress, or a killed one: never listed; the next save
                         removes it

A save writes everything into its `.tmp-` folder, integrity.json last, then renames the folder to
step_<n> (os.rename, atomic within one file system). A process killed at any moment so leaves
either no step_<n> or a complete one. `steps` lists a folder only if it holds integrity.json, so
one damaged by hand without it is never taken for complete; an old checkpoint is renamed to a
`.tmp-` name before it is removed, for the same reason. Nothing is fsynced: a kill is covered,
a power loss is not. One writing process per directory.

`restore` checks, before it reads any array: the folder exists; every file integrity.json lists
is there with its size and sha256 (files it does not list are ignored); the saved config equals
this run's; the saved arrays' paths, shapes and dtypes equal the target's. Each failure raises
CheckpointError naming the file, key or array path and what differs. Orbax keeps no checksums of
its own: one flipped byte in its array data can restore as other values without an error. The
target's shardings may be on another mesh than the one saved from; orbax reads each shard's
slice as the target lays it out.
"""

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

_STEP = re.compile(r"step_(\d{8,})")
_TMP = ".tmp-"
_ARRAYS = "arrays"
_META = "meta.json"
_INTEGRITY = "integrity.json"
_ABSENT = object()


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or made for another config; the message
    names the file and what differs."""


def steps(directory: Path) -> list[int]:
    """The complete checkpoints' steps under `directory`, ascending; [] if it does not exist."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP.fullmatch(path.name)
        if match and (path / _INTEGRITY).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def latest(directory: Path) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    found = steps(directory)
    return found[-1] if found else None


def save(directory: Path, step: int, arrays: Any, meta: dict, *, keep: int) -> Path:
    """Writes `arrays` (a pytree of jax.Arrays, saved sharded as laid out) and `meta` (JSON-able)
    to directory/step_<step:08d>/ atomically, after removing the `.tmp-` folders of killed saves;
    then keeps only the newest `keep` complete checkpoints. Returns the step folder."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    final = _step_dir(directory, step)
    _refuse_existing(final)
    meta_json = json.dumps(meta, indent=2)
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f"{_TMP}*"):
        shutil.rmtree(leftover)
    tmp = directory / f"{_TMP}{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        with ocp.Checkpointer(_writer()) as checkpointer:
            checkpointer.save(epath.Path(tmp / _ARRAYS), args=ocp.args.PyTreeSave(arrays))
        (tmp / _META).write_text(meta_json)
        files = [_entry(tmp, path) for path in sorted(tmp.rglob("*")) if path.is_file()]
        (tmp / _INTEGRITY).write_text(json.dumps({"files": files}, indent=1))
        _refuse_existing(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in steps(directory)[:-keep]:
        doomed = directory / f"{_TMP}removed-{_step_dir(directory, old).name}-{os.getpid()}"
        os.rename(_step_dir(directory, old), doomed)
        shutil.rmtree(doomed)
    return final


def _writer() -> ocp.PyTreeCheckpointHandler:
    """orbax's pytree handler; in one process, each array's replicated shards are written by their
    first replica alone. orbax's replica-parallel writing, which spreads them over the processes
    that hold them, slices every replicated shard with an eager op even when one process holds
    all: 6.8 s a save against 3.7 s without, on the micro config's 8-device CPU mesh."""
    one_process = jax.process_count() == 1
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=not one_process)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def verify(directory: Path, step: int) -> Path:
    """Checks every file the step's integrity.json lists (present, size, sha256); returns the
    step folder, or raises CheckpointError naming each file that differs."""
    folder, entries = _listing(directory, step)
    problems = list(_problems(folder, entries))
    if problems:
        raise CheckpointError(f"{folder} is damaged:\n  " + "\n  ".join(problems))
    return folder


def restore(directory: Path, step: int, target: Any, *, config: dict) -> tuple[Any, dict]:
    """The step's arrays laid out as `target` says (a pytree like the saved one, of
    jax.ShapeDtypeStructs each with its `.sharding`, on any mesh), and its meta. Checks the files,
    then meta["config"] against `config`, then paths, shapes and dtypes, before reading arrays."""
    folder = verify(directory, step)
    meta = json.loads((folder / _META).read_text())
    expected = json.loads(json.dumps(config))
    differences = list(_differences(meta.get("config", _ABSENT), expected, ""))
    if differences:
        raise CheckpointError(
            f"{folder / _META} was saved for another config:\n  " + "\n  ".join(differences)
        )
    handler = ocp.StandardCheckpointHandler()
    try:
        saved = handler.metadata(epath.Path(folder / _ARRAYS)).tree
    except Exception as e:
        raise CheckpointError(f"{folder}: orbax could not read the arrays' metadata: {e}") from e
    finally:
        handler.close()
    _check_tree(folder / _ARRAYS, saved, target)
    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            arrays = checkpointer.restore(
                epath.Path(folder / _ARRAYS), args=ocp.args.StandardRestore(target)
            )
    except Exception as e:
        raise CheckpointError(f"{folder}: orbax could not restore the arrays: {e}") from e
    return arrays, meta


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def _refuse_existing(final: Path) -> None:
    if (final / _INTEGRITY).is_file():
        raise CheckpointError(f"{final} holds a complete checkpoint already; not overwriting it")
    if final.exists():
        raise CheckpointError(f"{final} exists without {_INTEGRITY} (damaged); not overwriting it")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _entry(root: Path, path: Path) -> dict:
    return {
        "path": path.relative_to(root).as_posix(),
        "size": path.stat().st_size,
        "sha256": _sha256(path),
    }


def _listing(directory: Path, step: int) -> tuple[Path, list[dict]]:
    """The step folder and its integrity.json entries; CheckpointError if either is not there."""
    folder = _step_dir(directory, step)
    if not folder.is_dir():
        raise CheckpointError(
            f"no checkpoint {folder}; the complete steps in {directory}: {steps(directory)}"
        )
    manifest = folder / _INTEGRITY
    if not manifest.is_file():
        raise CheckpointError(f"{folder} has no {_INTEGRITY}: incomplete or damaged")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is damaged: {e!r}") from e
    fields = {"path": str, "size": int, "sha256": str}
    for e in entries:
        if not (isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in fields.items())):
            raise CheckpointError(f"{manifest} is damaged: entry {e!r} is not {fields}")
    return folder, entries


def _problems(folder: Path, entries: list[dict]) -> Iterator[str]:
    for e in entries:
        path, size, sha = folder / e["path"], e["size"], e["sha256"]
        if not path.is_file():
            yield f"{e['path']}: missing ({size} bytes listed)"
        elif (found := path.stat().st_size) != size:
            kind = "truncated" if found < size else "grown"
            yield f"{e['path']}: {kind}: {size} bytes listed, {found} found"
        elif (found_sha := _sha256(path)) != sha:
            yield f"{e['path']}: changed: sha256 listed {sha}, found {found_sha}"


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value, sort_keys=True)


def _differences(saved: Any, expected: Any, key: str) -> Iterator[str]:
    """`<dotted key>: saved <value>, this run <value>` for each leaf that differs."""
    if isinstance(saved, dict) and isinstance(expected, dict):
        for k in [*saved, *(k for k in expected if k not in saved)]:
            sub = f"{key}.{k}" if key else k
            yield from _differences(saved.get(k, _ABSENT), expected.get(k, _ABSENT), sub)
    elif _show(saved) != _show(expected):
        yield f"{key or 'config'}: saved {_show(saved)}, this run {_show(expected)}"


def _spec(leaf: Any) -> str:
    return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"


def _check_tree(arrays: Path, saved: Any, target: Any) -> None:
    """Raises CheckpointError naming the first array path whose presence, shape or dtype differs
    between orbax's saved metadata tree and `target`."""
    saved_by_name = {m.name: m for m in jax.tree.leaves(saved)}
    target_by_name = {
        ".".join(ocp.tree.str_keypath(path)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
    }
    differences = []
    for name in [*target_by_name, *(n for n in saved_by_name if n not in target_by_name)]:
        was = _spec(saved_by_name[name]) if name in saved_by_name else "absent"
        now = _spec(target_by_name[name]) if name in target_by_name else "absent"
        if was != now:
            differences.append(f"{name}: saved {was}, this run {now}")
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        raise CheckpointError(f"{arrays} does not fit this run's state: {differences[0]}{more}")
