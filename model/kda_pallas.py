"""Chunk KDA's intra-chunk scores as a Pallas TPU kernel, forward and backward (custom VJP):
`intra_chunk_scores(q, k, g)` and `intra_chunk_scores(k, k, g)` of `model.kda_chunk` in one pass
over each chunk, without the [.., n, n, S, K] decay tensors XLA keeps in memory between ops.

The maths is `intra_chunk_scores`': every exponent a sum of the pair's own gates, never exp of a
positive number. Per chunk (C tokens, K channels, blocks of S = SUB_CHUNK tokens):
    head_i = sum_{start(i) <= t <= i} g_t       rest_j = sum_{j < t < end(j)} g_t
    across blocks b < a:   exp(head_i) x_i . exp(rest_j + totals of the blocks between) k_j
    inside a block, per offset o of j in it:   x_i . k_j exp(sum_{j < t <= i} g_t)
Prefix, span and total sums are matmuls with 0/1 masks (at the trace's matmul precision, as XLA's
einsums are); picking and scattering rows of k are matmuls with one-hot masks at "highest" (exact).

One chunk per grid step, every array [C, K] or [C, C]: K in whole `TPU_LANES` for Mosaic;
`interpret` runs Pallas's interpreter on any backend (the CPU tests). OLMo-core's counterpart is
FLA's GPU Triton `chunk_kda`, which splits a chunk into 16s the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from model.kda_chunk import SUB_CHUNK
from model.precision import TPU_LANES, kernel_precision


def pallas_fits(C: int, K: int) -> bool:
    """Whether a chunk of C tokens and K channels suits the kernel on a TPU."""
    return C % SUB_CHUNK == 0 and K % TPU_LANES == 0


class _Chunk:
    """Index masks and sums of one chunk: rows i (or t), columns j (or t), blocks of SUB_CHUNK."""

    def __init__(self, g: jax.Array, precision):
        C = g.shape[0]
        self.token = lax.broadcasted_iota(jnp.int32, g.shape, 0)  # the row of a [C, K] array
        self.row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
        self.col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
        self.row_block, self.col_block = (
            lax.div(i, jnp.int32(SUB_CHUNK)) for i in (self.row, self.col)
        )
        self.same = self.row_block == self.col_block
        self.g, self.precision = g, precision
        self.head = self.sum_of(self.same & (self.col <= self.row))
        self.rest = self.sum_of(self.same & (self.col > self.row))

    def dot(self, mask: jax.Array, x: jax.Array, precision=None) -> jax.Array:
        """0/1 `mask` [C, C] times x [C, K]."""
        ones = jnp.where(mask, 1.0, 0.0)
        return _dot(ones, x, self.precision if precision is None else precision)

    def sum_of(self, mask: jax.Array) -> jax.Array:
        """sum_t mask[i, t] g_t [C, K]."""
        return self.dot(mask, self.g)

    def far_exponents(self):
        """For each block a >= 1: (a, exponent [C, K] of key row j < start(a): rest_j plus the
        totals of the blocks strictly between j's and a)."""
        C = self.g.shape[0]
        exponent = self.rest
        for a in range(1, C // SUB_CHUNK):
            if a > 1:
                previous = self.sum_of(self.col_block == a - 1)  # block a-1's total, every row
                earlier = self.token < (a - 1) * SUB_CHUNK
                exponent = jnp.where(earlier, exponent + previous, self.rest)
            yield a, exponent

    def offsets(self):
        """For each offset o in a block: (pick [C, C], the one-hot of j = start(i) + o per row i;
        exp of the spans sum_{j < t <= i} g_t [C, K], 1 where i <= j)."""
        start = self.row_block * SUB_CHUNK
        for o in range(SUB_CHUNK):
            pick = self.col == start + o
            span = self.sum_of(self.same & (self.col > start + o) & (self.col <= self.row))
            yield o, pick, jnp.exp(span)


def _dot(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [C, C] times b [C, K]: [C, K]."""
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _dot_t(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [C, K] times b [C, K] transposed: [C, C]."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _t_dot(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [C, C] transposed times b [C, K]: [C, K]."""
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _forward_kernel(q_ref, k_ref, g_ref, s_qk_ref, s_kk_ref, precision):
    q, k = q_ref[...], k_ref[...]
    c = _Chunk(g_ref[...], precision)
    decay_in = jnp.exp(c.head)
    xq, xk = q * decay_in, k * decay_in
    s_qk = s_kk = jnp.zeros(c.row.shape, jnp.float32)
    for a, exponent in c.far_exponents():
        k_far = jnp.where(c.token < a * SUB_CHUNK, k * jnp.exp(exponent), 0.0)
        rows = c.row_block == a
        s_qk += jnp.where(rows, _dot_t(xq, k_far, precision), 0.0)
        s_kk += jnp.where(rows, _dot_t(xk, k_far, precision), 0.0)
    for _, pick, decay in c.offsets():
        k_j = c.dot(pick, k, lax.Precision.HIGHEST)
        on = pick & (c.col <= c.row)
        s_qk += jnp.where(on, jnp.sum(q * k_j * decay, axis=-1, keepdims=True), 0.0)
        s_kk += jnp.where(on, jnp.sum(k * k_j * decay, axis=-1, keepdims=True), 0.0)
    s_qk_ref[...], s_kk_ref[...] = s_qk, s_kk


def _backward_kernel(q_ref, k_ref, g_ref, ds_qk_ref, ds_kk_ref, dq_ref, dk_ref, dg_ref, precision):
    q, k = q_ref[...], k_ref[...]
    c = _Chunk(g_ref[...], precision)
    decay_in = jnp.exp(c.head)
    xq, xk = q * decay_in, k * decay_in
    ds_qk, ds_kk = ds_qk_ref[...], ds_kk_ref[...]
    below = c.col_block < c.row_block
    dq = dk = d_head = d_rest = dg = jnp.zeros(q.shape, jnp.float32)
    for a, exponent in c.far_exponents():
        decay_far = jnp.where(c.token < a * SUB_CHUNK, jnp.exp(exponent), 0.0)
        k_far = k * decay_far
        rows = below & (c.row_block == a)
        dsq, dsk = jnp.where(rows, ds_qk, 0.0), jnp.where(rows, ds_kk, 0.0)
        dxq, dxk = (_dot(ds, k_far, precision) for ds in (dsq, dsk))
        dq += dxq * decay_in
        dk += dxk * decay_in
        d_head += dxq * xq + dxk * xk
        d_k_far = _t_dot(dsq, xq, precision) + _t_dot(dsk, xk, precision)
        dk += d_k_far * decay_far
        d_exponent = d_k_far * k_far
        d_rest += d_exponent
        # the totals of blocks m, start(j) < m < a, in row j's exponent: back to each t of block m
        dg += c.dot((c.col_block < c.row_block) & (c.row_block < a), d_exponent)
    dg += c.dot(c.same & (c.row <= c.col), d_head) + c.dot(c.same & (c.row > c.col), d_rest)
    for o, pick, decay in c.offsets():
        k_j = c.dot(pick, k, lax.Precision.HIGHEST)
        on = pick & (c.col <= c.row)
        dvq = jnp.sum(jnp.where(on, ds_qk, 0.0), axis=-1, keepdims=True)
        dvk = jnp.sum(jnp.where(on, ds_kk, 0.0), axis=-1, keepdims=True)
        dq += dvq * k_j * decay
        dk += dvk * k_j * decay
        d_k_j = (dvq * q + dvk * k) * decay
        start = c.col_block * SUB_CHUNK  # pick transposed: row t is key j = start(i) + o of i
        dk += c.dot(c.row == start + o, d_k_j, lax.Precision.HIGHEST)
        dg += c.dot(c.same & (c.row > start + o) & (c.row <= c.col), d_k_j * k_j)
    dq_ref[...], dk_ref[...], dg_ref[...] = dq, dk, dg


def _per_chunk(kernel, inputs, outputs, interpret):
    """`kernel` over the chunks of inputs [M, C, *] into outputs [M, C, *] (shape, dtype)."""
    M = inputs[0].shape[0]

    def spec(shape):
        return pl.BlockSpec((None, *shape[1:]), lambda m: (m, 0, 0))

    return pl.pallas_call(
        kernel,
        grid=(M,),
        in_specs=[spec(x.shape) for x in inputs],
        out_specs=[spec(s) for s in outputs],
        out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in outputs],
        interpret=interpret,
    )(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _scores(q, k, g, interpret, precision):
    return _scores_forward(q, k, g, interpret, precision)[0]


def _scores_forward(q, k, g, interpret, precision):
    M, C, _ = q.shape
    kernel = functools.partial(_forward_kernel, precision=precision)
    s_qk, s_kk = _per_chunk(kernel, (q, k, g), [(M, C, C)] * 2, interpret)
    return (s_qk, s_kk), (q, k, g)


def _scores_backward(interpret, precision, residuals, d_scores):
    kernel = functools.partial(_backward_kernel, precision=precision)
    shape = residuals[0].shape
    return tuple(_per_chunk(kernel, (*residuals, *d_scores), [shape] * 3, interpret))


_scores.defvjp(_scores_forward, _scores_backward)


def pallas_intra_chunk_scores(q, k, g, *, interpret: bool = False):
    """(`intra_chunk_scores(q, k, g)`, `intra_chunk_scores(k, k, g)`), each [..., C, C], for
    float32 q, k, g [..., C, K], by the kernel; `interpret`: Pallas's interpreter."""
    *lead, C, K = q.shape
    flat = [x.reshape(-1, C, K) for x in (q, k, g)]
    s_qk, s_kk = _scores(*flat, interpret, kernel_precision(jnp.float32))
    return s_qk.reshape(*lead, C, C), s_kk.reshape(*lead, C, C)
