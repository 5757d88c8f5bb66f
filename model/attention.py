"""Gated NoPE full attention, as OLMo-core's `Attention` (olmo_core/nn/attention/__init__.py, 3.0.0)
built for the hero: grouped-query heads, no positional encoding, per-head QK RMSNorm with a gain per
head, scalable softmax with a learned scale per query head, elementwise sigmoid output gate.

    q, k, v = w_q x, w_k x, w_v x                      (per head, head dim D)
    q, k = RMSNorm_head(q) * q_norm[h], RMSNorm_head(k) * k_norm[h]
    q = q * log(n) * ssmax_scale[h]                    (n: keys the query sees, itself included)
    o = softmax(q k^T / sqrt(D), causal) v             (full precision; head h reads KV head h // G)
    y = w_out(o * sigmoid(w_g x))

Parameter names are OLMo-core's; linear kernels are [in, out]. Differences: with segment ids and
`ignore_segment_ids` off (MaxText's segment masking) a query sees only earlier keys of its own
segment and its scalable-softmax n counts from the segment start, which is what OLMo-core does
with `cu_doc_lens` on its GPU backends (its torch backend on CPU has no document masking).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention_pallas import flash_fits, pallas_causal_attention
from model.config import AttentionConfig
from model.init import linear
from model.layout import Layout
from model.norms import RMSNorm
from model.precision import full_precision, upcast


def visible_lengths(segment_ids: jax.Array | None, T: int) -> jax.Array:
    """Keys each query sees under causal (and segment) masking, itself included: [B, T] int32, or
    [1, T] without segment ids. A segment starts where the id changes."""
    t = jnp.arange(T, dtype=jnp.int32)[None]  # shape: [1, T]
    if segment_ids is None:
        return t + 1
    starts_here = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    start = jax.lax.cummax(jnp.where(starts_here, t, 0), axis=1)  # shape: [B, T]
    return t - start + 1


def scalable_softmax(q: jax.Array, scale: jax.Array, lengths: jax.Array) -> jax.Array:
    """q [B, T, H, D] times log(lengths) [B, T] times scale [H] (OLMo-core applies it to q)."""
    factor = jnp.log(lengths.astype(full_precision(q.dtype)))[..., None] * scale  # shape: [B, T, H]
    return q * factor[..., None].astype(q.dtype)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Causal softmax attention in full precision (float32; float64 for float64) with grouped KV
    heads.

    q: [B, T, H, D]; k, v: [B, T, Hkv, D], Hkv divides H, query head h reads KV head h // (H/Hkv)
    (OLMo-core's repeat_kv); segment_ids: [B, T] or None (no document masking). Scale 1/sqrt(D).
    Returns [B, T, H, D] in q's dtype.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    qg = upcast(q).reshape(B, T, Hkv, G, D)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, upcast(k)) / math.sqrt(D)
    mask = jnp.tril(jnp.ones((T, T), bool))[None]  # shape: [1, Tq, Tk]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # shape: [B, Tq, Tk]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)  # shape: [B, Hkv, G, Tq, Tk]
    o = jnp.einsum("bkgqs,bskd->bqkgd", probs, upcast(v))
    return o.reshape(B, T, H, D).astype(q.dtype)


def attention_kernel(kernel: str, config: AttentionConfig, seq_len: int, platform: str) -> str:
    """What computes `causal_attention` for `ScaleConfig.attention_kernel` `kernel` on
    `platform`: "pallas" (`model.attention_pallas`) on a TPU where the sequence and heads fit
    the kernel, else "xla"."""
    fits = flash_fits(seq_len, config.head_dim)
    return "pallas" if kernel == "pallas" and platform == "tpu" and fits else "xla"


def causal_attention_for(kernel: str, config: AttentionConfig, seq_len: int, layout: Layout | None):
    """`causal_attention`, or the Pallas kernel where `attention_kernel` says so for the platform
    the model compiles for (the layout's, else JAX's default backend); on a mesh of several
    devices the kernel runs on each device's rows (`Layout.per_rows`)."""
    platform = jax.default_backend() if layout is None else layout.platform
    if attention_kernel(kernel, config, seq_len, platform) == "xla":
        return causal_attention
    if layout is None or layout.mesh.size == 1:
        return pallas_causal_attention

    def per_rows(q, k, v, *, segment_ids=None):
        if segment_ids is None:
            return layout.per_rows(pallas_causal_attention, q, k, v)
        attend = lambda q, k, v, s: pallas_causal_attention(q, k, v, segment_ids=s)  # noqa: E731
        return layout.per_rows(attend, q, k, v, segment_ids)

    return per_rows


class Attention(nnx.Module):
    """x [B, T, d_model] -> [B, T, d_model]. `ignore_segment_ids` is
    `Flags.olmoe3_mixers_ignore_segment_ids`. Linear weights drawn `trunc_normal(std)` (OLMo-core's
    "normal" init). QK-norm gains and scalable-softmax scales start at 1.
    `dtype`: the compute dtype (`model.precision`)."""

    def __init__(
        self,
        config: AttentionConfig,
        d_model: int,
        *,
        ignore_segment_ids: bool,
        std: float,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config, self.ignore_segment_ids = config, ignore_segment_ids
        H, Hkv, D = config.n_heads, config.n_kv_heads, config.head_dim
        self.w_q = linear(d_model, H * D, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_k = linear(d_model, Hkv * D, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_v = linear(d_model, Hkv * D, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_g = linear(d_model, H * D, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_out = linear(H * D, d_model, std, rngs, axes=("heads", "embed"), dtype=dtype)
        self.q_norm = RMSNorm(
            D, eps=config.qk_norm_eps, weight_shape=(H, D), axes=("heads", "kv"), dtype=dtype
        )
        self.k_norm = RMSNorm(
            D, eps=config.qk_norm_eps, weight_shape=(Hkv, D), axes=("heads", "kv"), dtype=dtype
        )
        self.ssmax_scale = nnx.Param(jnp.ones((H,), full_precision(dtype)), logical_axes=("heads",))

    def qkv(
        self, x: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, D] (normed, scalable softmax applied), k [B, T, Hkv, D] (normed), v."""
        B, T, _ = x.shape
        D = self.config.head_dim
        q = self.q_norm(self.w_q(x).reshape(B, T, -1, D))
        k = self.k_norm(self.w_k(x).reshape(B, T, -1, D))
        v = self.w_v(x).reshape(B, T, -1, D)
        seg = None if self.ignore_segment_ids else segment_ids
        return scalable_softmax(q, self.ssmax_scale[...], visible_lengths(seg, T)), k, v

    @jax.named_scope("attention")
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        kernel: str = "pallas",
        layout: Layout | None = None,
    ) -> jax.Array:
        """`kernel`: `ScaleConfig.attention_kernel`; `layout`: the mesh the model runs on (None:
        one device)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, segment_ids)
        seg = None if self.ignore_segment_ids else segment_ids
        attend = causal_attention_for(kernel, self.config, T, layout)
        o = attend(q, k, v, segment_ids=seg).reshape(B, T, -1)
        gate = jax.nn.sigmoid(upcast(self.w_g(x)))
        return self.w_out((o * gate).astype(x.dtype))
