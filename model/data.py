"""OLMo-core's data order read from its own files, and the inputs/targets a train step takes.

OLMo-core 3.0.0 counterparts (olmo_core/data/):
- `NumpyFSLDataset` (numpy_dataset.py): a token file is a raw array with no header (uint16 for a
  vocab of at most 65536 ids, uint32 above); instance i is a window of S consecutive tokens of the
  files taken in order, the last `len(file) % S` tokens of each file dropped.
- `NumpyFSLDataLoader` (data_loader.py): the global-indices file is raw uint32 with no header, the
  instance ids 0..N-1 shuffled by `np.random.Generator(PCG64(seed + epoch))`, one file an epoch.
  Global batch k is the I instances `indices[k * I:(k + 1) * I]` (I = global batch tokens / S), the
  ids that do not fill a last batch are dropped. Data-parallel rank r of W takes entries r::W of a
  batch, and the train module cuts a rank's batch into micro-batches of consecutive rows. A loader
  resumes at batch `tokens_processed // global batch tokens` of its saved state.
- Each later epoch e (from 1) is shuffled by OLMo-core's loader itself, `np.arange(N, uint32)`
  shuffled in place by `np.random.Generator(PCG64(seed + e))` (`data/utils.py`), which
  `olmo_core_order` makes without the loader.
- `get_labels` (utils.py): labels are the input ids shifted left by one, the last label -100
  (`IGNORE_INDEX`); the loss is normalised by the count of labels that are not -100 over the
  whole batch (`batch_num_tokens_for_loss`).

Inputs and targets are MaxText's, held to OLMo-core's: a row of L + 1 tokens gives
`inputs = tokens[:-1]` and `targets = tokens[1:]`, every output of length L, and the last target is
never trained on (`targets_segmentation` 0). A row is an OLMo-core instance (S = L tokens, what its
model sees) followed by one lookahead token, so each instance trains on the same S - 1 targets as
OLMo-core's labels, and `olmo_labels` gives those labels exactly.

Not supported: OLMo-core's chunked order (`max_target_sequence_length`), label-mask files and
instance filters; none is used by the hero.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.config import Config

IGNORE_INDEX = -100
"""OLMo-core's `label_ignore_index`: a label the loss skips."""
INDICES_DTYPE = np.dtype("<u4")
"""The global-indices file: raw little-endian uint32."""
TOKEN_DTYPES = tuple(np.dtype(f"<u{n}") for n in (1, 2, 4, 8))
LOOKAHEAD = 0
"""Token appended to each instance to make a row of S + 1: a valid id, never a target."""
_NPY_MAGIC = b"\x93NUMPY"


def olmo_core_order(num_instances: int, *, seed: int, epoch: int) -> np.ndarray:
    """The global indices OLMo-core's loader writes for `epoch` (from 1) of a dataset of
    `num_instances` instances: [N] uint32."""
    if epoch < 1:
        raise ValueError(f"epoch {epoch}: OLMo-core counts epochs from 1")
    order = np.arange(num_instances, dtype=INDICES_DTYPE)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(order)
    return order


class DataError(ValueError):
    """A token file, global-indices file, batch request or token row that does not fit
    OLMo-core's format or this dataset."""


def token_dtype(vocab_size: int) -> np.dtype:
    """OLMo-core's token-file dtype for `vocab_size` ids: the smallest unsigned type holding
    vocab_size - 1 (`NumpyDatasetConfig.get_dtype`). Padding the vocab to a multiple of 128 never
    changes it."""
    for dtype in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise DataError(f"vocab_size {vocab_size} does not fit in uint64")


def shift_to_inputs_targets(
    tokens: np.ndarray, *, segment_ids_from_eos: int | None = None
) -> dict[str, np.ndarray]:
    """Rows of L + 1 token ids -> the model's inputs and targets, each [..., L] int32.

    Args:
      tokens: [L + 1] or [B, L + 1] (any leading dims) integer ids, L >= 1.
      segment_ids_from_eos: EOS id (`Flags.olmo_segment_ids_from_eos`): number the documents of
        the inputs, an EOS closing its own, from 1 (`eos.cumsum() - eos + 1`, OLMo-core's
        `segment_ids_from_eos` + 1, 0 being MaxText's padding). None: one segment.

    Returns {"inputs", "targets", "inputs_position" (0..L-1), "inputs_segmentation",
    "targets_segmentation" (the loss mask: 1, and 0 for the last target of a row)}.
    """
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"tokens: integer token ids needed, got dtype {tokens.dtype}")
    if tokens.ndim == 0 or tokens.shape[-1] < 2:
        raise DataError(f"tokens: rows of L + 1 >= 2 ids needed, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise DataError(f"tokens: ids must lie in [0, 2**31), got [{tokens.min()}, {tokens.max()}]")
    inputs = tokens[..., :-1].astype(np.int32)  # shape: [..., L]
    targets = tokens[..., 1:].astype(np.int32)
    position = np.broadcast_to(np.arange(inputs.shape[-1], dtype=np.int32), inputs.shape)
    if segment_ids_from_eos is None:
        segmentation = np.ones_like(inputs)
    else:
        eos = (inputs == segment_ids_from_eos).astype(np.int32)
        segmentation = np.cumsum(eos, axis=-1, dtype=np.int32) - eos + 1
    loss_mask = np.ones_like(inputs)
    loss_mask[..., -1] = 0
    return {
        "inputs": inputs,
        "targets": targets,
        "inputs_position": position.copy(),
        "inputs_segmentation": segmentation,
        "targets_segmentation": loss_mask,
    }


def olmo_labels(targets: np.ndarray, targets_segmentation: np.ndarray) -> np.ndarray:
    """OLMo-core's labels from `shift_to_inputs_targets`' targets: `IGNORE_INDEX` where the loss
    mask is 0. For a row made of an instance and its lookahead these equal `get_labels` of the
    instance, and `(labels != IGNORE_INDEX).sum()` over the global batch is OLMo-core's
    `batch_num_tokens_for_loss`."""
    return np.where(targets_segmentation > 0, targets, IGNORE_INDEX).astype(np.int32)


def _open_raw(path: Path, dtype: np.dtype, what: str) -> np.ndarray:
    """A raw OLMo-core array file, memory-mapped: [n] of `dtype`."""
    if not path.is_file():
        raise DataError(f"{what} {path}: no such file")
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
            raise DataError(
                f"{what} {path}: starts with a .npy header; OLMo-core reads raw arrays "
                "(write them with ndarray.tofile, not np.save)"
            )
    if size % dtype.itemsize:
        raise DataError(
            f"{what} {path}: {size} bytes is not a whole number of {dtype.name} "
            f"({dtype.itemsize} bytes each): truncated, or written with another dtype"
        )
    if size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class OlmoData:
    """OLMo-core's batches of one epoch: token files + the global-indices file its loader wrote.

    Args:
      token_paths: the token files, in the order OLMo-core's dataset was given them.
      global_indices_path: OLMo-core's `global_indices_*.npy` of that dataset and epoch; None:
        epoch 1's order made as OLMo-core's loader makes it from `seed` (`olmo_core_order`).
      seq_len: S, tokens an instance.
      instances_per_batch: I, instances a global batch (OLMo-core's global batch tokens / S).
      vocab_size: ids the model embeds; bounds the ids read.
      dtype: the token files' dtype (None: OLMo-core's for `vocab_size`, `token_dtype`).
      seed: OLMo-core's data seed, when no global-indices file is given.
    """

    def __init__(
        self,
        token_paths: Sequence[str | Path],
        global_indices_path: str | Path | None,
        *,
        seq_len: int,
        instances_per_batch: int,
        vocab_size: int,
        dtype: np.dtype | str | None = None,
        seed: int | None = None,
    ):
        if seq_len < 1 or instances_per_batch < 1:
            raise DataError(
                f"seq_len and instances_per_batch must be >= 1, got {seq_len}, "
                f"{instances_per_batch}"
            )
        self.seq_len = seq_len
        self.instances_per_batch = instances_per_batch
        self.vocab_size = vocab_size
        self._paths = [Path(p) for p in token_paths]
        dtype = token_dtype(vocab_size) if dtype is None else np.dtype(dtype)
        self._tokens = [_open_raw(p, dtype, "token file") for p in self._paths]
        # shape: [files + 1], instance ids where each file starts
        self._starts = np.cumsum([0, *(len(t) // seq_len for t in self._tokens)])
        self.num_instances = int(self._starts[-1])
        if global_indices_path is None:
            if seed is None:
                raise DataError("no global-indices file and no seed to make OLMo-core's order")
            self._indices = olmo_core_order(self.num_instances, seed=seed, epoch=1)
        else:
            path = Path(global_indices_path)
            self._indices = _open_raw(path, INDICES_DTYPE, "global-indices file")
            if len(self._indices) != self.num_instances:
                raise DataError(
                    f"global-indices file {path}: holds {len(self._indices)} uint32 ids, but the "
                    f"token files make {self.num_instances} instances of {seq_len} tokens: "
                    "truncated, written with another dtype, or made for another dataset"
                )
        self.num_batches = self.num_instances // instances_per_batch

    @classmethod
    def from_config(cls, config: Config, token_paths: Sequence[str | Path]) -> OlmoData:
        """The data of a run whose `Flags.olmo_global_indices_path` names OLMo-core's file."""
        path = config.flags.olmo_global_indices_path
        if path is None:
            raise DataError("Flags.olmo_global_indices_path is not set")
        return cls(
            token_paths,
            path,
            seq_len=config.train.seq_len,
            instances_per_batch=config.train.global_batch_size,
            vocab_size=config.model.vocab_size,
        )

    def reshuffled(self, *, seed: int, epoch: int) -> OlmoData:
        """The same dataset in OLMo-core's order of `epoch` (`olmo_core_order`)."""
        other = copy.copy(self)
        other._indices = olmo_core_order(self.num_instances, seed=seed, epoch=epoch)
        return other

    def instance_ids(self, step: int) -> np.ndarray:
        """Instance ids of global batch `step` (from 0), in OLMo-core's order: [I] int64."""
        if not 0 <= step < self.num_batches:
            raise DataError(f"batch {step}: the epoch has batches 0..{self.num_batches - 1}")
        i = self.instances_per_batch
        ids = self._indices[step * i : (step + 1) * i].astype(np.int64)
        bad = ids[ids >= self.num_instances]
        if bad.size:
            raise DataError(
                f"batch {step}: instance id {bad[0]} is out of range: the dataset has "
                f"{self.num_instances} instances (a global-indices file for another dataset?)"
            )
        return ids

    def instance(self, instance_id: int) -> np.ndarray:
        """Tokens of one instance, as OLMo-core's `NumpyFSLDataset[instance_id]`: [S] int32."""
        if not 0 <= instance_id < self.num_instances:
            raise DataError(
                f"instance {instance_id}: the dataset has instances 0..{self.num_instances - 1}"
            )
        f = int(np.searchsorted(self._starts, instance_id, side="right")) - 1
        local = instance_id - int(self._starts[f])
        window = np.asarray(self._tokens[f][local * self.seq_len : (local + 1) * self.seq_len])
        if window.max() >= self.vocab_size:
            raise DataError(
                f"token file {self._paths[f]}: id {window.max()} in instance {instance_id} is "
                f">= vocab_size {self.vocab_size} (written with another dtype?)"
            )
        return window.astype(np.int32)

    def global_batch(self, step: int) -> np.ndarray:
        """OLMo-core's `input_ids` of global batch `step`: [I, S] int32."""
        return np.stack([self.instance(int(i)) for i in self.instance_ids(step)])

    def micro_batches(
        self,
        step: int,
        *,
        ga_steps: int,
        num_shards: int = 1,
        segment_ids_from_eos: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Global batch `step` as `ga_steps` micro-batches for `num_shards` data shards, each
        output [ga_steps, I / ga_steps, S] int32 (see `shift_to_inputs_targets`), plus "labels"
        (`olmo_labels`, what the loss takes).

        Micro-batch m holds the rows OLMo-core's data-parallel ranks r = 0..W-1 (W = num_shards)
        take for their micro-batch m, rank r's rows at [r * R:(r + 1) * R] (R = I / (W * ga_steps)),
        so sharding a micro-batch over W devices along its rows gives each the rows of its rank.
        """
        i, w = self.instances_per_batch, num_shards
        if ga_steps < 1 or w < 1 or i % (w * ga_steps):
            raise DataError(
                f"ga_steps={ga_steps} times num_shards={num_shards} must divide the "
                f"{i} instances of a batch"
            )
        ids = self.instance_ids(step)
        # shape: [I] -> [I / W, W] -> [W, ga, R] (rank r: ids[r::W]) -> [ga, W, R] -> [ga, W * R]
        ids = ids.reshape(i // w, w).T.reshape(w, ga_steps, -1).transpose(1, 0, 2)
        ids = ids.reshape(ga_steps, -1)
        rows = np.stack([self.instance(int(k)) for k in ids.reshape(-1)])  # [I, S]
        rows = np.pad(rows, ((0, 0), (0, 1)), constant_values=LOOKAHEAD)  # [I, S + 1]
        batch = shift_to_inputs_targets(rows, segment_ids_from_eos=segment_ids_from_eos)
        batch["labels"] = olmo_labels(batch["targets"], batch["targets_segmentation"])
        return {k: v.reshape(ga_steps, i // ga_steps, self.seq_len) for k, v in batch.items()}

    def batches(
        self,
        *,
        start: int = 0,
        ga_steps: int,
        num_shards: int = 1,
        segment_ids_from_eos: int | None = None,
    ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(step, `micro_batches(step)`) from `start` to the end of the epoch."""
        for step in range(start, self.num_batches):
            yield (
                step,
                self.micro_batches(
                    step,
                    ga_steps=ga_steps,
                    num_shards=num_shards,
                    segment_ids_from_eos=segment_ids_from_eos,
                ),
            )

    def resume_step(self, loader_state: Mapping[str, Any]) -> int:
        """The batch OLMo-core's loader resumes at from its `state_dict()`:
        tokens_processed // (I * S), as `NumpyFSLDataLoader.load_state_dict`."""
        expected = {"dataset_type": "fsl", "max_target_sequence_length": None}
        wrong = {k: loader_state.get(k) for k, v in expected.items() if loader_state.get(k) != v}
        if wrong:
            raise DataError(f"loader state {wrong}: only the plain FSL order ({expected}) is read")
        return int(loader_state["tokens_processed"]) // (self.instances_per_batch * self.seq_len)
