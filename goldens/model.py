"""OLMo-core's micro model on the goldens' batch, for the fp64 oracles (goldens.oracle): its own
`OLMoDDPModel` (goldens.runtime.models, CPU stand-ins) with the weights of a golden state dict, in
float32 or float64, on one batch of 2 rows of 256 tokens of the corpus (sonnets) with EOS put in at
fixed places, so that each row holds several documents (a leading EOS, adjacent EOS, a row ending
inside a document).

`train_forward` is OLMo-core's training objective (its loss CE + z-loss, sum / D over the D
labelled tokens, plus the router losses it attaches to the graph: LB + router z per MoE layer,
summed over layers; the micro recipe's weights, z 1e-5, LB 0.01, router z 1e-5) in training mode
with global load balancing (a gloo group of world size 1, no-op at that size,
`set_load_balancing_process_group`) and the EMO pool draws of `DRAW_SEED`, recorded per router
(`torch.randint` tensors replayed from the RNG state a pre-hook saw); `eval_logits` the evaluation
forward (every document has the eval pool).
"""

from __future__ import annotations

import numpy as np

from goldens.runtime.models import RUNTIME
from goldens.runtime.recorders import PoolRecorder
from goldens.runtime.standins import MOE_SUBSTITUTIONS, SUBSTITUTIONS
from goldens.store import load_golden
from model.config import micro
from model.data import IGNORE_INDEX

DRAW_SEED = 8009
ROWS, T = 2, 256
ROW_STARTS = (1000, 20000)
"""Offsets of the two rows in goldens/data/tokens/sonnets.npy."""
EOS_POSITIONS = ((0, 50, 51, 130, 200), (77, 160))
PROCESS_GROUP = (
    "torch.distributed: gloo group of world size 1 (HashStore) for global load balancing"
)
STANDINS = [*SUBSTITUTIONS, *MOE_SUBSTITUTIONS, *RUNTIME, PROCESS_GROUP]
"""Everything the whole-model runs differ from OLMo-core on a GPU by, for the manifests."""


WEIGHTS = "trace/params_step50.safetensors"
"""The default weights: OLMo-core's micro model after the golden trace's 50 steps."""


def batch() -> tuple[np.ndarray, np.ndarray]:
    """(input ids [ROWS, T], labels [ROWS, T]) from the corpus with EOS put in."""
    eos = micro().model.eos_token_id
    tokens = load_golden("data/tokens/sonnets.npy")["tokens"].astype(np.int64)
    ids = np.stack([tokens[s : s + T] for s in ROW_STARTS])
    for row, positions in enumerate(EOS_POSITIONS):
        ids[row, list(positions)] = eos
    labels = np.concatenate([ids[:, 1:], np.full((ROWS, 1), IGNORE_INDEX)], axis=1)
    return ids, labels


def _load_balancing_group(model) -> None:
    """Global load balancing outside a train module: a gloo group of world size 1."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for block in model.routed_blocks():
        block.routed_experts_router.set_load_balancing_process_group(dist.group.WORLD)


def prepared_model(weights_path: str = WEIGHTS, dtype=None):
    """OLMo-core's micro model with the weights of golden `weights_path` and the load-balancing
    group, in training mode, in `dtype` (float32 by default)."""
    import torch

    from goldens.runtime.models import build

    config = micro()
    model = build(
        config.model,
        lb_loss_weight=config.train.lb_loss_weight,
        router_z_loss_weight=config.train.router_z_loss_weight,
    )
    state = load_golden(weights_path).tensors
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    _load_balancing_group(model)
    return model.to(dtype or torch.float32).train()


def train_forward(model, ids, labels) -> dict:
    """OLMo-core's training objective on (ids, labels) [ROWS, T] with the draws of `DRAW_SEED`,
    backward included: the module's outputs (input ids, labels, pool draws [MoE layers, B, T],
    logits, CE, z-loss, per-layer LB, router z and counts) and "grad.<name>" of every parameter."""
    import torch

    routers = [b.routed_experts_router for b in model.routed_blocks()]
    recorders = [PoolRecorder(r) for r in routers]
    div = float((labels != IGNORE_INDEX).sum())
    torch.manual_seed(DRAW_SEED)
    out = model(
        ids,
        labels=labels,
        z_loss_multiplier=micro().train.z_loss_weight,
        loss_reduction="sum",
        loss_div_factor=div,
        return_logits=True,
    )
    out.loss.backward()
    tensors = {
        "input_ids": ids,
        "labels": labels,
        "pool_draws": torch.stack([r.draws(0, ids.shape) for r in recorders]),
        "logits": out.logits,
        "ce_loss": out.ce_loss,
        "z_loss": out.z_loss,
        "lb_loss": torch.stack([r.load_balancing_loss for r in routers]),
        "router_z_loss": torch.stack([r.z_loss for r in routers]),
        "counts": torch.stack([r.batch_size_per_expert for r in routers]),
    }
    return tensors | {f"grad.{name}": p.grad for name, p in model.named_parameters()}


def eval_logits(model, ids):
    """Logits [ROWS, T, V] in evaluation mode (every document keeps the eval pool)."""
    import torch

    model.eval()
    with torch.no_grad():
        return model(ids)
