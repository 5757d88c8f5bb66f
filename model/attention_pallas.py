"""Causal grouped-query attention by JAX's Pallas TPU flash attention kernel
(`jax.experimental.pallas.ops.tpu.flash_attention`, forward and backward under its own custom
VJP): `model.attention.causal_attention`'s maths, softmax(q k^T / sqrt(D), causal and segment
masks) v in float32, with the [T, T] scores kept a block at a time in the chip's VMEM instead of
HBM. The kernel has no grouped heads: each KV head is repeated for its G query heads (OLMo-core's
repeat_kv), and autodiff sums their gradients back.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as flash

from model.precision import TPU_LANES, at_kernel_precision, kernel_precision, upcast

FLASH_BLOCK = 512
"""Largest block of queries and keys a grid step takes, forward and backward. On a TPU v5e the
slice's attention (4 rows of 4,096 tokens, 8 query and 4 KV heads of 128, float32) took 10.7 ms
forward and backward in blocks of 512, 18.2 ms in 256, 42.4 ms in the kernel's default 128, and
33.8 ms as XLA's ops, at matmul precision "default"."""


def flash_fits(seq_len: int, head_dim: int) -> bool:
    """Whether the kernel takes a sequence of `seq_len` and heads of `head_dim`: both in whole
    `TPU_LANES`, and the sequence in whole blocks."""
    block = min(FLASH_BLOCK, seq_len)
    return head_dim % TPU_LANES == 0 and seq_len % TPU_LANES == 0 and seq_len % block == 0


def pallas_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None
) -> jax.Array:
    """`causal_attention(q, k, v, segment_ids=...)` by the kernel: q [B, T, H, D], k and v
    [B, T, Hkv, D], segment_ids [B, T] or None. Returns [B, T, H, D] in q's dtype."""
    _, T, H, D = q.shape
    G, dtype = H // k.shape[2], q.dtype
    q, k, v = (jnp.swapaxes(upcast(x), 1, 2) for x in (q, jnp.repeat(k, G, 2), jnp.repeat(v, G, 2)))
    block = min(FLASH_BLOCK, T)
    sizes = flash.BlockSizes(
        **{f.name: block for f in dataclasses.fields(flash.BlockSizes)} | {"block_b": 1}
    )  # every query and key block, forward and backward; one row a grid step

    def attend(q, k, v, segments):
        ids = None if segments is None else flash.SegmentIds(segments, segments)
        scale = 1 / math.sqrt(D)
        return flash.flash_attention(
            q, k, v, segment_ids=ids, causal=True, sm_scale=scale, block_sizes=sizes
        )

    o = at_kernel_precision(attend, kernel_precision(jnp.float32), q, k, v, segment_ids)
    return jnp.swapaxes(o, 1, 2).astype(dtype)
