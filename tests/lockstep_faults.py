"""The faults the lockstep tests inject into the JAX side (`parity.faults`), each with the step and
the kind of gap lockstep must name. Each is below the free-running tolerance at its step."""

from dataclasses import dataclass

from model.config import TrainConfig
from parity.faults import InjectedFault

ROUTER = "blocks.3.routed_experts_router.weight"
"""The MoE layer whose router gradient the router fault scales (OLMo-core block 3)."""


@dataclass(frozen=True)
class Expected:
    fault: InjectedFault
    kinds: frozenset[str]
    """What lockstep may name as farthest over at the fault's first step."""
    name: str | None
    """The metric or tensor it must name (None: any tensor of those kinds)."""


FAULTS = {
    "lb_weight_1.01x_from_7": Expected(
        InjectedFault(7, train=(("lb_loss_weight", TrainConfig.lb_loss_weight * 1.01),)),
        frozenset({"metric", "layer"}),
        "lb_loss",
    ),
    "beta2_0.96_from_12": Expected(
        InjectedFault(12, train=(("betas", (0.9, 0.96)),)),
        frozenset({"optimizer_update", "exp_avg_sq"}),
        None,
    ),
    "router_grad_1.01x_at_3": Expected(
        InjectedFault(3, 3, grad_scale=(ROUTER, 1.01)), frozenset({"grad"}), ROUTER
    ),
    "embedding_decay_from_20": Expected(
        InjectedFault(20, train=(("embedding_weight_decay", TrainConfig.weight_decay),)),
        frozenset({"optimizer_update"}),
        "embeddings.weight",
    ),
}
