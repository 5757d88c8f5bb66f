"""Single peri-norm blocks of OLMo-core's micro `OLMoDDPModel` (goldens.model), for the fp64
oracles (goldens.oracle): block 0 (KDA mixer, dense SwiGLU), block 1 (KDA, latent MoE) and block 7
(attention, latent MoE), each on the input it gets in goldens.model's training forward, in training
mode with recorded pool draws; `block_vjp` gives the output and the gradients of sum(y * cotangent)
(plus the weighted router losses OLMo-core attaches to a MoE block's output) w.r.t. x and every
parameter of the block (OLMo-core keys, `blocks.<i>.` prefix kept).
"""

from __future__ import annotations

from goldens.model import DRAW_SEED
from goldens.runtime.recorders import PoolRecorder

BLOCKS = {"dense": 0, "kda": 1, "attention": 7}
"""Case name -> block index in the micro model."""


def forward_inputs(model, ids, modules: dict) -> dict:
    """The (first positional) input of each of `modules` ({key: submodule of `model`}) in a
    training forward of `ids` with the draws of `DRAW_SEED` (no grad)."""
    import torch

    inputs = {}
    handles = [
        module.register_forward_pre_hook(
            lambda _, args, key=key: inputs.update({key: args[0].detach()})
        )
        for key, module in modules.items()
    ]
    torch.manual_seed(DRAW_SEED)
    with torch.no_grad():
        model(ids, loss_div_factor=float(ids.numel()))
    for handle in handles:
        handle.remove()
    return inputs


def loss_div_factor(block, ids) -> float | None:
    """The router losses' divisor of a MoE block on one row `ids` [1, T]: its labelled tokens,
    T - 1 (None for a dense block)."""
    return float(ids.shape[1] - 1) if block.has_routed_experts else None


def block_vjp(model, index: int, x, ids, cotangent) -> dict:
    """Block `index` of `model` on x [1, T, d_model] (the documents of `ids`, draws of
    `DRAW_SEED + index`): y, and the gradients of sum(y * cotangent) + the router losses it
    attaches w.r.t. x and each block parameter ("grad.x", "grad.blocks.<index>.<name>"); for a
    MoE block also the pool draws [1, T]."""
    import olmo_core.ops.moe as ops
    import torch

    block = model.blocks[str(index)]
    x = x.clone().requires_grad_(True)
    tensors, kwargs = {}, {}
    if block.has_routed_experts:
        recorder = PoolRecorder(block.routed_experts_router)
        eos = block.routed_experts_router.eos_token_id
        segment_ids = ops.segment_ids_from_eos(ids, eos)
        kwargs = {"segment_ids": segment_ids, "loss_div_factor": loss_div_factor(block, ids)}
    torch.manual_seed(DRAW_SEED + index)
    y = block(x, **kwargs)
    if block.has_routed_experts:
        tensors["pool_draws"] = recorder.draws(0, ids.shape)
    (y * cotangent).sum().backward()
    tensors.update({"y": y, "grad.x": x.grad})
    for name, p in block.named_parameters():
        tensors[f"grad.blocks.{index}.{name}"] = p.grad
    model.zero_grad(set_to_none=True)
    return tensors
