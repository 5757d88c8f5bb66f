"""The three KDA chunk inverses at C = 64, K = 128 on 256 chunk-heads of correlated keys with weak
(trained-like, long-memory) gates: time and max error against float64, each as a ratio to forward
substitution; plus the max error on the trained keys golden (goldens/kda_trained_keys)."""

import jax
import numpy as np

from bench.timing import best_seconds
from goldens.store import load_golden
from model.config import KDA_INVERSES
from model.kda_chunk import invert_unit_lower, kda_chunk_system
from parity.kda_systems import WEAK, correlated_system, fp64_inverse

CHUNK_HEADS = 256


def _max_error(X, reference) -> float:
    X = np.asarray(X)
    return float(np.max(np.abs(X - reference))) if np.isfinite(X).all() else float("inf")


def run() -> dict[str, float]:
    A, _ = correlated_system(0, 0.1, (1.9, 2.0), WEAK, N=CHUNK_HEADS)
    trained = load_golden("kda_trained_keys.safetensors")
    A_trained = np.asarray(kda_chunk_system(trained["k"], trained["g"], trained["beta"]))
    times, errors, trained_errors = {}, {}, {}
    for method in KDA_INVERSES:
        invert = jax.jit(lambda a, m=method: invert_unit_lower(a, m))
        times[method] = best_seconds(lambda f=invert: jax.block_until_ready(f(A)))
        errors[method] = _max_error(invert(A), fp64_inverse(A))
        trained_errors[method] = _max_error(invert(A_trained), fp64_inverse(A_trained))
    base = "forward_substitution"
    figures = {f"{base} time (ms)": 1e3 * times[base]}
    for method in KDA_INVERSES:
        if method != base:
            figures[f"{method} / {base} time"] = times[method] / times[base]
    for method in KDA_INVERSES:
        figures[f"{method} max error, correlated keys"] = errors[method]
        figures[f"{method} max error, trained keys"] = trained_errors[method]
    return figures
