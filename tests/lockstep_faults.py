"""The faults the lockstep tests inject into the JAX side (`parity.faults`), each with the step and
the kind of gap lockstep must name, and whether the free-running view misses it. The issue's four
were meant to lie below free-running's tolerance at their step; the LB weight 1% high from step 7
does not (free-running's LB tolerance there is 2.4e-3: the bar, or 70x OLMo-core's own spread),
so the same fault from step 10 (tolerance 3.4e-2) is the one free-running misses. The LR 0.1% high
is an update 0.1% off: the JAX optimizer alone, on OLMo-core's gradients, is 100x over its bound;
its LR is 0.1% from the trace's, free-running's bar itself. A top-k that breaks near-ties toward
the higher expert moves a few token slots at every step, each step within the rerouted bounds: it
is named at the step that makes one more rerouted step than a window allows."""

from dataclasses import dataclass
from fnmatch import fnmatch

from goldens.tolerances import LOCKSTEP_REROUTED_STEPS
from model.config import TrainConfig
from parity.faults import InjectedFault
from parity.lockstep_check import REROUTED_STEPS

ROUTER = "blocks.3.routed_experts_router.weight"
"""The MoE layer whose router gradient the router fault scales (OLMo-core block 3)."""
LB_WEIGHT_SEEN = (
    frozenset({"metric", "layer", "grad", "update", "step_exp_avg", "step_exp_avg_sq"}),
    ("lb_loss", "blocks.*.routed_experts_router.weight"),
)
"""Where a wrong LB loss weight shows: the LB loss itself, or the only tensors its gradient
reaches, the routers' (their gradient, the step's update and moments; the optimizer alone sees
OLMo-core's gradients). With each tensor against its own norm, a router's second moment (1.5%
off for a 1% weight) and the LB loss (1%) are about equally far over their bounds."""


@dataclass(frozen=True)
class Expected:
    fault: InjectedFault
    kinds: frozenset[str]
    """What lockstep may name as farthest over at the step it names (`step`)."""
    names: tuple[str, ...] | None
    """The metric or tensor it must name, as fnmatch patterns (None: any of those kinds)."""
    free_running_misses: bool | None = True
    """None: the fault sits at free-running's bar, where rounding decides (not asserted)."""
    at: int | None = None
    """The step lockstep must name it at (None: the fault's first)."""

    @property
    def step(self) -> int:
        return self.fault.first if self.at is None else self.at

    def names_it(self, name: str) -> bool:
        return self.names is None or any(fnmatch(name, p) for p in self.names)


FAULTS = {
    "lb_weight_1.01x_from_7": Expected(
        InjectedFault(7, train=(("lb_loss_weight", TrainConfig.lb_loss_weight * 1.01),)),
        *LB_WEIGHT_SEEN,
        free_running_misses=False,
    ),
    "lb_weight_1.01x_from_10": Expected(
        InjectedFault(10, train=(("lb_loss_weight", TrainConfig.lb_loss_weight * 1.01),)),
        *LB_WEIGHT_SEEN,
    ),
    "beta2_0.96_from_12": Expected(
        InjectedFault(12, train=(("betas", (0.9, 0.96)),)),
        frozenset({"optimizer_update", "exp_avg_sq"}),
        None,
    ),
    "router_grad_1.01x_at_3": Expected(
        InjectedFault(3, 3, grad_scale=(ROUTER, 1.01)), frozenset({"grad"}), (ROUTER,)
    ),
    "lr_1.001x_from_5": Expected(
        InjectedFault(5, train_scale=(("lr", 1.001),)),
        frozenset({"optimizer_update"}),
        None,
        free_running_misses=None,
    ),
    "near_tie_router_from_2": Expected(
        InjectedFault(2, near_tie_margin=1e-4),
        frozenset({"routing"}),
        (REROUTED_STEPS,),
        at=2 + LOCKSTEP_REROUTED_STEPS,
    ),
    "embedding_decay_from_20": Expected(
        InjectedFault(20, train=(("embedding_weight_decay", TrainConfig.weight_decay),)),
        frozenset({"optimizer_update"}),
        ("embeddings.weight",),
    ),
}
