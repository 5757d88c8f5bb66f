"""Goldens of single peri-norm blocks of OLMo-core's micro `OLMoDDPModel` (goldens.model's model
with the trace's trained weights): block 0 (KDA mixer, dense SwiGLU), block 1 (KDA, latent MoE) and
block 7 (attention, latent MoE), each on the input it gets in goldens.model's training forward
(row 0), in training mode with recorded pool draws.

`block_<kind>.safetensors`: x [1, T, d_model], input ids (their EOS give the EMO documents), for
MoE blocks the pool draws [1, T] and `loss_div_factor` T - 1 (the row's labelled tokens), the
output y, a token-mean cotangent and the gradients of sum(y * cotangent) (plus the weighted router
losses OLMo-core attaches to a MoE block's output) w.r.t. x and every parameter of the block
(OLMo-core keys, `blocks.<i>.` prefix kept).
"""

from __future__ import annotations

from goldens.model import DRAW_SEED, STANDINS, WEIGHTS, batch, prepared_model
from goldens.router import PoolRecorder
from goldens.store import GoldenFile
from goldens.tolerances import (
    BLOCK_FORWARD,
    BLOCK_GRAD,
    KDA_BLOCK_FORWARD,
    KDA_BLOCK_GRAD,
    REGENERATE_RTOL,
)
from goldens.torch_layers import to_numpy, token_mean_cotangent

BLOCKS = {"dense": 0, "kda": 1, "attention": 7}
"""Golden name -> block index in the micro model."""
SEED = 8008
"""The cotangents' generator."""
TOLERANCES = {
    "dense": (KDA_BLOCK_FORWARD, KDA_BLOCK_GRAD),  # block 0's mixer is KDA
    "kda": (KDA_BLOCK_FORWARD, KDA_BLOCK_GRAD),
    "attention": (BLOCK_FORWARD, BLOCK_GRAD),
}
"""Golden name -> (forward, gradient) tolerances."""


def _block_inputs(model, ids) -> dict[int, object]:
    """The input of each block of `BLOCKS` in a training forward (no grad)."""
    import torch

    inputs = {}

    def keep(index):
        def hook(module, args):
            inputs[index] = args[0].detach()

        return hook

    handles = [model.blocks[str(i)].register_forward_pre_hook(keep(i)) for i in BLOCKS.values()]
    torch.manual_seed(DRAW_SEED)
    with torch.no_grad():
        model(ids, loss_div_factor=float(ids.numel()))
    for handle in handles:
        handle.remove()
    return inputs


def export() -> list[GoldenFile]:
    import olmo_core.ops.moe as ops
    import torch

    model = prepared_model()
    eos = model.blocks["1"].routed_experts_router.eos_token_id
    ids = torch.from_numpy(batch()[0][:1])
    inputs = _block_inputs(model, ids)
    generator = torch.Generator().manual_seed(SEED)
    files = []
    for kind, index in BLOCKS.items():
        block = model.blocks[str(index)]
        x = inputs[index].clone().requires_grad_(True)
        tensors = {"x": x, "input_ids": ids}
        kwargs = {}
        if block.has_routed_experts:
            recorder = PoolRecorder(block.routed_experts_router)
            div = float(ids.shape[1] - 1)
            kwargs = {"segment_ids": ops.segment_ids_from_eos(ids, eos), "loss_div_factor": div}
        torch.manual_seed(DRAW_SEED + index)
        y = block(x, **kwargs)
        if block.has_routed_experts:
            tensors["pool_draws"] = recorder.draws(0, ids.shape)
        cotangent = token_mean_cotangent(y.shape, generator)
        (y * cotangent).sum().backward()
        tensors.update({"y": y, "cotangent": cotangent, "grad.x": x.grad})
        for name, p in block.named_parameters():
            tensors[f"grad.blocks.{index}.{name}"] = p.grad
        model.zero_grad(set_to_none=True)
        files.append(
            GoldenFile(
                path=f"block_{kind}.safetensors",
                tensors=to_numpy(tensors),
                producer="olmo_core.nn.ddp.block.OLMoDDPTransformerBlock of the micro "
                "OLMoDDPModel (goldens.model.prepared_model)",
                seeds={
                    "torch_cotangent": SEED,
                    "torch_global_before_block_forward": DRAW_SEED + index,
                },
                config={
                    "block_index": index,
                    "loss_div_factor": kwargs.get("loss_div_factor"),
                    "weights": WEIGHTS,
                },
                tolerances={
                    "forward": TOLERANCES[kind][0].as_dict(),
                    "grad": TOLERANCES[kind][1].as_dict(),
                    "regenerate_rtol": REGENERATE_RTOL,
                },
                substitutions=STANDINS,
            )
        )
    return files
