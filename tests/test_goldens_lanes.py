"""goldens-check's exports in parallel lanes (goldens.lanes): each component exported beside
another gives the bytes and manifest entries it gives exported alone; an export that fails fails
goldens.check naming the component and showing its stderr."""

import subprocess
import sys

import numpy as np
import pytest

from goldens import check, lanes
from goldens.export import COMPONENTS
from goldens.source import REPO
from goldens.store import GoldenError, GoldenFile, read_manifest, resolve, write_golden
from goldens.tolerances import REGENERATE_EXACT as EXACT

CHEAPEST = ("segment_ids", "rms_norm")
"""Two of the quickest exports (about 7 s each alone, most of it starting the process)."""


def test_every_component_has_its_export_seconds():
    assert set(lanes.EXPORT_SECONDS) == set(COMPONENTS)


def test_exports_in_lanes_are_the_exports_alone(tmp_path):
    """Two exports at once, each in its own process and lane, one after this process's own job:
    every file and manifest entry is the one the same exports write one after another in one
    process, with nothing beside them."""
    result, done = lanes.export_in_lanes(
        CHEAPEST, tmp_path / "lanes", ("own job", lambda: "ran"), workers=2
    )
    assert result == "ran"
    first, second = lanes.longest_first(CHEAPEST)
    assert [[name for name, _ in lane.jobs] for lane in done] == [["own job", second], [first]]
    alone = tmp_path / "alone"
    subprocess.run(
        [sys.executable, "-m", "goldens.export", *CHEAPEST, "--out", alone], cwd=REPO, check=True
    )
    fresh, exported = read_manifest(tmp_path / "lanes")["files"], read_manifest(alone)["files"]
    assert fresh == exported
    for path in exported:
        assert resolve(path, tmp_path / "lanes").read_bytes() == resolve(path, alone).read_bytes()


def test_a_failed_export_fails_the_check_naming_it_and_its_stderr(monkeypatch, capsys):
    def command(component, out):
        code = "import sys; sys.exit('the kda exporter broke')" if component == "kda" else ""
        return [sys.executable, "-c", code]

    monkeypatch.setattr(lanes, "export_command", command)
    monkeypatch.setattr(check, "regenerate_saved_steps", list)
    assert check.main() == 1
    assert capsys.readouterr().out == (
        "goldens-check: `python -m goldens.export kda` failed (exit 1):\nthe kda exporter broke\n\n"
    )


def test_a_path_two_components_export_is_refused(tmp_path):
    golden = GoldenFile(
        "x.safetensors", {"x": np.zeros(1)}, "test", {}, {}, {"regenerate": EXACT.as_dict()}
    )
    for folder in ("a", "b"):
        write_golden(
            golden,
            command="test",
            versions={},
            machine={},
            inputs={},
            source={},
            root=tmp_path / folder,
        )
    with pytest.raises(
        GoldenError, match=r"^goldens/x\.safetensors is exported by two components$"
    ):
        lanes.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
