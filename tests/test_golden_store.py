"""The golden store refuses missing, stale, hand-edited and malformed goldens with a message that
names the file and how to regenerate it; `goldens.check` tells bit-identical from within-tolerance
from mismatched regenerations, naming the file and tensor, and goldens made by another exporter
source."""

import dataclasses
import hashlib
import json
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from goldens import check
from goldens.export import COMPONENTS
from goldens.source import REPO, exporter_source
from goldens.store import (
    GOLDENS_DIR,
    PINNED_VERSIONS,
    GoldenError,
    GoldenFile,
    load_golden,
    read_manifest,
    recording_inputs,
    write_golden,
    write_manifest,
)
from goldens.tolerances import REGENERATE_EXACT, Regenerate

ROOT = Path(__file__).resolve().parents[1]
PATH = "unit/sample.safetensors"
COMMAND = "python -m goldens.export sample"


ROUNDING = Regenerate("rounding", rtol=1e-6, of_max=1e-7)
MACHINE = {"cpu": "test CPU", "torch_cpu_capability": "AVX2", "simd": "avx2 fma"}
SOURCE = {"goldens/sample.py": "0" * 64}


def _sample(values=None, regenerate=None) -> GoldenFile:
    values = np.arange(6, dtype=np.float32).reshape(2, 3) if values is None else values
    return GoldenFile(
        path=PATH,
        tensors={"y": values, "x": np.ones(4, np.float32)},
        producer="test",
        seeds={"torch": 0},
        config={},
        tolerances={"regenerate": ROUNDING.as_dict() if regenerate is None else regenerate},
    )


def _write(root: Path, golden: GoldenFile | None = None, inputs=None, machine=MACHINE) -> None:
    write_golden(
        golden or _sample(),
        command=COMMAND,
        versions=dict(PINNED_VERSIONS),
        machine=machine,
        inputs=inputs or {},
        source=SOURCE,
        root=root,
    )


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
        tolerances={"regenerate": REGENERATE_EXACT.as_dict()},
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


@pytest.mark.parametrize("regenerate", [{}, {"kind": "bitwise"}, 1e-6])
def test_regenerate_rule_is_a_known_kind(tmp_path, regenerate):
    with pytest.raises(GoldenError, match=r"tolerances\.regenerate must be"):
        _write(tmp_path, _sample(regenerate=regenerate))


def test_entry_records_machine_and_inputs(tmp_path):
    _write(tmp_path, _raw())
    sha = read_manifest(tmp_path)["files"]["unit/tokens.npy"]["sha256"]
    _write(tmp_path, inputs={"unit/tokens.npy": sha})
    entry = load_golden(PATH, tmp_path).entry
    assert entry["machine"] == MACHINE
    assert entry["inputs"] == {"unit/tokens.npy": sha}


def test_loads_are_recorded_as_inputs(tmp_path):
    _write(tmp_path, _raw())
    with recording_inputs() as inputs:
        load_golden("unit/tokens.npy", tmp_path)
    assert inputs == {
        "unit/tokens.npy": read_manifest(tmp_path)["files"]["unit/tokens.npy"]["sha256"]
    }


def test_golden_built_from_a_changed_input_is_stale(tmp_path):
    """Re-exporting an input (the trace's params) leaves what was built from it stale: loading
    it fails naming both files."""
    _write(tmp_path, _raw())
    sha = read_manifest(tmp_path)["files"]["unit/tokens.npy"]["sha256"]
    _write(tmp_path, inputs={"unit/tokens.npy": sha})
    _write(tmp_path, _raw({"tokens": np.array([2, 256, 65535], np.uint16)}))
    with pytest.raises(
        GoldenError,
        match=rf"goldens/{PATH} was built from goldens/unit/tokens.npy with sha256 {sha[:16]}",
    ):
        load_golden(PATH, tmp_path)
    load_golden(PATH, tmp_path, check_inputs=False)


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
    assert report == [f"{PATH}: bit-identical (2 tensors)"]


def test_check_within_rounding_is_reported(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    values[1, 2] = np.nextafter(values[1, 2], np.float32(10))  # one ulp of 5.0: 9.5e-8 relative
    report, failures = _regenerated(tmp_path, values)
    assert failures == []
    assert report == [
        f"{PATH}: bit-identical + rounding (2 tensors)",
        f"  {PATH} y: max |gap| / (rtol |x| + of_max max|x|) = 0.0867 (rtol 1e-06, of_max 1e-07)",
    ]


def test_check_rounding_floor_is_relative_to_the_tensors_largest_element(tmp_path):
    """A near-zero element may move by the rounding of the tensor's large ones, not more."""
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    values[0, 0] = 4e-7  # committed 0: allowed 1e-7 * 5 = 5e-7
    assert _regenerated(tmp_path, values)[1] == []
    values[0, 0] = 6e-7
    (failure,) = _regenerated(tmp_path / "again", values)[1]
    assert failure.startswith(f"{PATH} y: max |gap| / (rtol |x| + of_max max|x|) = 1.2")


def test_check_mismatch_names_file_and_tensor(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3) * 1.001
    _, failures = _regenerated(tmp_path, values)
    assert failures == [
        f"{PATH} y: max |gap| / (rtol |x| + of_max max|x|) = 909 (rtol 1e-06, of_max 1e-07)"
    ]


def test_check_names_both_cpus(tmp_path):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _write(committed)
    _write(fresh, machine={**MACHINE, "cpu": "other CPU"})
    report, failures = check.compare(committed, fresh)
    assert failures == []
    assert report[0] == (
        "CPUs differ: committed goldens made on test CPU (torch AVX2; avx2 fma); "
        "regenerated on other CPU (torch AVX2; avx2 fma)"
    )


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


TRACE = Regenerate("envelope", rtol=1e-6, of_max=1e-7, factor=4.0)


def _trace(root: Path, ce, perturbed_ce, params, perturbed_params) -> None:
    """A two-step trace: its metrics, its one-ulp perturbed run, its params at step 2."""

    def file(path, tensors, config):
        golden = GoldenFile(path, tensors, "test", {}, config, {"regenerate": TRACE.as_dict()})
        _write(root, golden)

    file(check.TRACE_METRICS, {"ce": np.array(ce), "lr": np.array([1e-3, 2e-3])}, {})
    file(
        check.TRACE_PERTURBED,
        {"ce": np.array([perturbed_ce]), "params_rel_diff_step2": np.array([perturbed_params])},
        {"params": ["w"]},
    )
    file("trace/params_step2.safetensors", {"w": np.array(params, np.float32)}, {})


def _trace_check(tmp_path, ce, params):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _trace(committed, [5.0, 4.0], [5.0, 4.004], [3.0, 4.0], [1e-3])  # spreads: CE 1e-3, w 1e-3
    _trace(fresh, ce, [5.0, 4.004], params, [1e-3])
    return check.compare(committed, fresh)


def test_chaotic_trace_within_its_one_ulp_envelope(tmp_path):
    """A regenerated trace moves as far as OLMo-core's own one-ulp runs do: within the factor
    times that spread it passes, reported as such, never required bitwise."""
    report, failures = _trace_check(tmp_path, [5.0, 4.01], [3.0, 4.0 * (1 + 2e-3)])
    assert failures == []
    assert f"{check.TRACE_METRICS}: bit-identical + envelope (2 tensors)" in report
    assert "trace/params_step2.safetensors: envelope (1 tensors)" in report


def test_chaotic_trace_outside_its_envelope_names_tensor_and_step(tmp_path):
    _, failures = _trace_check(tmp_path, [5.0, 4.1], [3.0, 4.1])
    assert failures == [
        "trace/metrics.safetensors ce: largest gap / OLMo-core's one-ulp spread 25 at ce[1] "
        "(allowed 4)",
        "trace/params_step2.safetensors w: largest gap / OLMo-core's one-ulp spread 20 at w "
        "(allowed 4)",
    ]


def test_one_ulp_runs_that_stopped_spreading_are_named(tmp_path):
    """Spreads are held both ways: regenerated one-ulp runs that land on the regenerated trace
    (the perturbation lost) fail, as runs that spread too far do."""
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _trace(committed, [5.0, 4.0], [5.0, 4.004], [3.0, 4.0], [1e-3])
    _trace(fresh, [5.0, 4.0], [5.0, 4.0], [3.0, 4.0], [1e-5])
    _, failures = check.compare(committed, fresh)
    assert failures == [
        "trace/perturbed.safetensors ce: largest gap / OLMo-core's one-ulp spread 0 at ce[0, 0] "
        "(allowed 4); regenerated one-ulp spread / committed 0.001 at ce[1] (allowed 1/4 to 4)",
        "trace/perturbed.safetensors params_rel_diff_step2: largest gap / OLMo-core's one-ulp "
        "spread 0.01 at params_rel_diff_step2[0, 0] (allowed 4); regenerated one-ulp spread / "
        "committed 0.01 at params_rel_diff_step2 median (allowed 1/4 to 4)",
    ]


def test_exporter_source_is_the_goldens_modules_the_exporter_imports():
    source = exporter_source("goldens.trace")
    assert {"goldens/trace.py", "goldens/store.py", "goldens/runtime/standins.py"} <= set(source)
    assert "goldens/tolerances.py" not in source and all(p.startswith("goldens/") for p in source)
    for path, digest in source.items():
        assert digest == hashlib.sha256((REPO / path).read_bytes()).hexdigest(), path


def test_committed_goldens_record_this_checkouts_exporter_source():
    """An exporter module edited since its goldens were made is named in the gate, with the
    goldens it made (goldens-check would fail them)."""
    stale = [
        path
        for path, entry in read_manifest()["files"].items()
        if "source" in entry
        and entry["source"] != exporter_source(COMPONENTS[entry["command"].split()[-1]])
    ]
    assert stale == []


def _state_trace(root: Path, main, perturbed_main) -> None:
    """A one-step trace's state after step 1 and its one-ulp perturbed run's distance to it."""
    tolerances = {"regenerate": TRACE.as_dict()}
    state = {"w.main": np.array(main, np.float32), "w.step": np.ones(1, np.float32)}
    _write(root, GoldenFile("trace/state_step1.safetensors", state, "test", {}, {}, tolerances))
    distances = {"state_rel_diff_step1": np.array([[perturbed_main, 0.0]])}
    config = {"state": ["w.main", "w.step"]}
    _write(root, GoldenFile(check.TRACE_PERTURBED, distances, "test", {}, config, tolerances))


def test_a_regenerated_state_is_held_to_its_own_one_ulp_spread(tmp_path):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _state_trace(committed, [3.0, 4.0], 1e-3)
    _state_trace(fresh, [3.0, 4.0 * (1 + 2e-3)], 1e-3)  # 1.6e-3 by norms: 1.6x its spread
    assert check.compare(committed, fresh)[1] == []
    _state_trace(fresh, [3.0, 4.04], 1e-3)
    assert check.compare(committed, fresh)[1] == [
        "trace/state_step1.safetensors w.main: largest gap / OLMo-core's one-ulp spread 8 at "
        "w.main (allowed 4)"
    ]


def test_check_names_a_golden_made_by_other_exporter_source(tmp_path):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _write(committed)
    _write(fresh)
    _edit_entry(fresh, source={"goldens/sample.py": "1" * 64, "goldens/new.py": "2" * 64})
    _, failures = check.compare(committed, fresh)
    assert failures == [
        f"{PATH}: made by another exporter source (goldens/new.py, goldens/sample.py changed "
        "since); run `tox -e goldens`"
    ]


def test_check_reports_goldens_made_before_sources_were_recorded(tmp_path):
    committed, fresh = tmp_path / "committed", tmp_path / "fresh"
    _write(committed)
    _write(fresh)
    manifest = read_manifest(committed)
    del manifest["files"][PATH]["source"]
    write_manifest(manifest, committed)
    report, failures = check.compare(committed, fresh)
    assert failures == []
    assert report[-1] == (
        "1 committed goldens record no exporter source (made before goldens.source); "
        "`tox -e goldens` records it"
    )
