"""The olmo35 model's side of a train step: the unweighted terms of one micro-batch for
`model.train_step`, as the forward of OLMo-core's `OLMoDDPTrainModule.train_batch` (model, LM
loss with its z-loss, and the router losses each MoE block attaches).

A micro-batch is a dict of arrays with the rows first (`OlmoData.micro_batches` plus the draws):
"inputs", "labels", "inputs_segmentation" [b, T] and "pool_draws" [b, n_moe_layers, T] (EMO pool
of document d of a row in column d). Document ids are `inputs_segmentation - 1`: from EOS when the
data was made with `Flags.olmo_segment_ids_from_eos`, one document a row otherwise (MaxText).

With a mesh, the model runs inside `shard_map` over the data axes (data x fsdp), every device on
its own rows as OLMo-core's data-parallel ranks, params replicated; each device divides by the
global D, so the sum of the devices' terms is the batch's. `Flags.moe_global_load_balancing`
averages the expert counts over those axes (OLMo-core's `global_load_balancing`, logged as the
mean over devices). Off, every device balances its own rows and the logged LB is device 0's
(MaxText), scaled to the batch, while the gradient stays the sum of each device's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model.config import Config
from model.loss import lm_head_loss_sums
from model.sharding import BATCH_AXES
from model.train_step import TermsFn

Axes = tuple[str, ...] | None


def _local_terms(graphdef, cfg: Config, params, mb, div, lb_axis_name: Axes):
    model = nnx.merge(graphdef, params)
    h, aux = model.hidden(
        mb["inputs"],
        train=True,
        pool_draws=jnp.swapaxes(mb["pool_draws"], 0, 1),  # shape: [b, L, T] -> [L, b, T]
        loss_div_factor=div,
        document_ids=mb["inputs_segmentation"] - 1,
        lb_axis_name=lb_axis_name,
    )
    head = model.lm_head
    ce, z = lm_head_loss_sums(
        head.norm(h),
        head.w_out.kernel[...].astype(model.dtype),  # the LM head's matmul in the compute dtype
        mb["labels"],
        tiles=cfg.train.vocab_tiles,
        seq_major=cfg.flags.vocab_tiling_seq_major,
    )
    return {
        "ce": ce / div,
        "z_loss": z / div,
        "lb_loss": aux.lb_loss,
        "router_z_loss": aux.z_loss,
        "expert_counts": aux.counts,
    }


def model_terms_fn(graphdef, cfg: Config, *, mesh: Mesh | None = None) -> TermsFn:
    """`terms_fn(params, micro_batch, loss_div_factor)` of the `Transformer` split into
    `graphdef` and params: "ce", "z_loss" (scalars), "lb_loss", "router_z_loss" ([n_moe_layers]),
    each divided by the batch's D (the router losses too, as OLMo-core's); "expert_counts"
    [n_moe_layers, E], the token slots each routed expert received (logged, not a loss)."""
    if mesh is None:
        return lambda params, mb, div: _local_terms(graphdef, cfg, params, mb, div, None)
    devices = mesh.shape["data"] * mesh.shape["fsdp"]
    global_lb = cfg.flags.moe_global_load_balancing

    def per_device(params, mb, div):
        axes = BATCH_AXES if global_lb else None
        terms = _local_terms(graphdef, cfg, params, mb, div, axes)
        return jax.tree.map(lambda x: x[None], terms)

    sharded = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(BATCH_AXES), P()), out_specs=P(BATCH_AXES)
    )

    def terms(params, mb, div):
        each = sharded(params, mb, div)  # [devices, ...] a term
        total = jax.tree.map(lambda x: jnp.sum(x, axis=0), each)
        if not global_lb:
            device_0 = devices * each["lb_loss"][0]
            total["lb_loss"] = total["lb_loss"] + lax.stop_gradient(device_0 - total["lb_loss"])
        return total

    return terms
