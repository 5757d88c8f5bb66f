"""The comparison helpers: whole pytrees elementwise (NaN/Inf rejected on either side, every failing
leaf reported with its path, dtypes, max absolute error and relative RMS error), and named tensors
against an fp64 oracle (formula parity and rounding parity, relative by norms)."""

import jax
import numpy as np

from goldens.envelope import norm_gap
from goldens.tolerances import (
    FLOAT32_UNIT_ROUNDOFF,
    FORMULA_PARITY,
    ROUNDING_PARITY,
    Tol,
)


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _allowed(expected: np.ndarray, tol: Tol) -> np.ndarray:
    """atol + rtol |expected|, elementwise."""
    return tol.atol + tol.rtol * np.abs(expected)


def tolerance_used(expected, actual, tol: Tol) -> float:
    """The largest |actual - expected| / (atol + rtol |expected|) over every leaf: `assert_close`
    passes where this is at most 1."""
    want, got = _leaves(expected), _leaves(actual)
    return max(
        float(np.max(np.abs(got[p].astype(np.float64) - e) / _allowed(e, tol)))
        for p, e in ((p, want[p].astype(np.float64)) for p in want)
    )


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
        if np.all(err <= _allowed(e64, tol)):
            continue
        rel_rms = np.sqrt(np.mean(err**2) / max(np.mean(e64**2), np.finfo(np.float64).tiny))
        problems.append(
            f"{label} ({a.dtype} vs expected {e.dtype}): max abs error {err.max():.3e}, "
            f"relative RMS error {rel_rms:.3e}, allowed rtol={tol.rtol:g} atol={tol.atol:g}"
        )
    if problems:
        raise AssertionError("\n".join(problems))


def parity_gaps(oracle, actual: dict) -> dict[str, float]:
    """|actual - oracle| / |oracle| (norms) of each of `actual`'s tensors against the fp64
    oracle's tensor of that name."""
    return {name: norm_gap(value, oracle[name]) for name, value in actual.items()}


def leaf_gaps(expected, actual) -> dict[str, float]:
    """|actual - expected| / |expected| (norms) of each leaf of two pytrees, by its path: each
    tensor against its own norm, however small."""
    want, got = _leaves(expected), _leaves(actual)
    return {path: norm_gap(got[path], e) for path, e in want.items()}


def assert_gaps_within(case: str, gaps: dict[str, float], bound: float, what: str) -> None:
    """Fail naming every tensor whose relative gap (`gaps`, by norms) is over `bound`, or NaN."""
    bad = {n: g for n, g in gaps.items() if not g <= bound}
    if bad:
        lines = [f"  {n}: relative error {g:.3e}" for n, g in sorted(bad.items())]
        raise AssertionError(
            f"{case}: {what} (allowed {bound:g}, relative to each tensor's norm) fails "
            f"for {len(bad)} of {len(gaps)} tensors:\n" + "\n".join(lines)
        )


def assert_formula_parity(case: str, oracle, actual: dict, bound: float = FORMULA_PARITY) -> None:
    """JAX float64 vs OLMo-core float64: every tensor within `bound` of the oracle's (relative, by
    norms). Fails naming every tensor that is not."""
    gaps = parity_gaps(oracle, actual)
    assert_gaps_within(case, gaps, bound, "formula parity (float64 vs OLMo-core float64)")


def rounding_ratios(oracle, actual: dict) -> dict[str, tuple[float, float]]:
    """Each of `actual`'s tensors: (its distance to the fp64 oracle, OLMo-core float32's own, at
    least float32's unit roundoff), both relative by norms."""
    return {
        name: (gap, max(oracle[f"fp32_error.{name}"].item(), FLOAT32_UNIT_ROUNDOFF))
        for name, gap in parity_gaps(oracle, actual).items()
    }


def assert_rounding_parity(
    case: str, oracle, actual: dict, factor: float = ROUNDING_PARITY
) -> None:
    """JAX float32 vs the fp64 oracle: each tensor within `factor` times OLMo-core float32's own
    distance to the oracle (`rounding_ratios`). Fails naming each tensor."""
    bad = {
        n: (g, o) for n, (g, o) in rounding_ratios(oracle, actual).items() if not g <= factor * o
    }
    if bad:
        lines = [
            f"  {n}: relative error {g:.3e}, OLMo-core float32's {o:.3e} ({g / o:.1f}x)"
            for n, (g, o) in sorted(bad.items())
        ]
        raise AssertionError(
            f"{case}: rounding parity (float32 vs the fp64 oracle, allowed {factor:g}x "
            f"OLMo-core float32's own error) fails for {len(bad)} of {len(actual)} tensors:\n"
            + "\n".join(lines)
        )
