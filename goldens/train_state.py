"""OLMo-core's whole training state between two steps, as arrays: what the trace keeps one step
before its later snapshots (`goldens.trace.STATE_STEPS`) and lockstep reads before every step.

`OLMoDDPOptimizer.states` holds, per parameter (names without DDP's "module."), a flat float32
"main" copy, which in fp32 training is a view of the model's own weight, Adam's "exp_avg" and
"exp_avg_sq", and its "step"; besides them the skip rule's history of losses and grad norms.
Step s reads nothing else but its batch and the RNG, which the trace reseeds before every step.
"""

from __future__ import annotations

import numpy as np

SUFFIXES = ("main", "exp_avg", "exp_avg_sq", "step")
"""`OLMoDDPOptimizer._state_suffixes_for_param`: its state per parameter."""
LOSSES, GRAD_NORMS = "skip_step.losses", "skip_step.grad_norms"
PREFIX = "module."
"""DDP's prefix of the optimizer's parameter names."""


def unwrapped(module):
    """The `Transformer` inside a train module's `OLMoDDPModel` (state-dict keys without
    "module.")."""
    return getattr(module.model, "module", module.model)


def _names(optim) -> list[str]:
    return [n for group in optim.param_groups for n in group["named_params"]]


def _local(state):
    return state.to_local() if hasattr(state, "to_local") else state


def optimizer_state(module) -> dict[str, np.ndarray]:
    """`module.optim`'s state: "<param>.<suffix>" [numel] for each suffix in SUFFIXES ("step"
    [1]: its DTensor is 0-d over gloo, [1] over the "threaded" group), and LOSSES and GRAD_NORMS
    [at most the skip window + 1], oldest first."""
    optim, out = module.optim, {}
    for name in _names(optim):
        for suffix in SUFFIXES:
            live = _local(optim.states[f"{name}.{suffix}"])
            out[f"{name.removeprefix(PREFIX)}.{suffix}"] = live.detach().numpy().reshape(-1).copy()
    out[LOSSES] = np.array([float(v) for v in optim._losses], np.float32)
    out[GRAD_NORMS] = np.array([float(v) for v in optim._grad_norms], np.float32)
    return out


def restore_optimizer_state(module, state: dict[str, np.ndarray]) -> None:
    """Write `state` (as `optimizer_state` gives it) into `module`'s optimizer and through each
    "main" view into the model's weights; the skip rule's history through OLMo-core's own
    `_restore_rolling_stats`."""
    import torch

    optim = module.optim
    names = {n.removeprefix(PREFIX): n for n in _names(optim)}
    expected = {f"{n}.{s}" for n in names for s in SUFFIXES} | {LOSSES, GRAD_NORMS}
    if set(state) != expected:
        differ = sorted(expected ^ set(state))
        raise ValueError(f"optimizer state keys differ from the model's: {differ[:4]}")
    with torch.no_grad():
        for name, live in names.items():
            for suffix in SUFFIXES:
                local = _local(optim.states[f"{live}.{suffix}"])
                local.copy_(torch.from_numpy(state[f"{name}.{suffix}"]).reshape(local.shape))
    weights = unwrapped(module).state_dict()
    for name in names:
        if not np.array_equal(weights[name].numpy().reshape(-1), state[f"{name}.main"]):
            raise RuntimeError(f"{name}: the optimizer's main copy is not the model's weight")
    optim._losses = optim._restore_rolling_stats(state[LOSSES].tolist())
    optim._grad_norms = optim._restore_rolling_stats(state[GRAD_NORMS].tolist())
