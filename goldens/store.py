"""The golden store: files under goldens/ and `goldens/manifest.json`.

Manifest shape: {"files": {"<path relative to goldens/>": {"sha256", "format", "producer",
"command", "versions", "machine", "inputs": {path: sha256}, "source": {path: sha256}, "seeds",
"config", "tensors": {name: {"shape", "dtype"}}, "tolerances", "substitutions"}}}. "machine" is
the CPU the golden was made on; "inputs" the goldens its exporter read, each by the sha256 it had
then; "source" the exporter's own modules (goldens.source), absent from goldens made before it. A
file's format is "safetensors" (named tensors) or "raw": one array as its little-endian bytes with
no header, the layout of OLMo-core's token and global-indices files.
Loading checks, before any tensor is used, that the entry exists, the path stays inside goldens/,
the sha256 matches, the versions are the pinned ones, the tensors are the listed ones and every
input golden still has the sha256 it was built from; every failure names the file and the command
that regenerates it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from goldens.tolerances import REGENERATE_KINDS

GOLDENS_DIR = Path(__file__).resolve().parent
MANIFEST_NAME = "manifest.json"
FORMATS = ("safetensors", "raw")
PINNED_VERSIONS = {"ai2-olmo-core": "3.0.0", "torch": "2.13.0", "fla-core": "0.6.0"}
"""The exporter's packages; a golden made with other versions is stale."""


class GoldenError(Exception):
    """A golden that is missing, stale, hand-edited or malformed."""


@dataclass(frozen=True)
class GoldenFile:
    """What one exporter produces: the tensors of one file and how they were made."""

    path: str
    tensors: dict[str, np.ndarray]
    producer: str
    """The olmo_core module or function that computed the tensors."""
    seeds: dict[str, int]
    config: dict[str, Any]
    tolerances: dict[str, Any]
    substitutions: list[str] = field(default_factory=list)
    """CPU stand-ins used for GPU-only kernels, one line each."""
    format: str = "safetensors"
    """"safetensors", or "raw" for a file of exactly one 1-D array (OLMo-core's layout)."""


@dataclass(frozen=True)
class Golden:
    """A loaded, verified golden file."""

    path: str
    tensors: dict[str, np.ndarray]
    entry: dict[str, Any]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise GoldenError(
                f"goldens/{self.path} has no tensor {name!r} (it has {sorted(self.tensors)}); "
                f"{_regenerate_hint(self.entry)}"
            )
        return self.tensors[name]

    def group(self, prefix: str) -> dict[str, np.ndarray]:
        """The tensors whose names start with `prefix`, keyed by the rest of the name
        (`group("param.")` is a state dict)."""
        return {k.removeprefix(prefix): v for k, v in self.tensors.items() if k.startswith(prefix)}


_LOADED: list[dict[str, str]] = []
"""One {path: sha256} per active `recording_inputs`."""


@contextmanager
def recording_inputs() -> Iterator[dict[str, str]]:
    """Collects {path: sha256} of every golden `load_golden` verifies inside the block: what an
    exporter was built from."""
    loaded: dict[str, str] = {}
    _LOADED.append(loaded)
    try:
        yield loaded
    finally:
        _LOADED.remove(loaded)


def _regenerate_hint(entry: dict[str, Any] | None) -> str:
    command = (entry or {}).get("command") or "python -m goldens.export"
    return f"regenerate it with `tox -e goldens` (runs `{command}`)"


def resolve(path: str, root: Path = GOLDENS_DIR) -> Path:
    """The file of a manifest path; refuses paths that leave `root`."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise GoldenError(f"manifest path {path!r} must be relative and stay inside goldens/")
    return root.joinpath(*pure.parts)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(root: Path = GOLDENS_DIR) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    if not path.exists():
        return {"files": {}}
    manifest = json.loads(path.read_text())
    if not isinstance(manifest.get("files"), dict):
        raise GoldenError(f"{path} has no 'files' mapping; regenerate with `tox -e goldens`")
    return manifest


def write_manifest(manifest: dict[str, Any], root: Path = GOLDENS_DIR) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (root / MANIFEST_NAME).write_text(text)


def tensor_specs(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in sorted(tensors.items())}


def write_golden(
    golden: GoldenFile,
    *,
    command: str,
    versions: dict[str, str],
    machine: dict[str, str],
    inputs: dict[str, str],
    source: dict[str, str],
    root: Path = GOLDENS_DIR,
) -> None:
    """Write the tensors and their manifest entry (replacing an earlier entry of that path).
    `machine` is the CPU it was made on, `inputs` the {path: sha256} of the goldens it was built
    from, `source` the {path: sha256} of the exporter modules that made it."""
    regenerate = golden.tolerances.get("regenerate")
    if not isinstance(regenerate, dict) or regenerate.get("kind") not in REGENERATE_KINDS:
        raise GoldenError(
            f"{golden.path}: tolerances.regenerate must be a goldens.tolerances.Regenerate "
            f"record (kind one of {REGENERATE_KINDS}), got {regenerate!r}"
        )
    target = resolve(golden.path, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in sorted(golden.tensors.items())}
    if golden.format == "safetensors":
        save_file(tensors, str(target))
    elif golden.format == "raw":
        array = _raw_array(golden.path, tensors)
        target.write_bytes(array.astype(array.dtype.newbyteorder("<")).tobytes())
    else:
        raise GoldenError(f"{golden.path}: format must be one of {FORMATS}, got {golden.format!r}")
    manifest = read_manifest(root)
    manifest["files"][golden.path] = {
        "sha256": sha256_of(target),
        "format": golden.format,
        "producer": golden.producer,
        "command": command,
        "versions": versions,
        "machine": machine,
        "inputs": dict(sorted(inputs.items())),
        "source": source,
        "seeds": golden.seeds,
        "config": golden.config,
        "tensors": tensor_specs(tensors),
        "tolerances": golden.tolerances,
        "substitutions": golden.substitutions,
    }
    write_manifest(manifest, root)


def _raw_array(path: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The one 1-D array a raw file holds."""
    arrays = list(tensors.values())
    if len(arrays) != 1 or arrays[0].ndim != 1:
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        raise GoldenError(f"{path}: a raw file holds exactly one 1-D array, got {shapes}")
    return arrays[0]


def _read_raw(file: Path, specs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The array of a raw file, named and typed as its manifest entry says."""
    ((name, spec),) = specs.items()
    dtype = np.dtype(spec["dtype"])
    return {name: np.fromfile(file, dtype=dtype.newbyteorder("<")).astype(dtype)}


def _check_inputs(path: str, entry: dict[str, Any], files: dict[str, Any], hint: str) -> None:
    """Every golden `path` was built from still has the sha256 it had then."""
    for source, sha in entry.get("inputs", {}).items():
        now = files.get(source, {}).get("sha256")
        if now != sha:
            raise GoldenError(
                f"goldens/{path} was built from goldens/{source} with sha256 {sha[:16]}..., but "
                f"goldens/{source} now has {str(now)[:16]}... (re-exported since): "
                f"goldens/{path} is stale; {hint}"
            )


def load_golden(path: str, root: Path = GOLDENS_DIR, *, check_inputs: bool = True) -> Golden:
    """Load `goldens/<path>` after checking it against its manifest entry (and, with
    `check_inputs`, that the goldens it was built from are unchanged)."""
    files = read_manifest(root)["files"]
    entry = files.get(path)
    if entry is None:
        raise GoldenError(
            f"goldens/{path} is not in goldens/{MANIFEST_NAME}; {_regenerate_hint(None)}"
        )
    hint = _regenerate_hint(entry)
    file = resolve(path, root)
    if not file.exists():
        raise GoldenError(f"goldens/{path} is missing; {hint}")
    if sha256_of(file) != entry.get("sha256"):
        raise GoldenError(
            f"goldens/{path} does not match the sha256 in goldens/{MANIFEST_NAME} "
            f"(edited by hand or stale); {hint}"
        )
    versions = entry.get("versions", {})
    stale = {k: versions.get(k) for k, v in PINNED_VERSIONS.items() if versions.get(k) != v}
    if stale:
        raise GoldenError(
            f"goldens/{path} was made with {stale}, but the pinned versions are "
            f"{PINNED_VERSIONS}; {hint}"
        )
    file_format = entry.get("format")
    if file_format == "safetensors":
        tensors = load_file(str(file))
    elif file_format == "raw" and len(entry.get("tensors", {})) == 1:
        tensors = _read_raw(file, entry["tensors"])
    else:
        raise GoldenError(
            f"goldens/{path}: manifest format {file_format!r} with tensors "
            f"{entry.get('tensors')} is not one of {FORMATS} (raw holds one array); {hint}"
        )
    if tensor_specs(tensors) != entry.get("tensors"):
        raise GoldenError(
            f"goldens/{path}: tensors {tensor_specs(tensors)} differ from the manifest's "
            f"{entry.get('tensors')}; {hint}"
        )
    if check_inputs:
        _check_inputs(path, entry, files, hint)
    for loaded in _LOADED:
        loaded[path] = entry["sha256"]
    return Golden(path=path, tensors=tensors, entry=entry)
