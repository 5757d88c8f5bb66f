"""The golden store refuses missing, stale, hand-edited and malformed goldens with a message that
names the file and how to regenerate it; `goldens.check` tells bit-identical from within-tolerance
from mismatched regenerations, naming the file and tensor."""

import dataclasses
import json
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from goldens import check
from goldens.store import (
    GOLDENS_DIR,
    PINNED_VERSIONS,
    GoldenError,
    GoldenFile,
    load_golden,
    read_manifest,
    write_golden,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[1]
PATH = "unit/sample.safetensors"
COMMAND = "python -m goldens.export sample"


def _sample(values=None, rtol=1e-6) -> GoldenFile:
    values = np.arange(6, dtype=np.float32).reshape(2, 3) if values is None else values
    return GoldenFile(
        path=PATH,
        tensors={"y": values, "x": np.ones(4, np.float32)},
        producer="test",
        seeds={"torch": 0},
        config={},
        tolerances={"regenerate_rtol": rtol},
    )


def _write(root: Path, golden: GoldenFile | None = None) -> None:
    write_golden(golden or _sample(), command=COMMAND, versions=dict(PINNED_VERSIONS), root=root)


def _edit_entry(root: Path, **changes) -> None:
    manifest = read_manifest(root)
    manifest["files"][PATH].update(changes)
    write_manifest(manifest, root)


def test_round_trip(tmp_path):
    _write(tmp_path)
    golden = load_golden(PATH, tmp_path)
    np.testing.assert_array_equal(golden["y"], _sample().tensors["y"])
    assert golden.entry["tensors"]["y"] == {"shape": [2, 3], "dtype": "float32"}
    assert golden.entry["command"] == COMMAND


def test_writing_twice_gives_identical_bytes(tmp_path):
    _write(tmp_path)
    first = (tmp_path / PATH).read_bytes(), (tmp_path / "manifest.json").read_bytes()
    _write(tmp_path)
    assert ((tmp_path / PATH).read_bytes(), (tmp_path / "manifest.json").read_bytes()) == first


def _raw(tensors=None) -> GoldenFile:
    tensors = {"tokens": np.array([1, 256, 65535], np.uint16)} if tensors is None else tensors
    return GoldenFile(
        path="unit/tokens.npy",
        tensors=tensors,
        producer="test",
        seeds={},
        config={},
        tolerances={"regenerate_rtol": 0.0},
        format="raw",
    )


def test_raw_file_is_the_little_endian_array_alone(tmp_path):
    """OLMo-core's token and global-indices layout: no header, little-endian."""
    _write(tmp_path, _raw())
    assert (tmp_path / "unit/tokens.npy").read_bytes() == bytes([1, 0, 0, 1, 255, 255])
    golden = load_golden("unit/tokens.npy", tmp_path)
    np.testing.assert_array_equal(golden["tokens"], [1, 256, 65535])
    assert golden["tokens"].dtype == np.uint16
    assert golden.entry["format"] == "raw"


@pytest.mark.parametrize(
    "tensors",
    [
        {"a": np.zeros(2, np.uint16), "b": np.zeros(2, np.uint16)},
        {"a": np.zeros((2, 2), np.uint16)},
    ],
    ids=["two-arrays", "2-d"],
)
def test_raw_file_holds_one_1d_array(tmp_path, tensors):
    with pytest.raises(GoldenError, match="a raw file holds exactly one 1-D array"):
        _write(tmp_path, _raw(tensors))


def test_unknown_format(tmp_path):
    with pytest.raises(GoldenError, match=r"format must be one of \('safetensors', 'raw'\)"):
        _write(tmp_path, dataclasses.replace(_sample(), format="npy"))
    _write(tmp_path)
    _edit_entry(tmp_path, format="npy")
    with pytest.raises(GoldenError, match=r"manifest format 'npy' .* is not one of"):
        load_golden(PATH, tmp_path)


def test_missing_entry(tmp_path):
    with pytest.raises(
        GoldenError, match=rf"goldens/{PATH} is not in goldens/manifest.json; regenerate"
    ):
        load_golden(PATH, tmp_path)


def test_missing_file(tmp_path):
    _write(tmp_path)
    (tmp_path / PATH).unlink()
    with pytest.raises(GoldenError, match=rf"goldens/{PATH} is missing; .*`{COMMAND}`"):
        load_golden(PATH, tmp_path)


def test_hand_edited_file_fails_its_sha256(tmp_path):
    _write(tmp_path)
    data = bytearray((tmp_path / PATH).read_bytes())
    data[-1] ^= 1
    (tmp_path / PATH).write_bytes(bytes(data))
    with pytest.raises(
        GoldenError, match=rf"goldens/{PATH} does not match the sha256.*`{COMMAND}`"
    ):
        load_golden(PATH, tmp_path)


def test_golden_from_other_versions_is_stale(tmp_path):
    _write(tmp_path)
    _edit_entry(tmp_path, versions={**PINNED_VERSIONS, "ai2-olmo-core": "2.4.0"})
    with pytest.raises(GoldenError, match=r"was made with \{'ai2-olmo-core': '2.4.0'\}"):
        load_golden(PATH, tmp_path)


def test_tensor_list_must_match_manifest(tmp_path):
    _write(tmp_path)
    _edit_entry(tmp_path, tensors={"y": {"shape": [3, 2], "dtype": "float32"}})
    with pytest.raises(GoldenError, match=r"tensors .* differ from the manifest's"):
        load_golden(PATH, tmp_path)


def test_unknown_tensor_name(tmp_path):
    _write(tmp_path)
    with pytest.raises(GoldenError, match=r"has no tensor 'z' \(it has \['x', 'y'\]\)"):
        load_golden(PATH, tmp_path)["z"]


@pytest.mark.parametrize("path", ["../outside.safetensors", "/tmp/abs.safetensors", "a/../../b"])
def test_paths_stay_inside_goldens(tmp_path, path):
    manifest = {"files": {path: {"sha256": "0"}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match="must be relative and stay inside goldens/"):
        load_golden(path, tmp_path)


@pytest.mark.parametrize("rtol", [None, 1e-5, -1.0])
def test_regenerate_tolerance_is_at_most_1e6(tmp_path, rtol):
    with pytest.raises(GoldenError, match="regenerate_rtol must lie in"):
        _write(tmp_path, _sample(rtol=rtol))


def test_golden_fixture_fails_with_the_store_message(pytester):
    pytester.makeconftest(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "spec = importlib.util.spec_from_file_location(\n"
        f"    'project_conftest', {str(ROOT / 'conftest.py')!r}\n"
        ")\n"
        "project = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(project)\n"
        "golden = project.golden\n"
    )
    pytester.makepyfile("def test_it(golden):\n    golden('no/such.safetensors')\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*goldens/no/such.safetensors is not in goldens/manifest.json*"])


def test_pinned_versions_are_the_goldens_extra():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", req).groups() for req in extra["goldens"])
    assert {k: pins[k] for k in PINNED_VERSIONS} == PINNED_VERSIONS


def test_committed_goldens_match_their_manifest():
    for path in read_manifest(GOLDENS_DIR)["files"]:
        load_golden(path)


def _regenerated(tmp_path, fresh_values) -> tuple[list[str], list[str]]:
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _write(committed)
    _write(fresh, _sample(fresh_values))
    return check.compare(committed, fresh)


def test_check_bit_identical(tmp_path):
    report, failures = _regenerated(tmp_path, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert failures == []
    assert report == [f"{PATH} x: bit-identical", f"{PATH} y: bit-identical"]


def test_check_within_tolerance_is_reported(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    values[1, 2] = np.nextafter(values[1, 2], np.float32(10))  # one ulp of 5.0: 9.5e-8 relative
    report, failures = _regenerated(tmp_path, values)
    assert failures == []
    assert report[1] == f"{PATH} y: max relative error 9.537e-08 (allowed 1e-06)"


def test_check_mismatch_names_file_and_tensor(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3) * 1.001
    _, failures = _regenerated(tmp_path, values)
    assert failures == [f"{PATH} y: max relative error 9.991e-04 (allowed 1e-06)"]


def test_check_missing_and_extra_files(tmp_path):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _write(committed)
    fresh.mkdir()
    shutil.copy(committed / "manifest.json", fresh / "manifest.json")
    manifest = read_manifest(fresh)
    manifest["files"]["new.safetensors"] = manifest["files"].pop(PATH)
    write_manifest(manifest, fresh)
    _, failures = check.compare(committed, fresh)
    assert failures == [
        f"{PATH}: committed but no longer exported",
        "new.safetensors: exported but not committed (run `tox -e goldens`)",
    ]
