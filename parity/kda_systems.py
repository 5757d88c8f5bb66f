"""Correlated, trained-like KDA chunk systems and their float64 inverse: the cases the chunk inverse
is held to by tests/test_kda_inverse.py and timed by bench/kda_inverse.py; the intra-chunk scores
and their gradients, with which tests/test_kda_pallas.py and tests/test_tpu.py hold the Pallas
kernel to float64."""

import jax
import jax.numpy as jnp
import numpy as np

from model.kda_chunk import chunk_system, intra_chunk_score_pair, l2_normalize

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


SCORE_TENSORS = ("s_qk", "s_kk", "dq", "dk", "dg")


def correlated_chunks(seed, sigma, log_decay_range, *, N=4, C=64, K=128):
    """(q, k, g) [N, C, K] float32: keys and queries l2norm(u + sigma * xi) around one direction
    per chunk, log gates -decay with per-channel decays log-normal around a centre drawn in
    log_decay_range."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((N, 1, K))
    q, k = (l2_normalize(jnp.asarray(u + sigma * rng.standard_normal((N, C, K)))) for _ in "qk")
    centre = rng.uniform(*log_decay_range)
    g = -np.exp(centre + 0.5 * rng.standard_normal((N, C, K)))
    return tuple(np.asarray(x, np.float32) for x in (q, k, g))


def trained_chunks(golden, C=64, channels=None):
    """(q, k, g) [B, H, N, C, K] of goldens/kda_trained_keys.safetensors (loaded: `golden`),
    zero-padded to `channels` (None: as they are), which adds nothing to their scores."""
    B, T, H, K = golden["k"].shape
    pad = [(0, 0)] * 4 + [(0, (channels or K) - K)]
    return tuple(
        np.pad(np.moveaxis(golden[n].reshape(B, T // C, C, H, K), 3, 1), pad) for n in "qkg"
    )


def scores_and_grads(scores):
    """Jitted (q, k, g, w_qk, w_kk) -> (s_qk, s_kk, dq, dk, dg): `scores(q, k, g)`
    (`intra_chunk_score_pair` or the kernel) and the gradients of sum(s_qk w_qk + s_kk w_kk)."""

    def run(q, k, g, w_qk, w_kk):
        def objective(q, k, g):
            s_qk, s_kk = scores(q, k, g)
            return jnp.sum(s_qk * w_qk) + jnp.sum(s_kk * w_kk)

        return (*scores(q, k, g), *jax.grad(objective, argnums=(0, 1, 2))(q, k, g))

    return jax.jit(run)


def with_cotangents(q, k, g, seed=0):
    """(q, k, g, w_qk, w_kk): the inputs of `scores_and_grads` with standard normal cotangents."""
    rng = np.random.default_rng(seed)
    C = q.shape[-2]
    w = [rng.standard_normal((*q.shape[:-1], C)).astype(np.float32) for _ in range(2)]
    return (q, k, g, *w)


def float64_scores(inputs, device=None) -> list[np.ndarray]:
    """`scores_and_grads(intra_chunk_score_pair)` of `inputs` in float64 (on `device`, None: the
    default), the reference."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        as64 = jax.device_put([np.asarray(x, np.float64) for x in inputs], device)
        return [np.asarray(t) for t in scores_and_grads(intra_chunk_score_pair)(*as64)]


def scores_error(ours, exact) -> dict[str, float]:
    """Each of SCORE_TENSORS' largest |ours - exact| over its largest |exact|."""
    return {
        n: float(np.max(np.abs(np.asarray(o, np.float64) - e)) / np.max(np.abs(e)))
        for n, o, e in zip(SCORE_TENSORS, ours, exact, strict=True)
    }
