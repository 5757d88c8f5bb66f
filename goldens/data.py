"""Goldens of OLMo-core's data order for the micro config: the corpus token files, the
global-indices file OLMo-core's own loader writes, the batches it yields and its state for
resuming.

OLMo-core 3.0.0, run as a training job runs it: `NumpyFSLDatasetConfig(...).build()` ->
`NumpyFSLDataset` over the token files (instance i is a window of seq_len consecutive tokens, the
files concatenated in order, each file's tail dropped); `NumpyDataLoaderConfig(global_batch_size=
<tokens>, seed=data_seed).build()` -> `NumpyFSLDataLoader`, whose `reshuffle(epoch=1)` writes the
global-indices file (raw uint32, the instance ids shuffled by `PCG64(seed + epoch)`). Iterating it
yields batch k = the instances at indices[k * I:(k + 1) * I] (I instances a batch). A fresh loader
is resumed from the state saved after `RESUME_AFTER` batches and its next batches are kept too. The
labels of batch 0 are OLMo-core's `get_labels` (input ids shifted left, the last label -100), what
its train module takes the loss on.

Nothing is patched on CPU: torch.distributed stays uninitialised, so the loader is data-parallel
rank 0 of 1 and writes the indices file itself.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from goldens.corpus import token_arrays
from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_EXACT
from model.config import Config, micro

DIR = "data"
REPLAY_BATCHES = 50
"""Batches whose token ids are kept, from step 0: the replay's length."""
RESUME_AFTER = 10
"""Batches after which the loader's state is saved and a fresh loader resumes from it."""
RESUMED_BATCHES = 4
"""Batches kept from the resumed loader."""
TOLERANCES = {"regenerate": REGENERATE_EXACT.as_dict()}
"""Token ids and instance ids: equal, bit for bit."""
ON_CPU = [
    "no patches",
    "torch.distributed not initialised: data-parallel rank 0 of 1",
    "num_workers=0 (the loader still reads instances in 4 threads, in order)",
]
"""What OLMo-core needed to run this on a CPU."""


def write_token_files(config: Config, directory: Path) -> dict[str, Path]:
    """The corpus token files (manifest path -> file written under `directory`)."""
    files = {}
    for name, array in token_arrays(eos_token_id=config.model.eos_token_id).items():
        path = f"{DIR}/tokens/{name}.npy"
        files[path] = Path(directory, path)
        files[path].parent.mkdir(parents=True, exist_ok=True)
        array.astype("<u2").tofile(files[path])
    return files


def olmo_core_loader(config: Config, token_files: list[Path], work_dir: Path):
    """OLMo-core's `NumpyFSLDataLoader` over the token files, reshuffled for epoch 1."""
    dataset_config, loader_config = _olmo_core_configs(config, token_files, work_dir)
    loader = loader_config.build(dataset_config.build())
    loader.reshuffle(epoch=1)
    return loader


def _olmo_core_configs(config: Config, token_files: list[Path], work_dir: Path):
    from olmo_core.data import (
        NumpyDataLoaderConfig,
        NumpyDatasetDType,
        NumpyFSLDatasetConfig,
        TokenizerConfig,
    )

    eos = config.model.eos_token_id
    tokenizer = TokenizerConfig(
        vocab_size=eos + 1,  # ids 0..EOS, the ones in use; OLMo-core's collator rejects others
        eos_token_id=eos,
        pad_token_id=eos,  # never used: every instance is seq_len tokens long
    )
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer,
        paths=[str(path) for path in token_files],
        sequence_length=config.train.seq_len,
        dtype=NumpyDatasetDType.uint16,
        work_dir=str(work_dir),
    )
    loader = NumpyDataLoaderConfig(
        global_batch_size=config.train.global_batch_size * config.train.seq_len,  # tokens
        seed=config.train.data_seed,
        work_dir=str(work_dir),
        num_workers=0,
    )
    return dataset, loader


def _run_olmo_core(config: Config, token_files: list[Path], work_dir: Path) -> dict[str, Any]:
    """Iterate OLMo-core's loader over the first epoch, then resume a fresh one mid-epoch."""
    from olmo_core.data.utils import get_labels

    dataset_config, loader_config = _olmo_core_configs(config, token_files, work_dir)
    loader = olmo_core_loader(config, token_files, work_dir)
    batches, state = [], None
    for batch in loader:
        batches.append(batch)
        if len(batches) == RESUME_AFTER:
            state = loader.state_dict()

    resumed = loader_config.build(dataset_config.build())
    resumed.load_state_dict(state)
    resumed.reshuffle(epoch=state["epoch"])
    resumed_ids = []
    for batch in resumed:
        resumed_ids.append(batch["index"].numpy())
        if len(resumed_ids) == RESUMED_BATCHES:
            break

    (indices_file,) = work_dir.glob("global_indices_*.npy")
    dataset = {k: v for k, v in dataset_config.as_dict().items() if k not in ("paths", "work_dir")}
    return {
        "instance_ids": np.stack([b["index"].numpy() for b in batches]),
        "input_ids": np.stack([b["input_ids"].numpy() for b in batches]).astype(np.uint16),
        "labels": get_labels(batches[0]).numpy(),
        "resumed_instance_ids": np.stack(resumed_ids),
        "indices_name": indices_file.name,
        "indices": np.fromfile(indices_file, dtype="<u4"),
        "state": state,
        "olmo_core": {
            "dataset": dataset,
            "loader": {k: v for k, v in loader_config.as_dict().items() if k != "work_dir"},
        },
    }


def export() -> list[GoldenFile]:
    config = micro()
    tokens = {
        f"{DIR}/tokens/{name}.npy": array
        for name, array in token_arrays(eos_token_id=config.model.eos_token_id).items()
    }
    with tempfile.TemporaryDirectory(prefix="goldens-data-") as tmp:
        token_files = list(write_token_files(config, Path(tmp)).values())
        run = _run_olmo_core(config, token_files, Path(tmp, "work"))

    seeds = {"data": config.train.data_seed}
    indices_path = f"{DIR}/{run['indices_name']}"
    num_batches = len(run["instance_ids"])
    steps = np.array([*range(REPLAY_BATCHES), num_batches // 2, num_batches - 1], dtype=np.int64)
    goldens = [
        GoldenFile(
            path=path,
            tensors={"tokens": array},
            producer="goldens.corpus byte-level tokens + EOS, OLMo-core's token-file layout",
            seeds={},
            config={"eos_token_id": config.model.eos_token_id},
            tolerances=TOLERANCES,
            format="raw",
        )
        for path, array in tokens.items()
    ]
    goldens.append(
        GoldenFile(
            path=indices_path,
            tensors={"indices": run["indices"]},
            producer="olmo_core.data.NumpyFSLDataLoader.reshuffle(epoch=1)",
            seeds=seeds,
            config={"epoch": 1, "dataset_size": len(run["indices"]), "on_cpu": ON_CPU},
            tolerances=TOLERANCES,
            format="raw",
        )
    )
    goldens.append(
        GoldenFile(
            path=f"{DIR}/order.safetensors",
            tensors={
                "instance_ids": run["instance_ids"],
                "steps": steps,
                "input_ids": run["input_ids"][steps],
                "labels": run["labels"],
                "resumed_instance_ids": run["resumed_instance_ids"],
            },
            producer="olmo_core.data.NumpyFSLDataLoader over NumpyFSLDataset; "
            "olmo_core.data.utils.get_labels",
            config={
                "token_files": list(tokens),
                "global_indices_file": indices_path,
                "seq_len": config.train.seq_len,
                "instances_per_batch": config.train.global_batch_size,
                "olmo_core": run["olmo_core"],
                "on_cpu": ON_CPU,
                "epoch": 1,
                "resume": {"after_batches": RESUME_AFTER, "loader_state": run["state"]},
                "tensors": {
                    "instance_ids": "batch['index'] of every batch of epoch 1",
                    "steps": "batches whose token ids are kept",
                    "input_ids": "batch['input_ids'] of those batches (int64 in OLMo-core)",
                    "labels": "get_labels(batch 0)",
                    "resumed_instance_ids": "batch['index'] from the resumed loader",
                },
            },
            seeds=seeds,
            tolerances=TOLERANCES,
        )
    )
    return goldens
