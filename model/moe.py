"""The latent MoE feed-forward with a shared expert, as OLMo-core's v2 MoE in an
`OLMoDDPTransformerBlock` without expert parallelism (olmo_core/nn/ddp/block.py,
nn/moe/v2/{routed_experts,shared_experts,no_ep}.py, 3.0.0):

    routing = router(m)                                    (model space, EMO pools; model.router)
    y = latent_up_proj(sum_k weight_k * SwiGLU_{e_k}(latent_down_proj(m)))  +  SwiGLU_shared(m)
    SwiGLU_e(z) = (up * silu(gate)) @ w_down[e],  [up | gate] = z @ w_up_gate[e]^T

Dropless: every token reaches all its k experts. `routed_experts` sorts the token slots by expert
and runs grouped matmuls (`jax.lax.ragged_dot`, OLMo-core's grouped GEMM; on TPU MaxText's Pallas
megablox kernels, whose backward XLA's TPU `ragged_dot` cannot match in memory). XLA's CPU runs a
`ragged_dot` as E masked dense matmuls, so on CPU `tiled_routed_experts` pads each expert's slots
to whole tiles of `TILE_ROWS` and runs one batched matmul over the tiles (`dispatch_for`).
`naive_routed_experts`, every expert on every token, is the spec of them all. An index equal to E
marks a slot whose expert lives on another device (`model.expert_parallel`): it adds nothing.
The per-layer router losses are returned unweighted.
Weights keep OLMo-core's layouts: routed w_up_gate [E, 2H, L], w_down [E, H, L]; shared w_up_gate
[D, 2H], w_down [1, H, D]; the latent projections are linear kernels [in, out]. The shared expert
alone is also the dense feed-forward of block 0 (OLMo-core builds it as a shared-experts block).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from model.aux_losses import expert_counts, grouped_load_balancing_loss, router_z_loss
from model.config import MoEConfig
from model.expert_parallel import expert_parallel
from model.init import linear, trunc_normal
from model.layout import Layout
from model.precision import TPU_LANES, at_kernel_precision, full_precision, kernel_precision
from model.router import Router, Routing

MEGABLOX_TILE = 512
"""Largest tile side of `megablox_matmul` (rows, contracted, output)."""
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

    z: [N, L]; indices (in [0, E], E: not here), weights: [N, k]; w_up_gate: [E, 2H, L];
    w_down: [E, H, L]. Returns [N, L].
    """
    h = swiglu(jnp.einsum("nl,ehl->enh", z, w_up_gate))  # shape: [E, N, H]
    out = jnp.einsum("enh,ehl->enl", h, w_down)
    out = jnp.concatenate([out, jnp.zeros_like(out[:1])])  # shape: [E + 1, N, L], E adds nothing
    chosen = out[indices, jnp.arange(z.shape[0])[:, None]]  # shape: [E, N, L] -> [N, k, L]
    return jnp.sum(weights[..., None] * chosen, axis=1)


@jax.named_scope("grouped_matmul")
def ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] rows grouped in order, w [G, K, N] -> [M, N], group g's rows times w[g]; rows past
    the last group come out zero (`jax.lax.ragged_dot`)."""
    return jax.lax.ragged_dot(x, w, group_sizes)


def megablox_fits(*widths: int) -> bool:
    """Whether megablox's blocks take matmul widths `widths`: each in whole `TPU_LANES`."""
    return not any(n % TPU_LANES for n in widths)


@jax.named_scope("grouped_matmul")
def megablox_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """`ragged_matmul` by MaxText's TPU grouped-matmul kernel (Pallas megablox `gmm`, whose
    backward is its own `tgmm`), tiles of up to `MEGABLOX_TILE`; `interpret`: Pallas's
    interpreter, on any backend. Its blocks need widths (K, N) in whole `TPU_LANES`; narrower
    experts (the micro config's) go to `ragged_matmul`. The kernel leaves the rows past the last
    group unwritten, in its output and in its gradient with respect to x: the caller reads
    neither (`routed_experts`)."""
    if not megablox_fits(*w.shape[1:]):
        return ragged_matmul(x, w, group_sizes)
    tiling = tuple(min(MEGABLOX_TILE, n) for n in (x.shape[0], *w.shape[1:]))

    def gmm(x, w, group_sizes):
        return megablox.gmm(x, w, group_sizes, x.dtype, tiling, None, None, False, interpret)

    return at_kernel_precision(gmm, kernel_precision(x.dtype, w.dtype), x, w, group_sizes)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, readers: jax.Array) -> jax.Array:
    """x[index] [M, L] for x [R, L], a row of zeros where index >= R. `readers` [R, r] names the
    rows of the result that read each row of x (M for none; at most r). The gradient gathers the
    result's rows through `readers` and sums them, where XLA's transpose of a gather would
    scatter-add, which a TPU runs slowly."""
    return x.at[index].get(mode="fill", fill_value=0)


def _gather_rows_forward(x, index, readers):
    return gather_rows(x, index, readers), readers


def _gather_rows_backward(readers, dy):
    return jnp.sum(dy.at[readers].get(mode="fill", fill_value=0), axis=1), None, None


gather_rows.defvjp(_gather_rows_forward, _gather_rows_backward)


@jax.named_scope("moe_dispatch")
def routed_experts(
    z: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w_up_gate: jax.Array,
    w_down: jax.Array,
    *,
    matmul=ragged_matmul,
) -> jax.Array:
    """Dropless grouped dispatch, same arguments and result as `naive_routed_experts`: token slots
    sorted by expert (stable), two grouped matmuls (`matmul`: `ragged_matmul` or
    `megablox_matmul`), slots put back and summed over k; both moves are gathers, forward and
    backward (`gather_rows`). Slots of index E sort last, outside
    every group, where `matmul` may leave its output and its gradient unwritten: their rows are
    gathered as zeros (their gradient dropped) and read back as zeros. Group sizes are counted
    by comparison, not by `bincount`, a scatter-add that XLA's TPU backend runs as a sort."""
    N, k = indices.shape
    E = w_up_gate.shape[0]
    flat = indices.reshape(-1)  # shape: [N*k], slot s = token s // k
    order = jnp.argsort(flat, stable=True)
    group_sizes = expert_counts(flat, E)
    grouped = jnp.arange(N * k) < jnp.sum(group_sizes)  # the rows of slots of index E sort last
    token = jnp.where(grouped, order // k, N)  # shape: [N*k], grouped by expert; N: none
    slot = jnp.where(grouped, order, N * k)  # each row's slot; N*k: none
    row = jnp.where(flat < E, jnp.argsort(order), N * k)  # each slot's row; N*k: none
    rows = gather_rows(z, token, row.reshape(N, k))  # shape: [N*k, L]
    h = swiglu(matmul(rows, jnp.swapaxes(w_up_gate, 1, 2), group_sizes))
    out = matmul(h, w_down, group_sizes)  # shape: [N*k, L]
    slots = gather_rows(out, row, slot[:, None]).reshape(N, k, -1)
    return jnp.sum(weights[..., None] * slots, axis=1)


def expert_tiles(indices: jax.Array, num_experts: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """Each expert's token slots padded to whole tiles of `tile` rows: (row [N*k] of each slot s =
    token s // k in the padded layout, an expert's slots in token order, n_tiles * tile (past the
    end) for a slot of index E; expert [n_tiles] of each tile). n_tiles = ceil(N*k / tile) + E
    bounds the padding; the spare tiles hold no slot."""
    flat = indices.reshape(-1)  # shape: [N*k]
    here = flat < num_experts
    one_hot = (flat[:, None] == jnp.arange(num_experts)).astype(jnp.int32)  # shape: [N*k, E]
    expert = jnp.where(here, flat, 0)
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), expert[:, None], axis=1)[:, 0] - 1
    padded = -(-jnp.sum(one_hot, axis=0) // tile) * tile  # shape: [E]
    ends = jnp.cumsum(padded)
    n_tiles = -(-flat.size // tile) + num_experts
    first_rows = jnp.arange(n_tiles) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(ends, first_rows, side="right"), num_experts - 1)
    rows = jnp.where(here, ends[expert] - padded[expert] + rank, n_tiles * tile)
    return rows, tile_expert


@jax.named_scope("moe_dispatch")
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
    x = jnp.zeros((n_tiles * tile, z.shape[1]), z.dtype)
    x = x.at[rows].set(jnp.repeat(z, k, axis=0), mode="drop").reshape(n_tiles, tile, -1)
    with jax.named_scope("grouped_matmul"):
        h = swiglu(jnp.einsum("mtl,mhl->mth", x, w_up_gate[tile_expert]))
        out = jnp.einsum("mth,mhl->mtl", h, w_down[tile_expert]).reshape(n_tiles * tile, -1)
    slots = out.at[rows].get(mode="fill", fill_value=0).reshape(N, k, -1)
    return jnp.sum(weights[..., None] * slots, axis=1)


def grouped_matmul_kernel(platform: str, latent: int, hidden: int) -> str:
    """What runs the expert matmuls on `platform` at widths `latent` and `hidden`: "tiles" on
    "cpu" (`tiled_routed_experts`), "megablox" on "tpu" where `megablox_fits` (MaxText's),
    "ragged_dot" otherwise."""
    if platform == "cpu":
        return "tiles"
    if platform == "tpu" and megablox_fits(latent, 2 * hidden, hidden):
        return "megablox"
    return "ragged_dot"


def dispatch_for(platform: str, latent: int, hidden: int):
    """The routed-experts dispatch that `grouped_matmul_kernel` names."""
    kernel = grouped_matmul_kernel(platform, latent, hidden)
    if kernel == "tiles":
        return tiled_routed_experts
    if kernel == "megablox":
        return functools.partial(routed_experts, matmul=megablox_matmul)
    return routed_experts


class RoutedExperts(nnx.Module):
    """E SwiGLU experts of hidden H on width L; `__call__(z [B, T, L], routing)` -> [B, T, L].
    Computes in `dtype` (the compute dtype), params in `full_precision(dtype)`. With a `layout`
    (`model.layout`) the experts run split over its mesh (`model.expert_parallel`)."""

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
        axes = ("experts", "mlp", "latent")
        self.w_up_gate = nnx.Param(
            init(rngs.params(), (num_experts, 2 * hidden, width), p_dtype), logical_axes=axes
        )
        self.w_down = nnx.Param(
            init(rngs.params(), (num_experts, hidden, width), p_dtype), logical_axes=axes
        )

    def __call__(self, z: jax.Array, routing: Routing, *, layout: Layout | None = None):
        args = (
            z.astype(self.dtype),
            routing.indices,
            routing.weights.astype(self.dtype),
            self.w_up_gate[...].astype(self.dtype),
            self.w_down[...].astype(self.dtype),
        )
        _, hidden, latent = args[4].shape  # w_down [E, H, L]
        if layout is not None:
            dispatch = dispatch_for(layout.platform, latent, hidden)
            return expert_parallel(dispatch, layout, *args)
        B, T, L = z.shape
        flat = (x.reshape(B * T, -1) for x in args[:3])
        dispatch = dispatch_for(jax.default_backend(), latent, hidden)
        return dispatch(*flat, *args[3:]).reshape(B, T, L)


class SharedExpert(nnx.Module):
    """One SwiGLU expert applied to every token: x [..., D] -> [..., D]. Computes in `dtype`
    (the compute dtype), params in `full_precision(dtype)`."""

    def __init__(self, d_model: int, hidden: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        init, p_dtype = trunc_normal(std), full_precision(dtype)
        self.w_up_gate = nnx.Param(
            init(rngs.params(), (d_model, 2 * hidden), p_dtype), logical_axes=("embed", "mlp")
        )
        self.w_down = nnx.Param(
            init(rngs.params(), (1, hidden, d_model), p_dtype), logical_axes=(None, "mlp", "embed")
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        w_up_gate, w_down = (w[...].astype(self.dtype) for w in (self.w_up_gate, self.w_down))
        return swiglu(x.astype(self.dtype) @ w_up_gate) @ w_down[0]


class MoEAux(NamedTuple):
    """One MoE layer's router losses (unweighted) and expert counts."""

    lb_loss: jax.Array
    z_loss: jax.Array
    counts: jax.Array
    """[E] int32 token slots per routed expert."""
    lb_loss_first_group: jax.Array
    """The first row group's share of lb_loss (`router_aux`); lb_loss itself with one group."""


def router_aux(
    routing: Routing, *, num_experts: int, top_k: int, loss_div_factor=None, lb_groups: int = 1
) -> MoEAux:
    """The load-balancing loss, router z-loss and expert counts of one routing. `lb_groups`: row
    blocks balanced each on its own counts, their losses summed (1: the whole batch, OLMo-core's
    global load balancing; the devices' rows: MaxText's per-device balancing)."""
    counts = expert_counts(routing.indices, num_experts)
    lb_losses = grouped_load_balancing_loss(
        routing.probs,
        routing.indices,
        groups=lb_groups,
        top_k=top_k,
        loss_div_factor=loss_div_factor,
    )
    z_loss = router_z_loss(routing.logits, loss_div_factor=loss_div_factor)
    return MoEAux(jnp.sum(lb_losses), z_loss, counts, lb_losses[0])


class LatentMoE(nnx.Module):
    """m [B, T, d_model] (the feed-forward input, after its norm) -> (y [B, T, d_model], MoEAux).

    `document_ids`, `pools`: as `Router` (EMO). `loss_div_factor`: the aux losses' divisor
    (None: B*T); `lb_groups`: as `router_aux`; `layout`: as `RoutedExperts`. Children carry
    OLMo-core's block-level names.
    `dtype`: the compute dtype (`model.precision`)."""

    def __init__(
        self, config: MoEConfig, d_model: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        if config.shared_expert_hidden is None:
            raise NotImplementedError("LatentMoE without a shared expert")
        self.config = config
        self.routed_experts_router = Router(config, d_model, std=std, dtype=dtype, rngs=rngs)
        self.latent_down_proj = linear(
            d_model, config.latent_dim, std, rngs, axes=("embed", "latent"), dtype=dtype
        )
        self.routed_experts = RoutedExperts(
            config.num_experts,
            config.latent_dim,
            config.expert_hidden,
            std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.latent_up_proj = linear(
            config.latent_dim, d_model, std, rngs, axes=("latent", "embed"), dtype=dtype
        )
        self.shared_experts = SharedExpert(
            d_model, config.shared_expert_hidden, std=std, dtype=dtype, rngs=rngs
        )

    @jax.named_scope("moe")
    def __call__(
        self,
        m: jax.Array,
        *,
        document_ids: jax.Array | None = None,
        pools: jax.Array | None = None,
        loss_div_factor=None,
        lb_groups: int = 1,
        layout: Layout | None = None,
    ) -> tuple[jax.Array, MoEAux]:
        c = self.config
        routing = self.routed_experts_router(m, document_ids=document_ids, pools=pools)
        z = self.latent_down_proj(m)
        routed = self.latent_up_proj(self.routed_experts(z, routing, layout=layout))
        aux = router_aux(
            routing,
            num_experts=c.num_experts,
            top_k=c.top_k,
            loss_div_factor=loss_div_factor,
            lb_groups=lb_groups,
        )
        return routed + self.shared_experts(m), aux
