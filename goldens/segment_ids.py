"""Golden of OLMo-core's `segment_ids_from_eos` (olmo_core/ops/moe.py), which the model applies to
a batch's input ids for the EMO pools: the document index of every token, an EOS closing its own
document (`eos.cumsum() - eos`, from 0).

`tokens` are rows of L + 1 random byte ids with the EOS id at random positions, at rates from none
to every token; some rows start with an EOS, some end with one (the lookahead token, which is no
input). OLMo-core's function is applied to the inputs, `tokens[:, :-1]`, as its model sees them.
"""

from __future__ import annotations

import numpy as np

from goldens.corpus import BYTE_VOCAB
from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_EXACT
from model.config import micro

SEED = 1007
ROWS = 40
LENGTH = 64
"""L: inputs per row; `tokens` rows have L + 1."""
EOS_RATES = (0.0, 0.02, 0.1, 0.5, 1.0)
"""Share of EOS tokens, each rate on every fifth row."""


def export() -> list[GoldenFile]:
    import torch
    from olmo_core.ops.moe import segment_ids_from_eos

    eos = micro().model.eos_token_id
    rng = np.random.Generator(np.random.PCG64(SEED))
    tokens = rng.integers(0, BYTE_VOCAB, size=(ROWS, LENGTH + 1), dtype=np.int64)
    rates = np.resize(np.array(EOS_RATES), ROWS)[:, None]
    tokens[rng.random(tokens.shape) < rates] = eos
    tokens[::3, 0] = eos
    tokens[::2, -1] = eos
    segment_ids = segment_ids_from_eos(torch.from_numpy(tokens[:, :-1]), eos)
    return [
        GoldenFile(
            path="data/segment_ids.safetensors",
            tensors={"tokens": tokens, "segment_ids": segment_ids.numpy()},
            producer="olmo_core.ops.moe.segment_ids_from_eos",
            seeds={"numpy": SEED},
            config={"eos_token_id": eos, "rows": ROWS, "length": LENGTH, "eos_rates": EOS_RATES},
            tolerances={"regenerate": REGENERATE_EXACT.as_dict()},
        )
    ]
