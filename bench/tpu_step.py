"""`python -m bench tpu-step`: the whole train step of a hero-width slice on one TPU chip, at
matmul precision "default" and "highest" (`ScaleConfig.matmul_precision`), at "default" with
XLA's ops in place of the Pallas KDA intra-chunk kernel (`ScaleConfig.kda_kernel`) or of the
Pallas flash attention kernel (`ScaleConfig.attention_kernel`), the kernels' befores, with
vocab tiles that recompute their logits (8, the slice's before, or 4) or 16 tiles, with GA 2 of
4 rows under remat "full" (the slice's before), and at seq 8192 (GA 2 of 2 rows, remat "full"):
each in a process of its own so that the chip's peak memory is the step's alone.

The slice (`model.config.olmo35_slice`): `olmo35_tiny`'s widths (d_model 1024, vocab 100352,
KDA 8 heads of 128 / 256, attention 8 / 4 heads of 128, routed experts of 1024 in a 512-wide
latent, top 16, a shared expert), 4 blocks (block 0 dense; KDA at 0-2, attention at 3), 64
routed experts (EMO pools of 16 to 64); seq 4096, GA 8 of 1 sequence; bfloat16 activations,
float32 params and Adam; remat "none"; 8 vocab tiles keeping their logits; OLMo-core's flags.
Tokens are random, with an EOS every `DOCUMENT` tokens.

Per variant: compile seconds (trace, lower, compile), the best step of `REPEATS`, tokens a
second, model FLOP/s (`model.flops.step_flops`) over the chip's bfloat16 peak, the compiler's
memory plan (arguments, outputs, temporaries, its peak) and the chip's measured peak
(`memory_stats()["peak_bytes_in_use"]`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import best_seconds
from model import config as c
from model import train_step as ts
from model.flops import PEAK_FLOPS, step_flops
from model.precision import matmul_precision
from model.state import compiled_train_step, make_model


@dataclasses.dataclass(frozen=True)
class Variant:
    precision: str
    kda_kernel: str = "pallas"
    attention_kernel: str = "pallas"
    seq_len: int | None = None
    rows: int | None = None
    """Sequences a micro-batch. The step keeps the slice's tokens: GA grows as rows and seq_len
    shrink."""
    remat: str | None = None
    """`ScaleConfig.remat_policy`; None keeps the slice's, as do `seq_len` and `rows`."""
    vocab_tiles: int | None = None
    """`TrainConfig.vocab_tiles`; None keeps the slice's."""
    keep_logits: bool | None = None
    """`ScaleConfig.vocab_tiles_keep_logits`; None keeps the slice's."""


VARIANTS = {
    "default": Variant("default"),
    "highest": Variant("highest"),
    "default-xla-kda": Variant("default", kda_kernel="xla"),
    "default-xla-attention": Variant("default", attention_kernel="xla"),
    "default-rows-4-remat-full": Variant("default", rows=4, remat="full", keep_logits=False),
    "default-seq-8192": Variant("default", seq_len=8192, rows=2, remat="full", keep_logits=False),
    "default-tiles-4": Variant("default", vocab_tiles=4, keep_logits=False),
    "default-tiles-16": Variant("default", vocab_tiles=16),
    "default-recompute-logits": Variant("default", keep_logits=False),
}
"""name: matmul precision, `ScaleConfig.kda_kernel` and `attention_kernel`, sequence length,
rows a micro-batch, `ScaleConfig.remat_policy`, vocab tiles and whether they keep their logits."""
DOCUMENT = 1024
"""Tokens a document: an EOS closes each."""
REPEATS = 5
GIB = 2**30


def slice_config(variant: str) -> c.Config:
    """The slice (`model.config.olmo35_slice`) with OLMo-core's flags, as `variant` of VARIANTS."""
    v = VARIANTS[variant]
    cfg = c.olmo_core(c.olmo35_slice())
    scale = dataclasses.replace(
        cfg.scale,
        matmul_precision=v.precision,
        kda_kernel=v.kda_kernel,
        attention_kernel=v.attention_kernel,
        remat_policy=v.remat or cfg.scale.remat_policy,
        vocab_tiles_keep_logits=(
            cfg.scale.vocab_tiles_keep_logits if v.keep_logits is None else v.keep_logits
        ),
    )
    seq_len = v.seq_len or cfg.train.seq_len
    rows = v.rows or cfg.train.micro_batch_size
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    ga_steps = tokens // (rows * seq_len)
    if ga_steps * rows * seq_len != tokens:
        raise ValueError(f"{variant}: {rows} rows of {seq_len} do not divide the step's {tokens}")
    train = dataclasses.replace(
        cfg.train,
        seq_len=seq_len,
        ga_steps=ga_steps,
        global_batch_size=ga_steps * rows,
        vocab_tiles=v.vocab_tiles or cfg.train.vocab_tiles,
    )
    return dataclasses.replace(cfg, scale=scale, train=train)


def micro_batches(cfg: c.Config) -> dict[str, jax.Array]:
    """[GA, rows, ...] random tokens with an EOS every DOCUMENT, labels shifted by one, segment
    ids from EOS, each document's EMO pool drawn uniformly."""
    m, rows = cfg.model, cfg.train.micro_batch_size
    rng = np.random.default_rng(0)
    shape = (cfg.train.ga_steps, rows, cfg.train.seq_len + 1)
    tokens = rng.integers(0, m.eos_token_id, shape, dtype=np.int32)
    tokens[..., DOCUMENT - 1 :: DOCUMENT] = m.eos_token_id
    inputs = tokens[..., :-1]
    eos = inputs == m.eos_token_id
    segments = np.cumsum(eos, axis=-1) - eos + 1
    emo = m.moe.emo
    draws_shape = (*inputs.shape[:2], len(m.moe_layers), inputs.shape[-1])
    draws = rng.integers(emo.min_pool, emo.max_pool + 1, draws_shape, dtype=np.int32)
    batch = {"inputs": inputs, "labels": tokens[..., 1:], "inputs_segmentation": segments}
    return {k: jnp.asarray(v) for k, v in (batch | {"pool_draws": draws}).items()}


def slice_step(variant: str, bench: str):
    """The slice's `variant` on this host's TPU (`bench` names the caller in the error
    elsewhere): (config, its initial train state, its micro-batches, the whole step compiled
    with the state donated, seconds the compile took)."""
    cfg = slice_config(variant)
    if jax.default_backend() != "tpu":
        raise SystemExit(f"bench {bench} needs a TPU: JAX runs on {jax.default_backend()} here")
    graphdef, params = nnx.split(make_model(cfg))
    state = jax.tree.map(jnp.copy, ts.init_state(params, cfg))  # one buffer a leaf, to donate
    del params  # the state holds its own copy; two would not fit beside the step's temporaries
    batch = micro_batches(cfg)
    step = compiled_train_step(cfg, graphdef, donate=True)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    return cfg, state, batch, compiled, time.perf_counter() - start


def measure(variant: str) -> dict[str, float]:
    """The figures of one variant, in this process (which holds the chip)."""
    cfg, state, batch, compiled, compile_s = slice_step(variant, "tpu-step")
    plan = compiled.memory_analysis()
    holder = [state]

    def one_step():
        holder[0], metrics = compiled(holder[0], batch)
        jax.block_until_ready(metrics)

    step_s = best_seconds(one_step, repeats=REPEATS)
    device = jax.devices()[0]
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    flops = step_flops(cfg) / step_s
    peak = PEAK_FLOPS.get(device.device_kind, float("nan"))
    return {
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_flops_per_s": flops,
        "fraction_of_peak": flops / peak,
        "arguments_gib": plan.argument_size_in_bytes / GIB,
        "outputs_gib": plan.output_size_in_bytes / GIB,
        "temporaries_gib": plan.temp_size_in_bytes / GIB,
        "compiler_peak_gib": plan.peak_memory_in_bytes / GIB,
        "measured_peak_gib": device.memory_stats()["peak_bytes_in_use"] / GIB,
    }


def run() -> dict[str, float]:
    """Each variant in a child process (this one never opens the chip); figures named
    "<variant>.<figure>"."""
    figures: dict[str, float] = {}
    for variant, v in VARIANTS.items():
        if matmul_precision(slice_config(variant)) != v.precision:
            raise ValueError(f"the slice does not run at {v.precision}")
        child = [sys.executable, "-m", "bench.tpu_step", variant]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench tpu-step {variant} failed:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        figures |= {f"{variant}.{k}": v for k, v in measured.items()}
    return figures


def summary(figures: dict[str, float]) -> list[str]:
    return [
        f"{p}: step {figures[f'{p}.step_s']:.3f} s, {figures[f'{p}.fraction_of_peak']:.1%} of "
        f"the chip's bf16 peak, measured peak {figures[f'{p}.measured_peak_gib']:.2f} GiB"
        for p in VARIANTS
    ]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
