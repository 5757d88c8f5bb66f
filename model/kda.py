"""The Kimi Delta Attention layer, as OLMo-core's `KimiDeltaAttention`
(olmo_core/nn/attention/kda.py, 3.0.0); the math is in `model.kda_chunk`.

    q, k, v = SiLU(causal depthwise conv(W x))   (conv width 4, no bias)
    g = -exp(A_log) * softplus(f_proj_2(f_proj_1(x)) + dt_bias);  beta = (2) sigmoid(w_b(x))
    o = chunk_kda(l2norm(q), l2norm(k), v, g, beta)
    y = w_out(RMSNorm(o) * o_norm.weight * sigmoid(g_proj_2(g_proj_1(x))))

The intra-chunk scores come from XLA's ops or, on a TPU, a Pallas kernel (`ScaleConfig.kda_kernel`,
`intra_chunk_scores_for`).

Parameter names are OLMo-core's; linear kernels are [in, out] (OLMo-core's weight transposed) and
conv weights [C, W] (OLMo-core's [C, 1, W] squeezed). Segment ids restart the state and the
convolution at document starts unless `ignore_segment_ids` (OLMo-core: the whole instance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import KDAConfig
from model.init import linear, log_uniform, trunc_normal
from model.kda_chunk import chunk_kda, intra_chunk_score_pair, kda_beta, kda_gate, l2_normalize
from model.kda_pallas import pallas_fits, pallas_intra_chunk_scores
from model.layout import Layout
from model.norms import rms_norm
from model.precision import full_precision


def causal_conv1d(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Depthwise causal convolution then SiLU. x [B, T, C]; weight [C, W], weight[:, W-1] meets
    the current token; segment_ids [B, T] keep taps inside the current segment. Computed and
    returned in full precision."""
    W = weight.shape[-1]
    y = jnp.zeros(x.shape, full_precision(x.dtype))
    for s in range(W):  # tap s reads x_{t-s}
        shifted = jnp.pad(x, [(0, 0), (s, 0), (0, 0)])[:, : x.shape[1]]
        if segment_ids is not None:
            seg = jnp.pad(segment_ids, [(0, 0), (s, 0)], constant_values=-1)[:, : x.shape[1]]
            shifted = jnp.where((seg == segment_ids)[..., None], shifted, 0.0)
        y = y + shifted * weight[:, W - 1 - s]
    return jax.nn.silu(y)


def intra_chunk_kernel(kernel: str, config: KDAConfig, platform: str) -> str:
    """What computes the intra-chunk scores for `ScaleConfig.kda_kernel` `kernel` on `platform`:
    "pallas" on a TPU where a chunk fits the kernel, else "xla"."""
    fits = pallas_fits(config.chunk_size, config.head_dim)
    return "pallas" if kernel == "pallas" and platform == "tpu" and fits else "xla"


def intra_chunk_scores_for(kernel: str, config: KDAConfig, layout: Layout | None):
    """`chunk_kda`'s `scores` for `ScaleConfig.kda_kernel` `kernel` where the model compiles (the
    layout's platform, else JAX's default backend), as `intra_chunk_kernel` says: the Pallas
    kernel inside `shard_map` over the batch on a mesh of several devices (Mosaic kernels are not
    partitioned by XLA)."""
    platform = jax.default_backend() if layout is None else layout.platform
    if intra_chunk_kernel(kernel, config, platform) == "xla":
        return intra_chunk_score_pair
    if layout is None or layout.mesh.size == 1:
        return pallas_intra_chunk_scores
    return lambda q, k, g: layout.per_rows(pallas_intra_chunk_scores, q, k, g)


class CausalConv1d(nnx.Module):
    def __init__(self, channels: int, width: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs):
        shape = (channels, width)
        self.weight = nnx.Param(
            trunc_normal(std)(rngs.params(), shape, full_precision(dtype)),
            logical_axes=("heads", None),
        )

    def __call__(self, x, segment_ids=None):
        return causal_conv1d(x, self.weight[...], segment_ids)


class KimiDeltaAttention(nnx.Module):
    """x [B, T, d_model] -> [B, T, d_model]. `inverse` is `Flags.kda_inverse`;
    `ignore_segment_ids` is `Flags.olmoe3_mixers_ignore_segment_ids`. Linear weights drawn
    `trunc_normal(std)` (OLMo-core's "normal" init). `dtype`: the compute dtype
    (`model.precision`)."""

    def __init__(
        self,
        config: KDAConfig,
        d_model: int,
        *,
        inverse: str,
        ignore_segment_ids: bool,
        std: float,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config, self.inverse, self.ignore_segment_ids = config, inverse, ignore_segment_ids
        H, dk, dv = config.n_heads, config.head_dim, config.head_v_dim
        p_dtype = full_precision(dtype)
        self.w_q = linear(d_model, H * dk, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_k = linear(d_model, H * dk, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.w_v = linear(d_model, H * dv, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.q_conv1d = CausalConv1d(H * dk, config.conv_size, std=std, dtype=dtype, rngs=rngs)
        self.k_conv1d = CausalConv1d(H * dk, config.conv_size, std=std, dtype=dtype, rngs=rngs)
        self.v_conv1d = CausalConv1d(H * dv, config.conv_size, std=std, dtype=dtype, rngs=rngs)
        self.f_proj_1 = linear(d_model, dv, std, rngs, axes=("embed", "kv"), dtype=dtype)
        self.f_proj_2 = linear(dv, H * dk, std, rngs, axes=("kv", "heads"), dtype=dtype)
        self.w_b = linear(d_model, H, std, rngs, axes=("embed", "heads"), dtype=dtype)
        self.A_log = nnx.Param(
            log_uniform(1.0, 16.0)(rngs.params(), (H,), p_dtype), logical_axes=("heads",)
        )
        self.dt_bias = nnx.Param(jnp.zeros((H * dk,), p_dtype), logical_axes=("heads",))
        self.g_proj_1 = linear(d_model, dv, std, rngs, axes=("embed", "kv"), dtype=dtype)
        self.g_proj_2 = linear(dv, H * dv, std, rngs, axes=("kv", "heads"), bias=True, dtype=dtype)
        self.o_norm = nnx.Param(jnp.ones((dv,), p_dtype), logical_axes=("kv",))
        self.w_out = linear(H * dv, d_model, std, rngs, axes=("heads", "embed"), dtype=dtype)

    @jax.named_scope("kda")
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        kernel: str = "pallas",
        layout: Layout | None = None,
    ) -> jax.Array:
        """`kernel`: `ScaleConfig.kda_kernel`; `layout`: the mesh the model runs on (None: one
        device)."""
        c = self.config
        B, T, _ = x.shape
        H, dk, dv = c.n_heads, c.head_dim, c.head_v_dim
        seg = None if self.ignore_segment_ids else segment_ids
        q = self.q_conv1d(self.w_q(x), seg).reshape(B, T, H, dk)
        k = self.k_conv1d(self.w_k(x), seg).reshape(B, T, H, dk)
        v = self.v_conv1d(self.w_v(x), seg).reshape(B, T, H, dv)
        raw_decay = self.f_proj_2(self.f_proj_1(x)).reshape(B, T, H, dk)
        g = kda_gate(raw_decay, self.A_log[...], self.dt_bias[...])
        beta = kda_beta(self.w_b(x), allow_neg_eigval=c.allow_neg_eigval)
        o, _ = chunk_kda(
            l2_normalize(q),
            l2_normalize(k),
            v,
            g,
            beta,
            segment_ids=seg,
            chunk_size=c.chunk_size,
            inverse=self.inverse,
            scores=intra_chunk_scores_for(kernel, c, layout),
        )
        gate = self.g_proj_2(self.g_proj_1(x)).reshape(B, T, H, dv)
        y = rms_norm(o, self.o_norm[...], eps=c.norm_eps) * jax.nn.sigmoid(gate)
        return self.w_out(y.reshape(B, T, H * dv))
