"""The olmo35 model's side of a train step: the unweighted terms of one micro-batch for
`model.train_step`, as the forward of OLMo-core's `OLMoDDPTrainModule.train_batch` (model, LM
loss with its z-loss, and the router losses each MoE block attaches).

A micro-batch is a dict of arrays with the rows first (`OlmoData.micro_batches` plus the draws):
"inputs", "labels", "inputs_segmentation" [b, T] and "pool_draws" [b, n_moe_layers, T] (EMO pool
of document d of a row in column d). Document ids are `inputs_segmentation - 1`: from EOS when the
data was made with `Flags.olmo_segment_ids_from_eos`, one document a row otherwise (MaxText).

On a mesh (`model.layout`) the model runs under GSPMD on the whole micro-batch: rows split over
the devices, weights gathered where used, the routed experts in `shard_map`
(`model.expert_parallel`); each term is the whole batch's. `Flags.moe_global_load_balancing`
balances the whole batch's expert counts, which is OLMo-core's `global_load_balancing` (counts
averaged over the ranks). Off, the rows of each device that holds different rows balance on their
own counts and the logged LB is the first device's, scaled to the batch (MaxText), while the
gradient stays the sum of each device's own.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from model.config import Config
from model.layout import Layout, layout_of
from model.train_step import TermsFn


def _terms(graphdef, cfg: Config, params, mb, div, layout: Layout | None):
    model = nnx.merge(graphdef, params)
    rows = mb["inputs"].shape[0]
    per_device = layout is not None and not cfg.flags.moe_global_load_balancing
    groups = layout.batch_shards(rows) if per_device else 1
    h, aux = model.hidden(
        mb["inputs"],
        train=True,
        pool_draws=jnp.swapaxes(mb["pool_draws"], 0, 1),  # shape: [b, L, T] -> [L, b, T]
        loss_div_factor=div,
        document_ids=mb["inputs_segmentation"] - 1,
        lb_groups=groups,
        layout=layout,
        remat=cfg.scale.remat_policy,
        kda_kernel=cfg.scale.kda_kernel,
        attention_kernel=cfg.scale.attention_kernel,
    )
    ce, z = model.lm_head.loss_sums(
        h,
        mb["labels"],
        tiles=cfg.train.vocab_tiles,
        seq_major=cfg.flags.vocab_tiling_seq_major,
        layout=layout,
        keep_logits=cfg.scale.vocab_tiles_keep_logits,
    )
    lb = aux.lb_loss
    if groups > 1:  # logged: the first device's, scaled to the batch; gradient: every device's
        lb = lb + lax.stop_gradient(groups * aux.lb_loss_first_group - lb)
    return {
        "ce": ce / div,
        "z_loss": z / div,
        "lb_loss": lb,
        "router_z_loss": aux.z_loss,
        "expert_counts": aux.counts,
    }


def model_terms_fn(graphdef, cfg: Config, *, mesh: Mesh | None = None) -> TermsFn:
    """`terms_fn(params, micro_batch, loss_div_factor)` of the `Transformer` split into
    `graphdef` and params, on `mesh` (None: one device): "ce", "z_loss" (scalars), "lb_loss",
    "router_z_loss" ([n_moe_layers]), each divided by the batch's D (the router losses too, as
    OLMo-core's); "expert_counts" [n_moe_layers, E], the token slots each routed expert received
    (logged, not a loss)."""
    layout = None if mesh is None else layout_of(cfg, mesh)
    return lambda params, mb, div: _terms(graphdef, cfg, params, mb, div, layout)
