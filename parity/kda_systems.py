"""Correlated, trained-like KDA chunk systems and their float64 inverse: the cases the chunk inverse
is held to by tests/test_kda_inverse.py and timed by bench/kda_inverse.py."""

import jax
import numpy as np

from model.kda_chunk import chunk_system, l2_normalize

WEAK_TO_STRONG = (np.log(1e-4), np.log(20.0))
"""Per-token log-decay magnitudes from trained-like weak gates to past exp underflow."""
WEAK = (np.log(1e-4), np.log(1e-2))
"""Weak gates only: long memory, where the former inverses blow up."""


@jax.jit
def _system(u, xi, sigma, beta, decay):
    k = l2_normalize(u[:, None, :] + sigma * xi)  # [N, C, K]
    return chunk_system(k, -decay, beta)


def correlated_system(seed, sigma, beta_range, log_decay_range, *, N=4, C=64, K=128):
    """(A [N, C, C] float32, beta [N, C]): keys k = l2norm(u + sigma * xi), one shared direction
    u per chunk; beta uniform in beta_range; per-channel decays log-normal around a centre drawn
    in log_decay_range."""
    rng = np.random.default_rng(seed)
    beta = rng.uniform(*beta_range, (N, C)).astype(np.float32)
    centre = rng.uniform(*log_decay_range)
    decay = np.exp(centre + 0.5 * rng.standard_normal((N, C, K))).astype(np.float32)
    u, xi = rng.standard_normal((N, K)), rng.standard_normal((N, C, K))
    A = _system(u.astype(np.float32), xi.astype(np.float32), np.float32(sigma), beta, decay)
    return np.asarray(A), beta


def fp64_inverse(A: np.ndarray) -> np.ndarray:
    """(I + A)^-1 in float64, the reference."""
    return np.linalg.inv(np.eye(A.shape[-1]) + A.astype(np.float64))
