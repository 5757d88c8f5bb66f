"""Compiled temporary memory of a GA = 2 train step on 8 simulated devices (rows sharded over a
"data" mesh axis) for a small LM whose vocab makes the LM head + CE dominate: flat vs seq-major
vocab tiling, and the GA params loop barrier off vs on, as ratios (XLA's `memory_analysis`).
The seed measured on TPU: seq-major 26.3 / 49.9 GB = 0.53x of flat, barrier 44.3 / 49.9 = 0.89x."""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import config as c
from model import train_step as ts
from model.state import jit_train_step
from parity import small_lm

VOCAB, D_MODEL, ROWS, SEQ, GA, TILES = 32768, 256, 32, 512, 2, 8


def _temp_bytes(params, batch, mesh, *, seq_major: bool, barrier: bool) -> int:
    cfg = c.olmo_core(c.micro())
    cfg = dataclasses.replace(
        cfg,
        flags=dataclasses.replace(
            cfg.flags, vocab_tiling_seq_major=seq_major, ga_params_loop_barrier=barrier
        ),
    )
    terms = small_lm.terms_fn(tiles=TILES, seq_major=seq_major)
    state = ts.init_state(params, cfg)
    rows = NamedSharding(mesh, P(None, "data"))
    replicated = NamedSharding(mesh, P())
    step = jit_train_step(
        cfg, terms, shardings=jax.tree.map(lambda _: replicated, state), rows=rows
    )
    compiled = step.lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def run() -> dict[str, float]:
    if jax.device_count() < 8:
        raise RuntimeError("bench.memory needs 8 devices: run it through `python -m bench`")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params, rows = small_lm.params_and_rows(vocab=VOCAB, d_model=D_MODEL, rows=ROWS, seq_len=SEQ)
    batch = small_lm.micro_batches(rows, GA)
    flat = _temp_bytes(params, batch, mesh, seq_major=False, barrier=False)
    seq_major = _temp_bytes(params, batch, mesh, seq_major=True, barrier=False)
    barrier = _temp_bytes(params, batch, mesh, seq_major=False, barrier=True)
    return {
        "flat temporaries (MB)": flat / 2**20,
        "seq-major / flat temporaries": seq_major / flat,
        "loop barrier / none temporaries": barrier / flat,
    }
