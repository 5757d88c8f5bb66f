"""What each step of `parity.train` trains on: OLMo-core's global batches, epoch after epoch, and
the EMO pool draws of its routers.

Step s (from 1) trains on global batch s - 1 of the run, as OLMo-core's trainer walks its loader:
epoch e = (s - 1) // B + 1 and batch (s - 1) % B of it (B batches an epoch). Epoch 1 follows the
global-indices file given (or, without one, OLMo-core's own order for `TrainConfig.data_seed`);
each later epoch is shuffled as OLMo-core's loader shuffles it (`model.data.olmo_core_order`).

EMO draws: where the run trains on the golden trace's data in its shapes, the steps the trace
recorded take OLMo-core's own draws, so that the micro config trains exactly as free-running
replays it; every other step draws from the run's key, `fold_in(key, s)`, which a resumed run
draws again identically.

Synthetic data (`TrainData.synthetic`): random ids below the EOS with an EOS every `DOCUMENT`
tokens, seeded by the step, for a config whose rows the bundled corpus cannot fill.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from model.config import Config
from model.data import OlmoData, olmo_labels, shift_to_inputs_targets
from model.router import draw_pools
from parity.trace import GoldenTrace

DOCUMENT = 1024
"""Tokens a synthetic document: an EOS closes each."""


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """OLMo-core's token files and, optionally, the global-indices file of their first epoch
    (None: OLMo-core's order for the run's data seed)."""

    tokens: tuple[Path, ...]
    global_indices: Path | None
    dtype: str | None = None
    """The token files' dtype (None: OLMo-core's for the vocab)."""

    def identity(self) -> dict:
        """Names and sizes of the files, as a checkpoint records them."""
        files = [*self.tokens, *([self.global_indices] if self.global_indices else [])]
        return {
            "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files],
            "global_indices": None if self.global_indices is None else self.global_indices.name,
            "dtype": self.dtype,
        }


class TrainData:
    """The micro-batches of each step: `batch(step)` -> the arrays `model.objective` takes,
    [GA, b, T] each and "pool_draws" [GA, b, MoE layers, T]."""

    def __init__(
        self,
        cfg: Config,
        files: DataFiles | None,
        *,
        key: jax.Array,
        trace: GoldenTrace | None = None,
    ):
        """`files` None: synthetic data. `trace`: the golden trace whose recorded draws the
        steps it recorded take (only pass it when `files` are its data in its shapes)."""
        self.cfg, self.files, self.key, self._trace = cfg, files, key, trace
        self._epochs: dict[int, OlmoData] = {}
        if files is not None:
            train = cfg.train
            self._epochs[1] = OlmoData(
                files.tokens,
                files.global_indices,
                seq_len=train.seq_len,
                instances_per_batch=train.global_batch_size,
                vocab_size=cfg.model.vocab_size,
                dtype=files.dtype,
                seed=train.data_seed,
            )
            if self._epochs[1].num_batches == 0:
                raise SystemExit(
                    f"the token files make {self._epochs[1].num_instances} instances of "
                    f"{train.seq_len} tokens, fewer than one global batch of "
                    f"{train.global_batch_size}: use more data, or --synthetic"
                )

    @property
    def batches_per_epoch(self) -> int | None:
        return None if self.files is None else self._epochs[1].num_batches

    def position(self, step: int) -> tuple[int, int]:
        """(epoch from 1, batch in it from 0) of step `step` (from 1)."""
        per_epoch = self.batches_per_epoch
        if per_epoch is None:
            return 1, step - 1
        return (step - 1) // per_epoch + 1, (step - 1) % per_epoch

    def _epoch(self, epoch: int) -> OlmoData:
        if epoch not in self._epochs:
            self._epochs = {1: self._epochs[1]}  # one later epoch held at a time
            seed = self.cfg.train.data_seed
            self._epochs[epoch] = self._epochs[1].reshuffled(seed=seed, epoch=epoch)
        return self._epochs[epoch]

    def draws_source(self, step: int) -> str:
        """Where step `step`'s EMO draws come from: "olmo-core" (the trace's) or "key"."""
        recorded = self._trace is not None and step <= self._trace.steps
        return "olmo-core" if recorded else "key"

    def batch(self, step: int) -> dict[str, np.ndarray]:
        train, flags = self.cfg.train, self.cfg.flags
        if self.files is None:
            batch = synthetic_micro_batches(self.cfg, step)
        else:
            epoch, index = self.position(step)
            batch = self._epoch(epoch).micro_batches(
                index, ga_steps=train.ga_steps, segment_ids_from_eos=flags.olmo_segment_ids_from_eos
            )
        if self.cfg.model.moe.emo is not None:
            if self.draws_source(step) == "olmo-core":
                draws = self._trace.pool_draws(step)
            else:
                draws = key_draws(self.key, step, self.cfg)
            batch["pool_draws"] = draws
        return batch


def key_draws(key: jax.Array, step: int, cfg: Config) -> np.ndarray:
    """Step `step`'s EMO pool draws from the run's key: [GA, b, MoE layers, T] int32."""
    train, n_moe = cfg.train, len(cfg.model.moe_layers)
    shape = (train.ga_steps, train.micro_batch_size, n_moe, train.seq_len)
    rows = (int(np.prod(shape[:-1])), shape[-1])
    pools = draw_pools(jax.random.fold_in(key, step), rows, emo=cfg.model.moe.emo)
    return np.asarray(pools).reshape(shape)


def synthetic_micro_batches(cfg: Config, step: int) -> dict[str, np.ndarray]:
    """Random ids below the EOS, an EOS every `DOCUMENT` tokens, seeded by (data seed, step):
    [GA, b, T] each, as `OlmoData.micro_batches` gives them."""
    m, train = cfg.model, cfg.train
    rng = np.random.default_rng([train.data_seed, step])
    shape = (train.ga_steps, train.micro_batch_size, train.seq_len + 1)
    tokens = rng.integers(0, m.eos_token_id, shape, dtype=np.int32)
    tokens[..., DOCUMENT - 1 :: DOCUMENT] = m.eos_token_id
    batch = shift_to_inputs_targets(
        tokens, segment_ids_from_eos=cfg.flags.olmo_segment_ids_from_eos
    )
    batch["labels"] = olmo_labels(batch["targets"], batch["targets_segmentation"])
    return batch
