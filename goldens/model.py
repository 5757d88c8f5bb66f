"""Goldens of the whole micro model from OLMo-core's own `OLMoDDPModel` (goldens.olmo_core_model,
fp32, CPU stand-ins), on one batch of 2 rows of 256 tokens of the corpus (sonnets) with EOS put in
at fixed places, so that each row holds several documents (a leading EOS, adjacent EOS, a row
ending inside a document).

Weights: OLMo-core's own, trained: the micro model after the 50 steps of the golden training trace
(`trace/params_step50.safetensors`, OLMo-core's Trainer from its init), read through the store.

- `model_train.safetensors`: input ids, labels (OLMo-core's `get_labels`: shifted, last -100),
  the recorded EMO pool draws [7 MoE layers, B, T] (each router's `torch.randint` tensor, replayed
  from the RNG state a pre-hook saw), the logits, CE and z-loss (sum / D, D = labelled tokens, z
  weight 1e-5), and per MoE layer the unweighted LB and router z-losses (divided by D) and expert
  counts, in training mode with global load balancing (a gloo group of world size 1, no-op at
  that size, `set_load_balancing_process_group`).
- `model_grads_<n>.safetensors`: the gradients of OLMo-core's training objective (its loss
  CE + z-loss, plus the router losses it attaches to the graph: 0.01 LB + 1e-5 router z per
  layer, summed over layers) w.r.t. every parameter; file 0 holds the embeddings, LM head and
  block 0, file n block n (each under 1 MB).
- `model_eval.safetensors`: the logits in evaluation mode (every document has the eval pool).
"""

from __future__ import annotations

import numpy as np

from goldens.cpu_standins import MOE_SUBSTITUTIONS, SUBSTITUTIONS
from goldens.router import PoolRecorder
from goldens.store import GoldenFile, load_golden
from goldens.tolerances import (
    MODEL_GRAD_FLOOR,
    MODEL_GRAD_OF_NORM,
    MODEL_LOGITS,
    MODEL_LOSS,
    REGENERATE_RTOL,
)
from goldens.torch_layers import to_numpy
from model.config import micro

DRAW_SEED = 8009
ROWS, T = 2, 256
ROW_STARTS = (1000, 20000)
"""Offsets of the two rows in goldens/data/tokens/sonnets.npy."""
EOS_POSITIONS = ((0, 50, 51, 130, 200), (77, 160))
LB_WEIGHT, ROUTER_Z_WEIGHT, Z_LOSS_WEIGHT = 0.01, 1e-5, 1e-5
IGNORE_INDEX = -100
STANDINS = SUBSTITUTIONS + MOE_SUBSTITUTIONS


WEIGHTS = "trace/params_step50.safetensors"
"""The golden the whole-model and block goldens take their weights from."""


def weights() -> dict[str, np.ndarray]:
    """OLMo-core state dict of the trained micro model (the trace's last snapshot)."""
    return load_golden(WEIGHTS).tensors


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


def prepared_model():
    """OLMo-core's micro model with the trace's trained weights and the load-balancing group, in
    training mode."""
    import torch

    from goldens.olmo_core_model import build

    model = build(micro().model, lb_loss_weight=LB_WEIGHT, router_z_loss_weight=ROUTER_Z_WEIGHT)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights().items()})
    _load_balancing_group(model)
    return model.train()


def export() -> list[GoldenFile]:
    import torch

    from goldens.olmo_core_model import model_config

    cfg = micro().model
    model = prepared_model()
    routers = [b.routed_experts_router for b in model.routed_blocks()]
    recorders = [PoolRecorder(r) for r in routers]
    ids_np, labels_np = batch()
    ids, labels = torch.from_numpy(ids_np), torch.from_numpy(labels_np)
    div = float((labels_np != IGNORE_INDEX).sum())

    torch.manual_seed(DRAW_SEED)
    out = model(
        ids,
        labels=labels,
        z_loss_multiplier=Z_LOSS_WEIGHT,
        loss_reduction="sum",
        loss_div_factor=div,
        return_logits=True,
    )
    out.loss.backward()
    train = {
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
    grads = [{} for _ in range(cfg.n_layers)]
    for name, p in model.named_parameters():
        block = int(name.split(".")[1]) if name.startswith("blocks.") else 0
        grads[block][f"grad.{name}"] = p.grad
    model.eval()
    with torch.no_grad():
        eval_logits = model(ids)

    common = {
        "producer": "olmo_core.nn.ddp.model.OLMoDDPModel (goldens.olmo_core_model.build)",
        "seeds": {"torch_global_before_train_forward": DRAW_SEED},
        "config": {
            "model": "the OLMoDDPModelConfig in the entry of model_train.safetensors",
            "row_starts": list(ROW_STARTS),
            "eos_positions": [list(p) for p in EOS_POSITIONS],
            "loss_div_factor": div,
            "lb_loss_weight": LB_WEIGHT,
            "router_z_loss_weight": ROUTER_Z_WEIGHT,
            "z_loss_weight": Z_LOSS_WEIGHT,
            "weights": WEIGHTS,
            "process_group": "gloo world size 1 (HashStore) for global load balancing",
        },
        "tolerances": {
            "logits": MODEL_LOGITS.as_dict(),
            "loss": MODEL_LOSS.as_dict(),
            "grad_of_norm": MODEL_GRAD_OF_NORM,
            "grad_floor": MODEL_GRAD_FLOOR,
            "regenerate_rtol": REGENERATE_RTOL,
        },
        "substitutions": STANDINS,
    }
    train_config = {**common["config"], "model": model_config(cfg).as_dict(json_safe=True)}
    files = [
        GoldenFile(
            path="model_train.safetensors",
            tensors=to_numpy(train),
            **{**common, "config": train_config},
        )
    ]
    files += [
        GoldenFile(path=f"model_grads_{n}.safetensors", tensors=to_numpy(g), **common)
        for n, g in enumerate(grads)
    ]
    files.append(
        GoldenFile(
            path="model_eval.safetensors", tensors=to_numpy({"logits": eval_logits}), **common
        )
    )
    return files
