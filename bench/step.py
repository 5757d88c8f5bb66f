"""The whole train step of the micro config (GA = 2, OLMo-core flags) on this CPU, on the golden
trace's step-1 batch (data batch 0, its EMO pool draws, the step-0 weights): the jitted JAX
`model.train_step.train_step` against OLMo-core's own step, `train_batch` + `optim_step` +
`zero_grads` of the `OLMoDDPTrainModule` the trace trains with (`goldens.trace.train_module`),
torch and XLA on the same cores. Target (the issue): JAX <= 0.25x OLMo-core's time; report the
fraction of peak.

OLMo-core's train module reads the step, the LR schedule and its metric sink from a `Trainer`, so
a minimal one (no callbacks of ours, no checkpoints) is attached; its loader yields the batch. On a
CPU OLMo-core runs the stand-ins of `goldens.runtime.standins`: KDA is FLA's token-by-token
`naive_recurrent_kda`, not its chunked triton kernel. Timings need an idle machine: with another
process on a core, torch's thousands of small ops a step slow down by up to 70x.

Model FLOPs of a step: `model.flops.step_flops`.
Peak: a jitted 2048 x 2048 float32 matmul (2 n^3 FLOPs), best of several.

Where the time goes (XLA's per-kernel trace of the step, `--xla_cpu_enable_xprof_traceme`, and
each part's forward + backward jitted alone on one micro-batch of 4 x 256 tokens; this 2-core AMD
EPYC, one device: the CPU split into 8 simulated devices slows the step by a quarter). A step is
2 micro-batches of 7 KDA blocks, 7 MoE and one each of attention, dense and LM head: 0.41 s,
against 0.70 s with `ragged_dot`, XLA's cumsums and argsorts and 16 x 16 decay blocks:
- KDA mixer 22 ms a block (30 ms with cumsums and 16 x 16 blocks), its chunked kernel 9 ms.
  Only 8 x 8 diagonal blocks decay per pair, the rest are matmuls (`intra_chunk_scores`); XLA's
  CPU runs a cumsum as a reduce-window (86 ms a step in all), so prefix and span sums are
  triangle matmuls. The chunk inverse is 0.9 ms with its matrix gradient (a `triangular_solve`
  forward is no faster). Left: hundreds of small kernels a block (projections, short
  convolutions, the per-pair scores, the transposes between the einsums' layouts), each with the
  thunk runtime's fixed cost; fusing the six input projections into one matmul saves nothing.
- MoE feed-forward 4.5 ms a block (28 ms with `ragged_dot`, which XLA's CPU runs as E masked
  dense matmuls, 23 ms of the 28), with `tiled_routed_experts` as the CPU dispatch (2.4 ms); the
  EMO pool ranks by pairwise comparison (two argsorts a layer cost 26 ms a step).
- Attention 6.7 ms, dense SwiGLU 7.5 ms, LM head (loss included) 1.9 ms; the GA scan and AdamW
  are small beside these.
"""

import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import best_seconds
from goldens.store import load_golden, resolve
from model import train_step as ts
from model.config import Config, micro, olmo_core
from model.convert import from_olmo_core
from model.data import OlmoData
from model.flops import step_flops
from model.state import compiled_train_step

TRACE_STEP = 1
"""The golden trace's first step: data batch 0, the step-0 weights."""
REPEATS = 5
"""Timed steps a side, after one warm-up (compilation): a step takes seconds."""
MATMUL_N = 2048


def golden_config() -> Config:
    """The micro config with OLMo-core's flags and the data goldens' global-indices file."""
    order = load_golden("data/order.safetensors").entry["config"]
    return olmo_core(micro(), global_indices_path=str(resolve(order["global_indices_file"])))


def golden_batch(cfg: Config, step: int) -> dict[str, np.ndarray]:
    """The micro-batches of trace step `step` (data batch step - 1) with the trace's EMO pool
    draws: "pool_draws" [GA, b, n_moe_layers, T], the columns past a row's documents min_pool."""
    token_files = load_golden("data/order.safetensors").entry["config"]["token_files"]
    data = OlmoData.from_config(cfg, [resolve(p) for p in token_files])
    batch = data.micro_batches(
        step - 1,
        ga_steps=cfg.train.ga_steps,
        segment_ids_from_eos=cfg.flags.olmo_segment_ids_from_eos,
    )
    draws = load_golden("trace/metrics.safetensors")["pool_draws"][step - 1].astype(np.int32)
    T, min_pool = cfg.train.seq_len, cfg.model.moe.emo.min_pool
    # shape: [GA, L, b, docs] -> [GA, L, b, T] -> [GA, b, L, T]
    draws = np.pad(draws, [(0, 0)] * 3 + [(0, T - draws.shape[-1])], constant_values=min_pool)
    batch["pool_draws"] = draws.transpose(0, 2, 1, 3)
    return batch


def _jax_step_seconds(cfg: Config, batch: dict[str, np.ndarray]) -> tuple[float, float]:
    """(compile seconds: trace, lower and compile the jitted step; best step seconds)."""
    params0 = load_golden("trace/params_step0.safetensors").tensors
    graphdef, params = nnx.split(from_olmo_core(params0, cfg.model))
    step = compiled_train_step(cfg, graphdef)
    state, mb = ts.init_state(params, cfg), jax.tree.map(jnp.asarray, batch)
    start = time.perf_counter()
    compiled = step.lower(state, mb).compile()
    compile_s = time.perf_counter() - start
    return compile_s, best_seconds(
        lambda: jax.block_until_ready(compiled(state, mb)), repeats=REPEATS
    )


def _olmo_core_step_seconds(cfg: Config, input_ids: np.ndarray) -> float:
    import torch
    from olmo_core.train import Duration, TrainerConfig

    from goldens.data import olmo_core_loader, write_token_files
    from goldens.trace import STEP_SEED, train_module, use_free_port

    use_free_port()  # a trace export may hold the default
    module = train_module(cfg)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        work = Path(tmp)
        loader = olmo_core_loader(cfg, list(write_token_files(cfg, work).values()), work / "data")
        trainer = TrainerConfig(
            save_folder=str(work / "run"),
            max_duration=Duration.steps(cfg.train.max_steps),
            no_checkpoints=True,
            device="cpu",
        ).build(module, loader)
        batch = next(iter(loader))
        assert np.array_equal(batch["input_ids"].numpy(), input_ids), "not the JAX side's batch"

        def step():
            trainer.global_step += 1  # as `Trainer.fit`; the schedule and metrics read it
            torch.manual_seed(STEP_SEED + TRACE_STEP)  # the trace's pool draws of this step
            module.train_batch(dict(batch))
            module.optim_step()
            module.zero_grads()

        return best_seconds(step, repeats=REPEATS)


def _matmul_flops_per_s() -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((MATMUL_N, MATMUL_N), np.float32))
    matmul = jax.jit(jnp.matmul)
    return 2 * MATMUL_N**3 / best_seconds(lambda: jax.block_until_ready(matmul(a, a)))


def run() -> dict[str, float]:
    import torch

    cfg = golden_config()
    batch = golden_batch(cfg, TRACE_STEP)
    compile_s, jax_s = _jax_step_seconds(cfg, batch)  # first: torch's OpenMP threads spin after it
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # XLA's CPU pool: every core it may use
    try:
        olmo_core_s = _olmo_core_step_seconds(cfg, batch["inputs"].reshape(-1, cfg.train.seq_len))
    finally:
        torch.set_num_threads(threads)
    flops_per_s = step_flops(cfg) / jax_s
    return {
        "compile_s": compile_s,
        "jax_step_s": jax_s,
        "olmo_core_step_s": olmo_core_s,
        "jax_over_olmo_core": jax_s / olmo_core_s,
        "jax_flops_per_s": flops_per_s,
        "fraction_of_matmul_peak": flops_per_s / _matmul_flops_per_s(),
    }


def summary(figures: dict[str, float]) -> list[str]:
    """The closing lines other checks read (issue #18's format)."""
    return [
        f"step ratio jax/olmo-core: {figures['jax_over_olmo_core']:.3f}",
        f"compile seconds: {figures['compile_s']:.1f}",
    ]
