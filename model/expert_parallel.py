"""Routed experts split over the "expert" mesh axis, inside `shard_map` (OLMo-core's expert-parallel
`RoutedExperts`; MaxText's sparse matmul under expert parallelism), dropless:

    on each device: its rows' tokens z [n, L] and their routing; its E/e experts' weights,
    all-gathered over the other axes that split them (fsdp)
    z, routing  = all-gather over "expert" of every expert shard's tokens          [e n, L]
    y_partial   = dispatch(z, routing to the local experts; other slots index E/e: nothing)
    y           = reduce-scatter over "expert" of y_partial: each token's sum over its k experts,
                  back on the device that owns it                                   [n, L]

Communication per device and layer, each way: the all-gather receives (e - 1) n L activations (and
the routing, n k numbers); an all-to-all of the token slots would move (e - 1)/e n k L. The gather
moves e/k of that: a quarter for the hero (e = 4, k = 16). When the rows do not split over
"expert" (too few of them), every expert shard already holds the same tokens: no gather, and a
psum over "expert" combines the partial sums. Weight gradients come back reduce-scattered over
fsdp (the transpose of the gather) and summed over the other data axes (by `shard_map`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from model.layout import Layout

EXPERTS = ("experts", "mlp", "latent")
"""Logical axes of the routed experts' weights [E, 2H or H, L]."""


def _gather_weight(w: jax.Array, spec: P) -> jax.Array:
    """This device's shard of a weight, all-gathered along each dimension over every mesh axis
    that splits it except "expert"."""
    for dim, axes in enumerate(spec):
        if dim > 0 and axes is not None:
            w = lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def _local_routing(indices: jax.Array, weights: jax.Array, first: jax.Array, n_local: int):
    """Indices relative to this device's experts [first, first + n_local); others become n_local
    with weight 0."""
    local = indices - first
    here = (local >= 0) & (local < n_local)
    return jnp.where(here, local, n_local), jnp.where(here, weights, 0)


def expert_parallel(
    dispatch: Callable,
    layout: Layout,
    z: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w_up_gate: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """`dispatch(z, indices, weights, w_up_gate, w_down)` (a `model.moe` routed-experts function)
    over `layout`'s mesh. z [B, T, L]; indices, weights [B, T, k]; w_up_gate [E, 2H, L]; w_down
    [E, H, L]. Returns [B, T, L], rows laid out as z's."""
    B, T, L = z.shape
    rows = layout.batch_axes(B)
    specs = [layout.spec(EXPERTS, w.shape) for w in (w_up_gate, w_down)]
    if any(spec[0] not in (None, "expert") for spec in specs):
        raise ValueError(f"routed experts must split over 'expert' alone, got {specs}")
    split = specs[0][0] == "expert"
    gather = split and "expert" in rows
    tokens = P(rows or None)

    def local(z, indices, weights, w_up_gate, w_down):
        w_up_gate, w_down = (
            _gather_weight(w, s) for w, s in zip((w_up_gate, w_down), specs, strict=True)
        )
        z, indices, weights = (x.reshape(-1, x.shape[-1]) for x in (z, indices, weights))
        if gather:
            z, indices, weights = (
                lax.all_gather(x, "expert", axis=0, tiled=True) for x in (z, indices, weights)
            )
        if split:
            n_local = w_up_gate.shape[0]
            first = lax.axis_index("expert") * n_local
            indices, weights = _local_routing(indices, weights, first, n_local)
        y = dispatch(z, indices, weights, w_up_gate, w_down)
        if gather:
            y = lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        elif split:
            y = lax.psum(y, "expert")
        return y.reshape(-1, T, L)

    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(tokens, tokens, tokens, *specs),
        out_specs=tokens,
        check_vma=False,  # a Pallas kernel (megablox) declares no varying axes
    )(z, indices, weights, w_up_gate, w_down)
