"""Kimi Delta Attention math in full precision (float32; float64 for float64 inputs,
`model.precision`): the recurrent reference, the chunked form and the inverse of its chunk system.
Mirrors FLA's `fla/ops/kda/naive.py` (`naive_recurrent_kda`, `naive_chunk_kda`), which OLMo-core's
`KimiDeltaAttention` reaches through `chunk_kda`.

Per head, with state S [K, V], decay g_t [K] (log space, <= 0) and beta_t:
    S <- diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale * S^T q_t.

Chunked (C tokens a chunk, G = cumsum of g inside it, Gamma_i = exp(G_i)):
    A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (i > j, strictly lower)
    T = (I + A)^-1 diag(beta);   w = T (Gamma * k);   u = T v;   v'_i = u_i - w_i S_0
    o_i = (q_i * Gamma_i) S_0 + sum_{j <= i} q_i^T diag(exp(G_i - G_j)) k_j v'_j
    S_C = diag(Gamma_C) S_0 + sum_j (exp(G_C - G_j) * k_j) v'_j^T
Every exponent G_i - G_j (i >= j) is computed as a sum of the gates between j and i, never as a
difference of cumulative sums, and never exp of a positive number (`intra_chunk_scores`); (I + A)^-1
is forward substitution with the inverse's own gradient (`kda_chunk_inverse`).

Segment ids (optional, [B, T]) restart the state at each new segment, as running each document
alone; OLMo-core's hero passes none (the whole instance is one sequence).

Differences from FLA: `invert_unit_lower` offers the two inverses MaxText once used (they overflow
on trained keys; kept to show it); T need not be a multiple of the chunk size (zero padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from model.precision import full_precision, upcast

L2_NORM_EPS = 1e-6
"""FLA's `l2norm` eps, added to the sum of squares (not to the norm)."""
SUB_CHUNK = 8
"""Intra-chunk scores decay per pair inside SUB_CHUNK x SUB_CHUNK diagonal blocks and factor into
matmuls across them (`intra_chunk_scores`), as FLA's chunk kernels split a chunk (into 16s).
The per-pair part grows as C S K, the across part as C^2 K / S: 8 balances them when C = 64."""


def l2_normalize(x: jax.Array) -> jax.Array:
    """x [..., K] -> x / sqrt(sum(x^2) + 1e-6), in full precision (FLA `l2norm`)."""
    x = upcast(x)
    return x * lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + L2_NORM_EPS)


def kda_gate(raw: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """Log-space decay g = -exp(A_log[h]) * softplus(raw + dt_bias) (FLA `naive_kda_gate`).

    raw [B, T, H, K]; a_log [H]; dt_bias [H * K]. Returns g [B, T, H, K] <= 0, full precision.
    """
    H, K = raw.shape[-2:]
    x = upcast(raw) + upcast(dt_bias).reshape(H, K)
    return -jnp.exp(upcast(a_log))[:, None] * jax.nn.softplus(x)


def kda_beta(logits: jax.Array, *, allow_neg_eigval: bool) -> jax.Array:
    """beta = sigmoid(logits), doubled when eigenvalues of (I - beta k k^T) may be negative."""
    beta = jax.nn.sigmoid(upcast(logits))
    return 2.0 * beta if allow_neg_eigval else beta


# --- the inverse of the chunk system ---------------------------------------------------------


def _substitute_rows(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower a [..., n, n], row by row: X_i = e_i - sum_{j<i} a_ij X_j.

    A loop, not unrolled (one row's ops to compile). Row i sums over every j: the rows j >= i of X
    are still e_j, and a_ij = 0 there, so those terms add exact zeros."""
    n = a.shape[-1]
    eye = jnp.eye(n, dtype=a.dtype)

    def substitute(i, x):
        a_i = lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)  # [..., n]
        row = eye[i] - jnp.einsum("...j,...jc->...c", a_i, x)
        return lax.dynamic_update_index_in_dim(x, row, i, axis=-2)

    # eye "like" a: inside `shard_map` the carry varies over the same axes as a does
    return lax.fori_loop(1, n, substitute, jnp.zeros_like(a) + eye)


@jax.custom_vjp
def kda_chunk_inverse(a: jax.Array) -> jax.Array:
    """X = (I + a)^-1 for strictly lower a [..., C, C], by forward substitution (`_substitute_rows`;
    FLA's `solve_tril` in one block). Its gradient is the inverse's, dA = -X^T dX X^T on the
    strictly lower entries: three matmuls, no loop to differentiate or save."""
    return _substitute_rows(a)


def _inverse_forward(a):
    x = _substitute_rows(a)
    return x, x


def _inverse_backward(x, dx):
    C = x.shape[-1]
    x_t = jnp.swapaxes(x, -1, -2)
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), -(x_t @ dx @ x_t), 0.0),)


kda_chunk_inverse.defvjp(_inverse_forward, _inverse_backward)


def _newton_schulz(a: jax.Array) -> jax.Array:
    """X <- X (2I - (I + a) X) from X = I; exact after ceil(log2 C) steps for nilpotent a, but its
    iterates hold (-a)^(2^k), which grow past float32 precision when keys are correlated (errors
    of 1e10 to 1e21 measured on weak-gate correlated keys)."""
    C = a.shape[-1]
    eye = jnp.eye(C, dtype=a.dtype)
    m, x = eye + a, jnp.broadcast_to(eye, a.shape)
    for _ in range(max(1, (C - 1).bit_length())):
        x = x @ (2 * eye - m @ x)
    return x


def _power_series(a: jax.Array) -> jax.Array:
    """sum_{n < C} (-a)^n as the product prod_k (I + (-a)^(2^k)); the same powers blow up."""
    C = a.shape[-1]
    eye = jnp.eye(C, dtype=a.dtype)
    power, x = -a, eye + -a
    for _ in range(max(1, (C - 1).bit_length()) - 1):
        power = power @ power
        x = x @ (eye + power)
    return x


@jax.named_scope("kda_inverse")
def invert_unit_lower(a: jax.Array, method: str = "forward_substitution") -> jax.Array:
    """(I + a)^-1 for strictly lower a [..., C, C]; `method` in KDA_INVERSES (Flags.kda_inverse)."""
    if method == "forward_substitution":
        return kda_chunk_inverse(a)
    if method == "newton_schulz":
        return _newton_schulz(a)
    if method == "power_series":
        return _power_series(a)
    raise NotImplementedError(method)


# --- recurrent reference ---------------------------------------------------------------------


def _prepare(q, k, v, g, beta, scale, initial_state, segment_ids):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = full_precision(jnp.result_type(q, k, v, g, beta))
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    # zeros "like" the inputs: inside `shard_map` the state varies over the same axes as they do
    state = jnp.zeros_like(k, shape=(B, H, K, V)) if initial_state is None else initial_state
    segment_ids = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    return q * scale, k, v, g, beta, state.astype(dtype), segment_ids


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Token-by-token KDA, the spec of `chunk_kda` (FLA `naive_recurrent_kda`).

    q, k [B, T, H, K] (already L2-normed); v [B, T, H, V]; g [B, T, H, K] log decay (<= 0);
    beta [B, T, H]; scale default K**-0.5; initial_state [B, H, K, V]; segment_ids [B, T] restart
    the state where they change. Returns (o [B, T, H, V], final_state [B, H, K, V]) in full
    precision.
    """
    q, k, v, g, beta, state, seg = _prepare(q, k, v, g, beta, scale, initial_state, segment_ids)
    restart = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)

    def step(S, x):
        q_t, k_t, v_t, g_t, b_t, r_t = x  # [B, H, K], [B, H, K], [B, H, V], [B, H, K], [B, H], [B]
        S = jnp.where(r_t[:, None, None, None], 0.0, S) * jnp.exp(g_t)[..., None]
        delta = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, delta)
        return S, jnp.einsum("bhk,bhkv->bhv", q_t, S)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, restart)]
    state, o = lax.scan(step, state, time_major)
    return jnp.moveaxis(o, 0, 1), state


# --- chunked form ----------------------------------------------------------------------------


def _prefix_sums(g: jax.Array) -> jax.Array:
    """sum_{t <= i} g_t [..., S, K] for g [..., S, K]: a cumsum, as the sums below a matmul with a
    triangle of ones (XLA's CPU runs a cumsum as a reduce-window, several times slower)."""
    S = g.shape[-2]
    return jnp.einsum("it,...tk->...ik", jnp.tril(jnp.ones((S, S), g.dtype)), g)


def _span_sums(g: jax.Array) -> jax.Array:
    """sum_{j < t <= i} g_t [..., S, S, K] for g [..., S, K]: each pair's exponent summed over the
    pair's own tokens (0 where i <= j). As a difference of cumulative sums, G_i - G_j, a near
    pair late in a fast-decaying chunk (G ~ -300) would carry the rounding of those large sums
    (~300 ulp), which float32 gate gradients inherit."""
    t = jnp.arange(g.shape[-2])
    inside = (t[None, :, None] < t) & (t <= t[:, None, None])  # [i, j, t]: j < t <= i
    return jnp.einsum("ijt,...tk->...ijk", inside.astype(g.dtype), g)


def _suffix_sums(g: jax.Array) -> jax.Array:
    """sum_{j < t} g_t [..., S, K] over the rest of the block, for g [..., S, K]."""
    S = g.shape[-2]
    return jnp.einsum("jt,...tk->...jk", jnp.triu(jnp.ones((S, S), g.dtype), 1), g)


def intra_chunk_scores(x: jax.Array, k: jax.Array, g: jax.Array) -> jax.Array:
    """sum_c x_ic k_jc exp(sum_{j < t <= i} g_tc) [..., C, C] for i >= j, 0 above the diagonal;
    x, k, g [..., C, K].

    Every exponent is a sum of the pair's own gates (never exp of a positive number). Within a
    SUB_CHUNK diagonal block, per pair (`_span_sums`, [C, SUB_CHUNK, K]). Across blocks a > b the
    span splits at the start of block a into two factors <= 1, so the scores are matmuls:
        exp(sum_{start_a <= t <= i} g_t) x_i  .  exp(sum_{j < t < start_a} g_t) k_j
    where the second exponent is j's rest of block b plus the whole blocks between b and a."""
    *lead, C, K = g.shape
    S = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n = C // S
    # one leading axis: XLA's CPU library fusions (jaxlib 0.10.2) crash on the backward of these
    # einsums when several leading axes include one of size 1
    xs, ks, gs = (a.reshape(-1, n, S, K) for a in (x, k, g))  # [M, n, S, K]
    decay = jnp.exp(_span_sums(gs))  # [..., n, S, S, K], 1 above the diagonal (masked below)
    inside = jnp.einsum("...ijk,...ik,...jk->...ij", decay, xs, ks)  # [..., n, S, S]
    inside = jnp.where(jnp.tril(jnp.ones((S, S), bool)), inside, 0.0)
    head = _prefix_sums(gs)  # block a's start to i
    # the whole blocks strictly between b and a, [..., n(a), n(b), K]: span sums of the block
    # totals, moved down one block
    between = _span_sums(head[..., -1, :])
    between = jnp.concatenate([jnp.zeros_like(between[..., :1, :, :]), between[..., :-1, :, :]], -3)
    before = jnp.tril(jnp.ones((n, n), bool), -1)[:, :, None, None]  # b < a
    far = _suffix_sums(gs)[..., None, :, :, :] + between[..., :, :, None, :]  # [..., n, n, S, K]
    k_far = jnp.where(before, ks[..., None, :, :, :] * jnp.exp(jnp.where(before, far, 0.0)), 0.0)
    across = jnp.einsum("...aik,...abjk->...aibj", xs * jnp.exp(head), k_far)  # [M, n, S, n, S]
    scores = across + inside[..., :, :, None, :] * jnp.eye(n, dtype=inside.dtype)[:, None, :, None]
    return scores.reshape(*lead, C, C)


def _chunked(x: jax.Array, C: int) -> jax.Array:
    """[B, T, H, ...] -> [B, H, N, C, ...], T a multiple of C."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // C, C, H, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def intra_chunk_score_pair(q, k, g) -> tuple[jax.Array, jax.Array]:
    """(`intra_chunk_scores(q, k, g)`, `intra_chunk_scores(k, k, g)`): what `chunk_kda` needs of a
    chunk; `model.kda_pallas.pallas_intra_chunk_scores` computes the same in one kernel."""
    return intra_chunk_scores(q, k, g), intra_chunk_scores(k, k, g)


def _system(s_kk: jax.Array, beta: jax.Array, same: jax.Array | None) -> jax.Array:
    C = s_kk.shape[-1]
    keep = jnp.tril(jnp.ones((C, C), bool), -1)
    if same is not None:
        keep = keep & same
    return beta[..., None] * jnp.where(keep, s_kk, 0.0)


def chunk_system(k, g, beta, same=None) -> jax.Array:
    """A_ij = beta_i sum_c k_ic k_jc exp(sum_{j < t <= i} g_tc) for i > j in one segment, else 0.

    k, g [..., C, K] (one chunk); beta [..., C]; same [..., C, C] (None: one segment).
    """
    return _system(intra_chunk_scores(k, k, g), beta, same)


def kda_chunk_system(k, g, beta, *, chunk_size: int = 64) -> jax.Array:
    """The chunk systems A [B, H, N, C, C] of k [B, T, H, K], g [B, T, H, K], beta [B, T, H]
    (T a multiple of chunk_size), laid out as in FLA's `naive_chunk_kda`."""
    k, g, beta = (_chunked(upcast(x), chunk_size) for x in (k, g, beta))
    return chunk_system(k, g, beta)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    inverse: str = "forward_substitution",
    scores=intra_chunk_score_pair,
):
    """Chunked KDA (FLA `naive_chunk_kda`), same arguments and result as `recurrent_kda`.
    `scores(q, k, g)` gives a chunk's two intra-chunk score matrices (`intra_chunk_score_pair`).

    T need not be a multiple of chunk_size: the tail is padded with tokens that change nothing
    (k = v = q = 0, g = 0, beta = 0, the last segment id).
    """
    q, k, v, g, beta, state, seg = _prepare(q, k, v, g, beta, scale, initial_state, segment_ids)
    B, T, H, _ = q.shape
    C = chunk_size
    pad = -T % C
    if pad:
        q, k, v, g, beta = (
            jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)
        )
        seg = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
    q, k, v, g, beta = (_chunked(x, C) for x in (q, k, v, g, beta))  # [B, H, N, C, ...]
    seg = _chunked(jnp.broadcast_to(seg[:, :, None], (B, T + pad, H)), C)  # [B, H, N, C]
    # The segment of the token before each chunk, whose state S_0 the chunk starts from.
    seg_prev = jnp.concatenate([seg[:, :, :1, 0], seg[:, :, :-1, -1]], axis=2)  # [B, H, N]

    with jax.named_scope("kda_intra_chunk"):
        G = _prefix_sums(g)  # decay since the chunk start
        same = seg[..., :, None] == seg[..., None, :]  # [B, H, N, C, C]
        carry = seg == seg_prev[..., None]  # [B, H, N, C]: the token continues S_0's segment
        s_qk, s_kk = scores(q, k, g)
        A = _system(s_kk, beta, same)
        T_beta = invert_unit_lower(A, inverse) * beta[..., None, :]  # (I + A)^-1 diag(beta)
        gamma = jnp.where(
            carry[..., None], jnp.exp(G), 0.0
        )  # decay since the chunk start, 0 if restarted
        w = T_beta @ (gamma * k)  # [B, H, N, C, K]
        u = T_beta @ v  # [B, H, N, C, V]
        A_qk = jnp.where(jnp.tril(same), s_qk, 0.0)
        # Decay from token j to the chunk end, for the tokens of the chunk's last segment.
        in_last = seg == seg[..., -1:]  # [B, H, N, C]
        k_tail = jnp.where(in_last[..., None], jnp.exp(_suffix_sums(g)) * k, 0.0)
        gamma_end = jnp.where(carry[..., -1:], jnp.exp(G[..., -1, :]), 0.0)  # [B, H, N, K]

    def step(S, x):  # S [B, H, K, V], the state the chunk starts from; one chunk of each input
        w_n, u_n, k_tail_n, gamma_end_n = x
        v_new = u_n - w_n @ S  # [B, H, C, V]
        return gamma_end_n[..., None] * S + jnp.swapaxes(k_tail_n, -1, -2) @ v_new, (S, v_new)

    with jax.named_scope("kda_inter_chunk"):
        # only the state runs chunk by chunk; each chunk's output, from the state it started
        # from, is one batched matmul over all chunks after the scan
        per_chunk = [jnp.moveaxis(x, 2, 0) for x in (w, u, k_tail, gamma_end)]
        state, (starts, v_new) = lax.scan(step, state, per_chunk)  # [N, B, H, K | C, V]
        starts, v_new = (jnp.moveaxis(x, 0, 2) for x in (starts, v_new))  # [B, H, N, ...]
        o = (q * gamma) @ starts + A_qk @ v_new  # [B, H, N, C, V]
    o = jnp.moveaxis(o.reshape(B, H, -1, o.shape[-1]), 1, 2)  # shape: -> [B, N*C, H, V]
    return o[:, :T], state
