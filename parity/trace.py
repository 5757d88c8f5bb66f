"""The golden training trace a replay is held to (goldens/trace/, written by `goldens.trace`):
OLMo-core's metrics at every step, its EMO pool draws, its data order, its parameter snapshots,
and the same run from one-ulp-perturbed step-0 weights (how far fp32 training reproduces itself).

Step s (from 1, as OLMo-core's trainer counts) trains on global batch s - 1 of the golden data
order and its routers use the draws recorded at step s. Everything is read through
`goldens.store.load_golden`, which checks sha256, versions and tensor lists first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from goldens.store import load_golden, read_manifest, resolve
from model.config import Config, Flags, micro, olmo_core
from model.data import OlmoData

SNAPSHOT = "trace/params_step{}.safetensors"
STATE = "trace/state_step{}.safetensors"


@dataclass(frozen=True)
class GoldenTrace:
    metrics: dict[str, np.ndarray]
    """`model.train_step.METRICS` and "skipped" [steps]; "<name>_per_block" of each
    `model.train_step.AUX_TERMS` [steps, MoE blocks]; "pool_draws"
    [steps, GA, MoE layers, b, documents]."""
    perturbed: dict[str, np.ndarray]
    """The same metrics of the perturbed runs [runs, ...]; "params_rel_diff_step<s>" [runs, params]
    (in `param_names` order)."""
    param_names: tuple[str, ...]
    moe_blocks: tuple[int, ...]
    """OLMo-core block index of each MoE layer."""
    snapshot_steps: tuple[int, ...]
    state_steps: tuple[int, ...]
    """The steps after which the trace keeps OLMo-core's whole training state (`state`)."""
    data: OlmoData
    config: Config
    """The run's config: micro, every flag at OLMo-core's, the golden global-indices file."""

    @property
    def steps(self) -> int:
        return len(self.metrics["ce"])

    @property
    def starts(self) -> tuple[int, ...]:
        """The steps lockstep can start at: 1, and each one after a saved training state."""
        return (1, *(step + 1 for step in self.state_steps))

    def params(self, step: int) -> dict[str, np.ndarray]:
        """OLMo-core's state dict after `step` steps (one of `snapshot_steps`)."""
        if step not in self.snapshot_steps:
            raise ValueError(f"the trace saved params at steps {self.snapshot_steps}, not {step}")
        return load_golden(SNAPSHOT.format(step)).tensors

    def state(self, step: int) -> dict[str, np.ndarray]:
        """OLMo-core's training state after `step` steps (one of `state_steps`), as
        `goldens.train_state.optimizer_state` gives it."""
        if step not in self.state_steps:
            raise ValueError(f"the trace saved states after steps {self.state_steps}, not {step}")
        return load_golden(STATE.format(step)).tensors

    def micro_batches(self, step: int, flags: Flags) -> dict[str, np.ndarray]:
        """The micro-batches of `step` (from 1) for `model.objective`: rows of `OlmoData`
        ([GA, b, T]; segment ids from EOS only with `flags.olmo_segment_ids_from_eos`) and
        OLMo-core's draws as "pool_draws" [GA, b, MoE layers, T]."""
        if not 1 <= step <= self.steps:
            raise ValueError(f"the trace has steps 1..{self.steps}, not {step}")
        train = self.config.train
        batch = self.data.micro_batches(
            step - 1, ga_steps=train.ga_steps, segment_ids_from_eos=flags.olmo_segment_ids_from_eos
        )
        batch["pool_draws"] = self.pool_draws(step)
        return batch

    def pool_draws(self, step: int) -> np.ndarray:
        """OLMo-core's EMO draws of `step` (from 1): [GA, b, MoE layers, T] int32."""
        if not 1 <= step <= self.steps:
            raise ValueError(f"the trace has steps 1..{self.steps}, not {step}")
        draws = self.metrics["pool_draws"][step - 1].astype(np.int32)  # [GA, L, b, documents]
        pad = self.config.train.seq_len - draws.shape[-1]  # columns past the last document
        draws = np.pad(draws, [(0, 0)] * 3 + [(0, pad)], mode="edge")  # are never read
        return draws.transpose(0, 2, 1, 3)


def bundled_data() -> tuple[list[Path], Path]:
    """The bundled corpus OLMo-core's trace trained on: its token files (uint16, the micro
    config's byte-level vocab) and the global-indices file of its first epoch at seq 256, each
    checked against the manifest."""
    order = load_golden("data/order.safetensors").entry["config"]
    for path in [*order["token_files"], order["global_indices_file"]]:
        load_golden(path)
    return [resolve(p) for p in order["token_files"]], resolve(order["global_indices_file"])


@functools.cache
def load_trace() -> GoldenTrace:
    """The bundled golden trace and its data, checked against the manifest."""
    golden = load_golden("trace/metrics.safetensors")
    perturbed = load_golden("trace/perturbed.safetensors")
    token_files, indices = bundled_data()
    config = olmo_core(micro(), global_indices_path=str(indices))
    made_for = golden.entry["config"]["config"]
    for part in ("model", "train"):
        if made_for[part] != config.as_dict()[part]:
            raise ValueError(
                f"goldens/trace/metrics.safetensors was made for another {part} config than "
                "model.config.micro(); regenerate it with `tox -e goldens -- trace`"
            )
    data = OlmoData.from_config(config, token_files)
    saved = read_manifest()["files"]
    steps = range(golden.entry["config"]["steps"] + 1)
    return GoldenTrace(
        metrics=golden.tensors,
        perturbed=perturbed.tensors,
        param_names=tuple(perturbed.entry["config"]["params"]),
        moe_blocks=tuple(golden.entry["config"]["moe_blocks"]),
        snapshot_steps=tuple(step for step in steps if SNAPSHOT.format(step) in saved),
        state_steps=tuple(step for step in steps if STATE.format(step) in saved),
        data=data,
        config=config,
    )
