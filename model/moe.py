"""The latent MoE feed-forward with a shared expert, as OLMo-core's v2 MoE in an
`OLMoDDPTransformerBlock` without expert parallelism (olmo_core/nn/ddp/block.py,
nn/moe/v2/{routed_experts,shared_experts,no_ep}.py, 3.0.0):

    routing = router(m)                                    (model space, EMO pools; model.router)
    y = latent_up_proj(sum_k weight_k * SwiGLU_{e_k}(latent_down_proj(m)))  +  SwiGLU_shared(m)
    SwiGLU_e(z) = (up * silu(gate)) @ w_down[e],  [up | gate] = z @ w_up_gate[e]^T

Dropless: every token reaches all its k experts. `routed_experts` sorts the token slots by expert
and runs grouped matmuls (`jax.lax.ragged_dot`, OLMo-core's grouped GEMM); XLA's CPU runs a
`ragged_dot` as E masked dense matmuls, so on CPU `tiled_routed_experts` pads each expert's slots
to whole tiles of `TILE_ROWS` and runs one batched matmul over the tiles (`dispatch_for_backend`).
`naive_routed_experts`, every expert on every token, is the spec of both. The per-layer router
losses are returned unweighted.
Weights keep OLMo-core's layouts: routed w_up_gate [E, 2H, L], w_down [E, H, L]; shared w_up_gate
[D, 2H], w_down [1, H, D]; the latent projections are linear kernels [in, out]. The shared expert
alone is also the dense feed-forward of block 0 (OLMo-core builds it as a shared-experts block).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.aux_losses import expert_counts, load_balancing_loss, router_z_loss
from model.config import MoEConfig
from model.init import linear, trunc_normal
from model.precision import full_precision
from model.router import Router, Routing

TILE_ROWS = 64
"""Rows of a tile of `tiled_routed_experts`: one expert's token slots, zero-padded."""


def swiglu(up_gate: jax.Array) -> jax.Array:
    """[..., 2H] -> [..., H]: up * silu(gate), up the first half (OLMo-core's chunk order)."""
    up, gate = jnp.split(up_gate, 2, axis=-1)
    return up * jax.nn.silu(gate)


def naive_routed_experts(
    z: jax.Array, indices: jax.Array, weights: jax.Array, w_up_gate: jax.Array, w_down: jax.Array
) -> jax.Array:
    """The spec: every expert on every token, then each token's k results combined.

    z: [N, L]; indices, weights: [N, k]; w_up_gate: [E, 2H, L]; w_down: [E, H, L]. Returns [N, L].
    """
    h = swiglu(jnp.einsum("nl,ehl->enh", z, w_up_gate))  # shape: [E, N, H]
    out = jnp.einsum("enh,ehl->enl", h, w_down)
    chosen = out[indices, jnp.arange(z.shape[0])[:, None]]  # shape: [E, N, L] -> [N, k, L]
    return jnp.sum(weights[..., None] * chosen, axis=1)


def routed_experts(
    z: jax.Array, indices: jax.Array, weights: jax.Array, w_up_gate: jax.Array, w_down: jax.Array
) -> jax.Array:
    """Dropless grouped dispatch, same arguments and result as `naive_routed_experts`: token slots
    sorted by expert (stable), two grouped matmuls, slots put back and summed over k."""
    N, k = indices.shape
    E = w_up_gate.shape[0]
    flat = indices.reshape(-1)  # shape: [N*k], slot s = token s // k
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = z[order // k]  # shape: [N*k, L], grouped by expert
    h = swiglu(jax.lax.ragged_dot(rows, jnp.swapaxes(w_up_gate, 1, 2), group_sizes))
    out = jax.lax.ragged_dot(h, w_down, group_sizes)  # shape: [N*k, L]
    slots = out[jnp.argsort(order)].reshape(N, k, -1)
    return jnp.sum(weights[..., None] * slots, axis=1)


def expert_tiles(indices: jax.Array, num_experts: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """Each expert's token slots padded to whole tiles of `tile` rows: (row [N*k] of each slot s =
    token s // k in the padded layout, an expert's slots in token order; expert [n_tiles] of each
    tile). n_tiles = ceil(N*k / tile) + E bounds the padding; the spare tiles hold no slot."""
    flat = indices.reshape(-1)  # shape: [N*k]
    one_hot = (flat[:, None] == jnp.arange(num_experts)).astype(jnp.int32)  # shape: [N*k, E]
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), flat[:, None], axis=1)[:, 0] - 1
    padded = -(-jnp.sum(one_hot, axis=0) // tile) * tile  # shape: [E]
    ends = jnp.cumsum(padded)
    n_tiles = -(-flat.size // tile) + num_experts
    first_rows = jnp.arange(n_tiles) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(ends, first_rows, side="right"), num_experts - 1)
    return ends[flat] - padded[flat] + rank, tile_expert


def tiled_routed_experts(
    z: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w_up_gate: jax.Array,
    w_down: jax.Array,
    *,
    tile: int = TILE_ROWS,
) -> jax.Array:
    """Tiled dispatch, same arguments and result as `naive_routed_experts`: slots scattered into
    whole tiles of one expert (`expert_tiles`), a batched matmul over tiles with each tile's
    expert weights, slots gathered back and summed over k."""
    N, k = indices.shape
    rows, tile_expert = expert_tiles(indices, w_up_gate.shape[0], tile)
    n_tiles = tile_expert.shape[0]
    x = jnp.zeros((n_tiles * tile, z.shape[1]), z.dtype).at[rows].set(jnp.repeat(z, k, axis=0))
    x = x.reshape(n_tiles, tile, -1)
    h = swiglu(jnp.einsum("mtl,mhl->mth", x, w_up_gate[tile_expert]))
    out = jnp.einsum("mth,mhl->mtl", h, w_down[tile_expert]).reshape(n_tiles * tile, -1)
    return jnp.sum(weights[..., None] * out[rows].reshape(N, k, -1), axis=1)


def dispatch_for_backend():
    """`tiled_routed_experts` on CPU, `routed_experts` (ragged_dot) on TPU and GPU."""
    return tiled_routed_experts if jax.default_backend() == "cpu" else routed_experts


class RoutedExperts(nnx.Module):
    """E SwiGLU experts of hidden H on width L; `__call__(z [B, T, L], routing)` -> [B, T, L].
    Computes in `dtype` (the compute dtype), params in `full_precision(dtype)`."""

    def __init__(
        self,
        num_experts: int,
        width: int,
        hidden: int,
        *,
        std: float,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        init, p_dtype = trunc_normal(std), full_precision(dtype)
        self.w_up_gate = nnx.Param(init(rngs.params(), (num_experts, 2 * hidden, width), p_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, hidden, width), p_dtype))

    def __call__(self, z: jax.Array, routing: Routing) -> jax.Array:
        B, T, L = z.shape
        k = routing.indices.shape[-1]
        y = dispatch_for_backend()(
            z.reshape(B * T, L).astype(self.dtype),
            routing.indices.reshape(B * T, k),
            routing.weights.reshape(B * T, k).astype(self.dtype),
            self.w_up_gate[...].astype(self.dtype),
            self.w_down[...].astype(self.dtype),
        )
        return y.reshape(B, T, L)


class SharedExpert(nnx.Module):
    """One SwiGLU expert applied to every token: x [..., D] -> [..., D]. Computes in `dtype`
    (the compute dtype), params in `full_precision(dtype)`."""

    def __init__(self, d_model: int, hidden: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        init, p_dtype = trunc_normal(std), full_precision(dtype)
        self.w_up_gate = nnx.Param(init(rngs.params(), (d_model, 2 * hidden), p_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (1, hidden, d_model), p_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w_up_gate, w_down = (w[...].astype(self.dtype) for w in (self.w_up_gate, self.w_down))
        return swiglu(x.astype(self.dtype) @ w_up_gate) @ w_down[0]


class MoEAux(NamedTuple):
    """One MoE layer's router losses (unweighted) and expert counts."""

    lb_loss: jax.Array
    z_loss: jax.Array
    counts: jax.Array
    """[E] int32 token slots per routed expert."""


def router_aux(
    routing: Routing,
    *,
    num_experts: int,
    top_k: int,
    loss_div_factor=None,
    lb_axis_name: str | tuple[str, ...] | None = None,
) -> MoEAux:
    """The load-balancing loss, router z-loss and expert counts of one routing; `lb_axis_name`:
    the data axes the LB counts are averaged over (global load balancing, inside `shard_map`)."""
    counts = expert_counts(routing.indices, num_experts)
    lb_loss = load_balancing_loss(
        routing.probs,
        counts,
        top_k=top_k,
        loss_div_factor=loss_div_factor,
        axis_name=lb_axis_name,
    )
    z_loss = router_z_loss(routing.logits, loss_div_factor=loss_div_factor)
    return MoEAux(lb_loss, z_loss, counts)


class LatentMoE(nnx.Module):
    """m [B, T, d_model] (the feed-forward input, after its norm) -> (y [B, T, d_model], MoEAux).

    `document_ids`, `pools`: as `Router` (EMO). `loss_div_factor`: the aux losses' divisor
    (None: B*T); `lb_axis_name`: as `router_aux`. Children carry OLMo-core's block-level names.
    `dtype`: the compute dtype (`model.precision`)."""

    def __init__(
        self, config: MoEConfig, d_model: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        if config.shared_expert_hidden is None:
            raise NotImplementedError("LatentMoE without a shared expert")
        self.config = config
        self.routed_experts_router = Router(config, d_model, std=std, dtype=dtype, rngs=rngs)
        self.latent_down_proj = linear(d_model, config.latent_dim, std, rngs, dtype=dtype)
        self.routed_experts = RoutedExperts(
            config.num_experts,
            config.latent_dim,
            config.expert_hidden,
            std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.latent_up_proj = linear(config.latent_dim, d_model, std, rngs, dtype=dtype)
        self.shared_experts = SharedExpert(
            d_model, config.shared_expert_hidden, std=std, dtype=dtype, rngs=rngs
        )

    def __call__(
        self,
        m: jax.Array,
        *,
        document_ids: jax.Array | None = None,
        pools: jax.Array | None = None,
        loss_div_factor=None,
        lb_axis_name: str | tuple[str, ...] | None = None,
    ) -> tuple[jax.Array, MoEAux]:
        c = self.config
        routing = self.routed_experts_router(m, document_ids=document_ids, pools=pools)
        routed = self.latent_up_proj(self.routed_experts(self.latent_down_proj(m), routing))
        aux = router_aux(
            routing,
            num_experts=c.num_experts,
            top_k=c.top_k,
            loss_div_factor=loss_div_factor,
            lb_axis_name=lb_axis_name,
        )
        return routed + self.shared_experts(m), aux
