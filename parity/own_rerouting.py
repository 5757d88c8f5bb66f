"""`python -m parity.own_rerouting`: how often OLMo-core reroutes a token slot against itself, on
rounding alone, the rate lockstep's limit on rerouted steps is measured against
(goldens.tolerances.LOCKSTEP_REROUTED_STEPS).

OLMo-core trains as the golden trace did (`goldens.trace.fit`). Before each step a callback runs
that step's batch once more, from the same state and EMO draws, as OLMo-core's own dry run
(`train_batch(dry_run=True)`: forward and backward, no optimizer step, nothing logged) with every
weight moved by one ulp (`goldens.trace.perturb_one_ulp`, seeded by the step), then puts the
weights, the gradients and the RNG back. A MoE layer whose expert counts differ between that twin
and the step itself rerouted token slots (`parity.lockstep_check.tokens_rerouted`), as lockstep's
JAX side does against OLMo-core when its rounding differs. The training itself is the trace's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from goldens.export import make_torch_deterministic
from goldens.tolerances import LOCKSTEP_REROUTED_WINDOW
from goldens.trace import fit, perturb_one_ulp, train_module, use_free_port
from goldens.train_state import optimizer_state, unwrapped
from parity.lockstep import record_expert_counts
from parity.lockstep_check import tokens_rerouted
from parity.trace import GoldenTrace, load_trace


@dataclass(frozen=True)
class OwnRerouting:
    """One step: the token slots each MoE layer sent elsewhere in the one-ulp twin."""

    step: int
    slots: list[int]


def own_rerouting(
    trace: GoldenTrace, steps: int, on_step: Callable[[OwnRerouting], None]
) -> dict[str, np.ndarray]:
    """Train OLMo-core as the trace did for `steps` steps, each with its one-ulp twin; its
    optimizer's state after the last (goldens.train_state)."""
    import torch
    from olmo_core.train.callbacks import Callback

    make_torch_deterministic()
    use_free_port()
    cfg = trace.config
    module = train_module(cfg)
    model = unwrapped(module)
    counts: list[np.ndarray] = []
    ga = cfg.train.ga_steps

    def summed() -> np.ndarray:
        """[MoE layers, E] over the step's micro-batches."""
        return np.stack(counts).reshape(ga, -1, counts[0].shape[-1]).sum(0)

    class Twin(Callback):
        def pre_train(self):
            record_expert_counts(model, counts.append)

        def pre_step(self, batch):
            rng = torch.get_rng_state()
            weights = [p.detach().clone() for p in module.model.parameters()]
            perturb_one_ulp(module.model, self.step)
            counts.clear()
            module.train_batch(batch, dry_run=True)
            self.twin = summed()
            module.zero_grads()
            with torch.no_grad():
                for param, saved in zip(module.model.parameters(), weights, strict=True):
                    param.copy_(saved)
            torch.set_rng_state(rng)
            counts.clear()

        def post_step(self):
            on_step(OwnRerouting(self.step, tokens_rerouted(self.twin, summed())))

    with tempfile.TemporaryDirectory(prefix="own-rerouting-") as tmp:
        fit(cfg, module, Path(tmp), steps=steps, callbacks={"twin": Twin()})
    return optimizer_state(module)


def busiest_window(rerouted: Sequence[int], window: int = LOCKSTEP_REROUTED_WINDOW) -> int:
    """The most of the steps `rerouted` that any `window` steps in a row hold."""
    return max((sum(s <= r < s + window for r in rerouted) for s in rerouted), default=0)


def parser(prog: str = "python -m parity.own_rerouting") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the data's epoch")
    parser.add_argument("--out", type=Path, default=None, help="JSON record of every step")
    return parser


def run(args: argparse.Namespace) -> int:
    trace = load_trace()
    steps = trace.data.num_batches if args.steps is None else args.steps
    if not 1 <= steps <= trace.data.num_batches:
        raise SystemExit(f"--steps must lie in 1..{trace.data.num_batches}, got {steps}")
    records: list[OwnRerouting] = []

    def on_step(record: OwnRerouting) -> None:
        records.append(record)
        if any(record.slots):
            print(f"step {record.step}: slots rerouted per MoE layer {record.slots}", flush=True)

    own_rerouting(trace, steps, on_step)
    rerouted = [r.step for r in records if any(r.slots)]
    print(
        f"OLMo-core against its one-ulp twin: {len(rerouted)} of {steps} steps rerouted a token "
        f"slot; at most {busiest_window(rerouted)} in any {LOCKSTEP_REROUTED_WINDOW} steps"
    )
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in records], indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
