"""`python -m goldens.check`: regenerate every golden into a temporary folder and compare it with
the committed one. Each tensor must be bit-identical or, where another CPU's kernels round
differently, within the `regenerate_rtol` its manifest states (at most 1e-6). Prints which; exits 1
naming every file and tensor that differs, and any manifest field that changed."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from goldens.export import COMPONENTS, export
from goldens.store import GOLDENS_DIR, load_golden, read_manifest


def compare_tensor(committed: np.ndarray, fresh: np.ndarray, rtol: float) -> tuple[bool, str]:
    """(ok, description) for one tensor pair."""
    if committed.shape != fresh.shape or committed.dtype != fresh.dtype:
        return (
            False,
            f"{fresh.shape} {fresh.dtype} vs committed {committed.shape} {committed.dtype}",
        )
    if committed.tobytes() == fresh.tobytes():
        return True, "bit-identical"
    a, b = committed.astype(np.float64), fresh.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False, "NaN in one and not the other"
    scale = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(a - b) / scale, 0.0)
    worst = float(np.nanmax(rel))
    return worst <= rtol, f"max relative error {worst:.3e} (allowed {rtol:.0e})"


def compare(committed_root: Path, fresh_root: Path) -> tuple[list[str], list[str]]:
    """(report lines, failures) of the fresh goldens against the committed ones."""
    committed = read_manifest(committed_root)["files"]
    fresh = read_manifest(fresh_root)["files"]
    report, failures = [], []
    for path in sorted(set(committed) - set(fresh)):
        failures.append(f"{path}: committed but no longer exported")
    for path in sorted(set(fresh) - set(committed)):
        failures.append(f"{path}: exported but not committed (run `tox -e goldens`)")
    for path in sorted(set(committed) & set(fresh)):
        old, new = load_golden(path, committed_root), load_golden(path, fresh_root)
        changed = sorted(
            k
            for k in set(old.entry) | set(new.entry)
            if k != "sha256" and old.entry.get(k) != new.entry.get(k)
        )
        if changed:
            failures.append(f"{path}: manifest fields differ: {changed}")
            continue
        rtol = old.entry["tolerances"]["regenerate_rtol"]
        for name in sorted(old.tensors):
            ok, what = compare_tensor(old.tensors[name], new.tensors[name], rtol)
            (report if ok else failures).append(f"{path} {name}: {what}")
    return report, failures


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="goldens-check-") as tmp:
        export(list(COMPONENTS), Path(tmp))
        report, failures = compare(GOLDENS_DIR, Path(tmp))
    identical = [line for line in report if line.endswith("bit-identical")]
    print(f"goldens-check: {len(identical)} tensors bit-identical")
    for line in report:
        if line not in identical:
            print(f"  within tolerance: {line}")
    for line in failures:
        print(f"  MISMATCH: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
