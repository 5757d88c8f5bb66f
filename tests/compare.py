"""The one comparison helper: whole pytrees, NaN/Inf rejected on either side, every failing leaf
reported with its path, dtypes, max absolute error and relative RMS error."""

import jax
import numpy as np

from goldens.tolerances import Tol


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def assert_close(name: str, *, expected, actual, tol: Tol) -> None:
    """Fail unless every leaf has |actual - expected| <= tol.atol + tol.rtol * |expected|."""
    want, got = _leaves(expected), _leaves(actual)
    if want.keys() != got.keys():
        raise AssertionError(
            f"{name}: leaves differ: missing {sorted(want.keys() - got.keys())}, "
            f"unexpected {sorted(got.keys() - want.keys())}"
        )
    problems = []
    for path in want:
        e, a = want[path], got[path]
        label = f"{name}{path}"
        if e.shape != a.shape:
            problems.append(f"{label}: shape {a.shape}, expected {e.shape}")
            continue
        bad = [side for side, v in (("expected", e), ("actual", a)) if not np.all(np.isfinite(v))]
        if bad:
            problems.append(f"{label}: non-finite values in {' and '.join(bad)}")
            continue
        e64, a64 = e.astype(np.float64), a.astype(np.float64)
        err = np.abs(a64 - e64)
        if np.all(err <= tol.atol + tol.rtol * np.abs(e64)):
            continue
        rel_rms = np.sqrt(np.mean(err**2) / max(np.mean(e64**2), np.finfo(np.float64).tiny))
        problems.append(
            f"{label} ({a.dtype} vs expected {e.dtype}): max abs error {err.max():.3e}, "
            f"relative RMS error {rel_rms:.3e}, allowed rtol={tol.rtol:g} atol={tol.atol:g}"
        )
    if problems:
        raise AssertionError("\n".join(problems))
