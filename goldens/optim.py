"""Goldens of OLMo-core's LR schedulers and its `SkipStepAdamW` (olmo_core/optim), fp32.

- `optim.safetensors`:
  - `lr.<schedule>`: `get_lr(lr, current, t_max)` for current = 0..max_steps + 2 of
    `ConstantWithWarmup`, `CosWithWarmup`, `LinearWithWarmup` and `WSD`, with the micro config's
    lr, warmup and max_steps (alpha_f and decay_fraction 0.1).
  - `adamw.*`: three steps of `SkipStepAdamW` (micro recipe: betas 0.9/0.95, eps 1e-8, wd 0.1 and
    0 for `embeddings.weight`) on a small module, with given grads clipped at 1.0 by torch's
    `clip_grad_norm_` (step 1 is clipped) and the LR of `ConstantWithWarmup` at steps 1..3: the
    params before and after each step, the grads, the pre-clip grad norms and LRs.
  - `skip.*`: `get_step_factor()` over 80 recorded (loss, grad norm) pairs with a loss spike at
    step 70 and a grad-norm spike at step 75, the default window 128 and sigma 6.
"""

from __future__ import annotations

from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_COMPONENT
from model.config import micro

SEED = 6006
ADAMW_STEPS = 3
SKIP_STEPS, LOSS_SPIKE, GRAD_SPIKE = 80, 70, 75


def _schedulers(train):
    from olmo_core.optim import WSD, ConstantWithWarmup, CosWithWarmup, LinearWithWarmup

    w = train.warmup_steps
    return {
        "constant_with_warmup": ConstantWithWarmup(warmup=w),
        "cosine": CosWithWarmup(warmup=w, alpha_f=train.alpha_f),
        "linear": LinearWithWarmup(warmup=w, alpha_f=train.alpha_f),
        "wsd": WSD(warmup=w, decay_fraction=train.decay_fraction),
    }


def _module(generator):
    import torch

    module = torch.nn.Module()
    module.embeddings = torch.nn.Embedding(16, 8)
    module.w = torch.nn.Linear(8, 8, bias=False)
    module.norm = torch.nn.Parameter(torch.ones(8))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return module


def _adamw(train, generator) -> dict:
    import torch
    from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig

    module = _module(generator)
    optim = SkipStepAdamWConfig(
        lr=train.lr,
        betas=train.betas,
        eps=train.eps,
        weight_decay=train.weight_decay,
        group_overrides=[
            OptimGroupOverride(
                params=["embeddings.weight"], opts={"weight_decay": train.embedding_weight_decay}
            )
        ],
    ).build(module)
    scheduler = _schedulers(train)["constant_with_warmup"]
    names = [n for n, _ in module.named_parameters()]
    tensors = {f"adamw.param.0.{n}": p.detach().clone() for n, p in module.named_parameters()}
    norms, lrs = [], []
    for step in range(1, ADAMW_STEPS + 1):
        scale = 2.0 if step == 1 else 0.05  # only the first step's grads get clipped
        for n, p in module.named_parameters():
            p.grad = scale * torch.randn(p.shape, generator=generator)
            tensors[f"adamw.grad.{step}.{n}"] = p.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), train.max_grad_norm)
        for group in optim.param_groups:
            group["lr"] = scheduler.get_lr(group["initial_lr"], step, train.max_steps)
        optim.latest_loss = torch.tensor(3.0)
        optim.latest_grad_norm = norm
        optim.step()
        norms.append(float(norm))
        lrs.append(optim.param_groups[0]["lr"])
        tensors.update(
            {f"adamw.param.{step}.{n}": p.detach().clone() for n, p in module.named_parameters()}
        )
    tensors["adamw.grad_norm"] = torch.tensor(norms)
    tensors["adamw.lr"] = torch.tensor(lrs)
    return tensors, names


def _skip(train, generator) -> dict:
    import torch
    from olmo_core.optim import SkipStepAdamWConfig

    optim = SkipStepAdamWConfig(lr=train.lr).build(_module(generator))
    losses = 3.0 + 0.01 * torch.randn(SKIP_STEPS, generator=generator)
    norms = 1.0 + 0.05 * torch.randn(SKIP_STEPS, generator=generator)
    losses[LOSS_SPIKE] += 1.0
    norms[GRAD_SPIKE] *= 3.0
    factors = []
    for loss, norm in zip(losses, norms, strict=True):
        optim.latest_loss, optim.latest_grad_norm = loss, norm
        factors.append(optim.get_step_factor())
    return {"skip.loss": losses, "skip.grad_norm": norms, "skip.factor": torch.stack(factors)}


def export() -> list[GoldenFile]:
    import torch

    train = micro().train
    generator = torch.Generator().manual_seed(SEED)
    tensors = {
        f"lr.{name}": torch.tensor(
            [float(s.get_lr(train.lr, c, train.max_steps)) for c in range(train.max_steps + 3)],
            dtype=torch.float64,
        )
        for name, s in _schedulers(train).items()
    }
    adamw, names = _adamw(train, generator)
    tensors.update(adamw)
    tensors.update(_skip(train, generator))
    return [
        GoldenFile(
            path="optim.safetensors",
            tensors={k: v.numpy().copy() for k, v in tensors.items()},
            producer="olmo_core.optim schedulers (get_lr) and SkipStepAdamW",
            seeds={"torch": SEED},
            config={
                "train": train.as_dict(),
                "schedulers": {k: v.as_config_dict() for k, v in _schedulers(train).items()},
                "adamw": {"steps": ADAMW_STEPS, "params": names, "clip": "clip_grad_norm_"},
                "skip": {
                    "steps": SKIP_STEPS,
                    "loss_spike": LOSS_SPIKE,
                    "grad_norm_spike": GRAD_SPIKE,
                    "window": 128,
                    "sigma": 6,
                },
            },
            tolerances={"regenerate": REGENERATE_COMPONENT.as_dict()},
        )
    ]
