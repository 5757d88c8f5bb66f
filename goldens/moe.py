"""Goldens of the latent MoE feed-forward with a shared expert, from one OLMo-core
`OLMoDDPTransformerBlock` (olmo_core/nn/ddp/block.py, `moe_fused_v2`, peri-norm) with the micro
config's MoE: EMO router over d_model 64, 16 routed SwiGLU experts (hidden 64) in a 32-wide latent
space between `latent_down_proj` and `latent_up_proj`, one shared SwiGLU expert (hidden 64), run
by OLMo-core's own no-expert-parallel path (`no_ep.combined_forward_no_ep`) on CPU through the
stand-ins of `goldens.runtime.standins.install_moe`. The block's mixer is the micro attention.

The MoE part of the block is cut out with hooks: the output of `feed_forward_input_norm` (the MoE
input m [2, 128, 64]) is replaced by a leaf tensor, the input of `feed_forward_norm` is the MoE
output (routed + shared, before the branch norm), and the router's `compute_aux_loss` gives the
weighted aux loss (LB weight 0.01, z weight 1e-5, `loss_div_factor` B*(T-1), as the hero).
- `moe.safetensors`: m, input ids and segment ids (EOS as `goldens.router`), the MoE weights
  (OLMo-core names, trained-like scale: N(0, 1/fan_in)), in training mode the recorded pool draws,
  the chosen experts, counts, unscaled LB and z-losses, the output and a cotangent; in evaluation
  mode (eval pool 16) the output.
- `moe_grads.safetensors`: gradients of sum(output * cotangent) + aux loss with respect to m and
  every MoE weight (a separate file, so that each stays well under 1 MB).
"""

from __future__ import annotations

from goldens.router import LOSS_DIV_FACTOR, X_SHAPE, input_ids
from goldens.runtime import models
from goldens.runtime.models import ATTENTION_BACKEND, NO_EXPERT_PARALLELISM
from goldens.runtime.recorders import PoolRecorder
from goldens.runtime.standins import MOE_SUBSTITUTIONS, install_moe
from goldens.runtime.torch_layers import to_numpy, token_mean_cotangent
from goldens.store import GoldenFile
from goldens.tolerances import FP32_GRAD, MOE_FORWARD, REGENERATE_COMPONENT
from model.config import micro

SEED = 7007
DRAW_SEED = 7008
LB_WEIGHT, Z_WEIGHT = micro().train.lb_loss_weight, micro().train.router_z_loss_weight
MOE_PARAMS = (
    "routed_experts_router.weight",
    "routed_experts.w_up_gate",
    "routed_experts.w_down",
    "latent_down_proj.weight",
    "latent_up_proj.weight",
    "shared_experts.w_up_gate",
    "shared_experts.w_down",
)
FAN_IN_AXIS = {  # how each weight is applied: the axis it contracts with its input
    "routed_experts_router.weight": None,  # [E * D], viewed [E, D]: fan-in d_model
    "routed_experts.w_up_gate": -1,  # [E, 2H, L], x @ w[e].T
    "routed_experts.w_down": -2,  # [E, H, L], h @ w[e]
    "latent_down_proj.weight": -1,  # linear [out, in]
    "latent_up_proj.weight": -1,
    "shared_experts.w_up_gate": 0,  # [D, 2H], x @ w
    "shared_experts.w_down": -2,  # [1, H, D], h @ w[0]
}


def block_config():
    """OLMo-core's block config for a micro MoE block: attention mixer, peri-norm, latent MoE."""
    return models.block_config(
        micro().model,
        "attention",
        dense=False,
        lb_loss_weight=LB_WEIGHT,
        router_z_loss_weight=Z_WEIGHT,
        global_load_balancing=False,
    )


def build_block(generator):
    """The block, its MoE weights drawn N(0, 1/fan_in) from `generator`."""
    import torch

    model = micro().model
    block = block_config().build(d_model=model.d_model, block_idx=1, n_layers=model.n_layers)
    params = dict(block.named_parameters())
    with torch.no_grad():
        for name in MOE_PARAMS:
            p, axis = params[name], FAN_IN_AXIS[name]
            fan_in = model.d_model if axis is None else p.shape[axis]
            p.copy_(torch.randn(p.shape, generator=generator) / fan_in**0.5)
    return block


class MoECut:
    """Hooks that cut the MoE out of a block: its input becomes a leaf `m`, its output (the input
    of `feed_forward_norm`) and the router's weighted aux loss are kept."""

    def __init__(self, block):
        self.m, self.out, self.aux = None, None, None
        block.feed_forward_input_norm.register_forward_hook(self._leaf)
        block.feed_forward_norm.register_forward_pre_hook(self._output)
        router = block.routed_experts_router
        compute_aux_loss = router.compute_aux_loss

        def keep_aux(*args, **kwargs):
            self.aux = compute_aux_loss(*args, **kwargs)
            return self.aux

        router.compute_aux_loss = keep_aux

    def _leaf(self, module, args, output):
        self.m = output.detach().requires_grad_(True)
        return self.m

    def _output(self, module, args):
        self.out = args[0]


def export() -> list[GoldenFile]:
    import olmo_core.ops.moe as ops
    import torch

    install_moe()
    model = micro().model
    torch.manual_seed(SEED)  # the attention's default init
    generator = torch.Generator().manual_seed(SEED)
    block = build_block(generator)
    cut, recorder = MoECut(block), PoolRecorder(block.routed_experts_router)
    x = torch.randn(*X_SHAPE, generator=generator)
    ids = torch.from_numpy(input_ids(model.eos_token_id))
    segment_ids = ops.segment_ids_from_eos(ids, model.eos_token_id)
    block.train()
    torch.manual_seed(DRAW_SEED)
    block(x, segment_ids=segment_ids, loss_div_factor=float(LOSS_DIV_FACTOR))
    router = block.routed_experts_router
    cotangent = token_mean_cotangent(cut.out.shape, generator)
    params = dict(block.named_parameters())
    objective = (cut.out * cotangent).sum() + cut.aux
    grads = torch.autograd.grad(objective, [cut.m, *(params[n] for n in MOE_PARAMS)])
    tensors = {
        "m": cut.m,
        "input_ids": ids,
        "segment_ids": segment_ids,
        **{f"param.{n}": params[n] for n in MOE_PARAMS},
        "train.pool_draws": recorder.draws(0, segment_ids.shape),
        "train.counts": router.batch_size_per_expert,
        "train.lb_loss": router.load_balancing_loss,
        "train.z_loss": router.z_loss,
        "train.out": cut.out,
        "train.cotangent": cotangent,
    }
    block.eval()
    with torch.no_grad():
        block(x, segment_ids=segment_ids)
    tensors["eval.out"] = cut.out
    grad_tensors = dict(zip(["m", *MOE_PARAMS], grads, strict=True))
    common = {
        "producer": "olmo_core.nn.ddp.block.OLMoDDPTransformerBlock "
        "(no_ep.combined_forward_no_ep); MoE input and output cut out with hooks",
        "seeds": {"torch": SEED, "torch_global_before_train_forward": DRAW_SEED},
        "config": {
            "block": block_config().as_dict(json_safe=True),
            "d_model": model.d_model,
            "x_shape": list(X_SHAPE),
            "lb_loss_weight": LB_WEIGHT,
            "z_loss_weight": Z_WEIGHT,
            "loss_div_factor": LOSS_DIV_FACTOR,
            "weights": "MoE weights N(0, 1/fan_in); the rest OLMo-core's init under the seed",
        },
        "tolerances": {
            "forward": MOE_FORWARD.as_dict(),
            "grad": FP32_GRAD.as_dict(),
            "regenerate": REGENERATE_COMPONENT.as_dict(),
        },
        "substitutions": [*MOE_SUBSTITUTIONS, ATTENTION_BACKEND, NO_EXPERT_PARALLELISM],
    }
    return [
        GoldenFile(path="moe.safetensors", tensors=to_numpy(tensors), **common),
        GoldenFile(path="moe_grads.safetensors", tensors=to_numpy(grad_tensors), **common),
    ]
