"""Golden of OLMo-core's EMO router `EmoRouterV2` (olmo_core/nn/moe/v2/emo_router.py), built by
`MoERouterConfigV2(..., emo=EmoRouterConfig(...))` with the micro config's MoE (16 experts, top-2,
L1-normalised weights times top_k, pools 2..16), fp32. No stand-in: the router is plain torch.

`router.safetensors`: router input x [2, 128, 64] (unit scale, as after the feed-forward input
norm), input ids with EOS at fixed positions (a leading EOS, adjacent EOS, a trailing document
without EOS) and OLMo-core's segment ids of them, the router weight (N(0, 1/d_model)).
- `train.*`: training mode, with the per-document pool draws recorded (OLMo-core's `torch.randint`
  tensor, replayed from the RNG state a forward pre-hook saved) and the per-token pools it used,
  the document scores (OLMo-core's `doc_sum_scatter` of the router probabilities), chosen experts,
  weights, expert counts, the unscaled load-balancing and router z-losses (OLMo-core's
  `load_balancing_loss`, `router_z_loss` with `loss_div_factor` B*(T-1), as its trainer passes),
  and the gradients with respect to x and the router weight of sum(weights * cotangent), of the
  LB loss and of the z-loss, each alone.
- `eval.*`: evaluation mode with an eval pool of 4 (the micro config's is 16, all experts, which
  would mask nothing): chosen experts and weights.
- `ties.*`: OLMo-core's `pool_keep_mask` on document scores with many exact ties (small integers).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from goldens.corpus import BYTE_VOCAB
from goldens.runtime.models import router_config
from goldens.runtime.recorders import PoolRecorder
from goldens.runtime.torch_layers import to_numpy, token_mean_cotangent
from goldens.store import GoldenFile
from goldens.tolerances import FP32_FORWARD, FP32_GRAD, REGENERATE_COMPONENT
from model.config import MoEConfig, micro

SEED = 6006
DRAW_SEED = 6007
X_SHAPE = (2, 128, micro().model.d_model)
"""[B, T, d_model] of the router input; goldens.moe takes the same shape and input ids."""
EOS_POSITIONS = ((0, 9, 10, 40, 41, 42, 77, 127), (60, 100))
"""EOS per row: row 0 has one-token documents (leading, adjacent EOS) and ends with an EOS; row 1
ends inside a document."""
EVAL_POOL = 4
LOSS_DIV_FACTOR = X_SHAPE[0] * (X_SHAPE[1] - 1)
"""OLMo-core's trainer divides by the labelled tokens: every row's last label is masked."""
TIES_SHAPE = (2, 8, 16)


def moe_config() -> MoEConfig:
    """The micro config's MoE with the eval pool of the `eval.*` case."""
    moe = micro().model.moe
    return dataclasses.replace(moe, emo=dataclasses.replace(moe.emo, eval_pool=EVAL_POOL))


def input_ids(eos_token_id: int) -> np.ndarray:
    """[B, T] byte ids (no EOS) with EOS at `EOS_POSITIONS`."""
    B, T, _ = X_SHAPE
    ids = np.random.Generator(np.random.PCG64(SEED)).integers(0, BYTE_VOCAB, (B, T), dtype=np.int64)
    for row, positions in enumerate(EOS_POSITIONS):
        ids[row, list(positions)] = eos_token_id
    return ids


def _train_case(router, x, segment_ids, generator) -> dict:
    import olmo_core.ops.moe as ops
    import torch
    from olmo_core.nn.moe.loss import (
        MoELoadBalancingLossGranularity,
        load_balancing_loss,
        router_z_loss,
    )

    recorder = PoolRecorder(router)
    router.train()
    torch.manual_seed(DRAW_SEED)
    weights, indices, counts, aux = router(
        x, False, loss_div_factor=float(LOSS_DIV_FACTOR), segment_ids=segment_ids
    )
    scores, logits, counts, batched_counts, _ = aux
    draws = recorder.draws(0, segment_ids.shape)
    if not torch.equal(draws.gather(1, segment_ids), recorder.pools[0]):
        raise RuntimeError("replayed EMO draws differ from the pools the router used")
    lb = load_balancing_loss(
        num_experts=router.num_experts,
        top_k=router.top_k,
        expert_scores=scores,
        batch_size_per_expert=counts,
        batched_batch_size_per_expert=batched_counts,
        granularity=MoELoadBalancingLossGranularity.local_batch,
        loss_div_factor=float(LOSS_DIV_FACTOR),
    )
    z = router_z_loss(expert_logits=logits, loss_div_factor=float(LOSS_DIV_FACTOR))
    aux_loss = router.compute_aux_loss(*aux)
    if not torch.equal(aux_loss, router.lb_loss_weight * lb + router.z_loss_weight * z):
        raise RuntimeError("the router's own aux loss differs from its LB and z-loss functions")
    cotangent = token_mean_cotangent(weights.shape, generator)
    tensors = {
        "pool_draws": draws,
        "pools": recorder.pools[0],
        "document_scores": ops.doc_sum_scatter(scores, segment_ids),
        "indices": indices,
        "weights": weights,
        "counts": counts,
        "lb_loss": lb,
        "z_loss": z,
        "cotangent": cotangent,
    }
    for name, objective in (("weights", (weights * cotangent).sum()), ("lb", lb), ("z", z)):
        grad_x, grad_w = torch.autograd.grad(objective, [x, router.weight], retain_graph=True)
        tensors.update({f"grad.{name}.x": grad_x, f"grad.{name}.weight": grad_w})
    return tensors


def export() -> list[GoldenFile]:
    import olmo_core.ops.moe as ops
    import torch

    model, train = micro().model, micro().train
    moe = moe_config()
    config = router_config(
        moe,
        X_SHAPE[-1],
        model.eos_token_id,
        lb_w=train.lb_loss_weight,
        z_w=train.router_z_loss_weight,
    )
    router = config.build()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        router.weight.copy_(
            torch.randn(router.weight.shape, generator=generator) / X_SHAPE[-1] ** 0.5
        )
    x = torch.randn(*X_SHAPE, generator=generator, requires_grad=True)
    ids = torch.from_numpy(input_ids(model.eos_token_id))
    segment_ids = ops.segment_ids_from_eos(ids, model.eos_token_id)
    tensors = {"x": x, "input_ids": ids, "segment_ids": segment_ids, "param.weight": router.weight}
    tensors.update(
        {f"train.{k}": v for k, v in _train_case(router, x, segment_ids, generator).items()}
    )
    router.eval()
    with torch.no_grad():
        weights, indices, _, _ = router(x, False, segment_ids=segment_ids)
    tensors.update({"eval.weights": weights, "eval.indices": indices})
    tied = torch.randint(0, 3, TIES_SHAPE, generator=generator).float()
    pools = torch.randint(
        moe.emo.min_pool, moe.emo.max_pool + 1, TIES_SHAPE[:2], generator=generator
    )
    tensors.update(
        {
            "ties.document_scores": tied,
            "ties.pools": pools,
            "ties.keep": ops.pool_keep_mask(tied, pools),
        }
    )
    return [
        GoldenFile(
            path="router.safetensors",
            tensors=to_numpy(tensors),
            producer="olmo_core.nn.moe.v2.emo_router.EmoRouterV2; olmo_core.nn.moe.loss "
            "load_balancing_loss, router_z_loss; olmo_core.ops.moe doc_sum_scatter, "
            "pool_keep_mask, segment_ids_from_eos",
            seeds={"torch": SEED, "torch_global_before_train_forward": DRAW_SEED},
            config={
                "router": config.as_dict(json_safe=True),
                "x_shape": list(X_SHAPE),
                "eos_positions": [list(p) for p in EOS_POSITIONS],
                "loss_div_factor": LOSS_DIV_FACTOR,
                "weights": "router weight N(0, 1/d_model); x N(0, 1)",
            },
            tolerances={
                "forward": FP32_FORWARD.as_dict(),
                "grad": FP32_GRAD.as_dict(),
                "regenerate": REGENERATE_COMPONENT.as_dict(),
            },
        )
    ]
