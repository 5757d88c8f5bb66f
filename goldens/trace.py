"""The golden training trace: OLMo-core's real `Trainer` trains the micro model on CPU with the
hero's recipe scaled down, and every step's metrics, EMO pool draws and a few parameter snapshots
are kept for the JAX replay (`python -m parity.replay`).

OLMo-core 3.0.0 as a training job runs it: `OLMoDDPModel` (`goldens.runtime.models.build`),
`OLMoDDPTrainModule` (micro-batches of 4 rows: GA 2; z-loss 1e-5; `OLMoDDPOptimizer`: lr 1e-3,
betas 0.9/0.95, eps 1e-8, wd 0.1 and 0 for `*embeddings.weight`, clip 1.0, skip-step 6 sigma;
`ConstantWithWarmup(warmup=10)`), the `NumpyFSLDataLoader` of the data goldens, `Trainer.fit()` for
`STEPS` steps. What it needs on one CPU process: the CPU stand-ins (KDA, MoE v2), fp32
(`OLMoDDPModel._training_dtype`), a process group of world size 1 (`process_group_backend`), no
checkpoints.

Kept: every step's metrics, the params at `SNAPSHOT_STEPS`, and the whole training state one step
before each later snapshot (`STATE_STEPS`, goldens.train_state), from which `regenerate_step`
runs that snapshot's step alone: a rerun then holds the snapshot to one step's rounding, where the
free-running rerun only lands inside the one-ulp envelope below.

Reproducible: a callback reseeds torch's global RNG before every step (EMO draws its pool sizes
from it); another records each router call's draw tensor (OLMo-core's [B, T], document d of a
row in column d), rebuilt from the RNG state before the call and checked against the pools used.

How far fp32 training itself reproduces (`trace/perturbed.safetensors`): the same run again from
step-0 weights moved by one ulp (each weight times 1 + s 2^-23, s drawn from {-1, 0, 1}), for
`PERTURBED_SEEDS`. Adam on near-zero gradients and top-k routing flips amplify such rounding-level
differences step after step; the gaps between these runs and the golden one are the spread any
other fp32 implementation of the same run can be expected to show.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from goldens.data import olmo_core_loader, write_token_files
from goldens.envelope import norm_gap
from goldens.runtime.models import RUNTIME
from goldens.runtime.standins import MOE_SUBSTITUTIONS, SUBSTITUTIONS, install, install_moe
from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_TRACE
from goldens.train_state import (
    GRAD_NORMS,
    LOSSES,
    optimizer_state,
    restore_optimizer_state,
    unwrapped,
)
from model.config import Config, micro, olmo_core
from model.train_step import METRICS as STEP_METRICS

STEPS = 50
SNAPSHOT_STEPS = (0, 10, STEPS)
STATE_STEPS = tuple(step - 1 for step in SNAPSHOT_STEPS[1:])
"""Steps after which the whole training state is kept (goldens.train_state), so that each later
snapshot's step can be regenerated alone from it (`regenerate_step`)."""
STEP_SEED = 10_000
"""torch.manual_seed(STEP_SEED + step) before each step."""
OLMO_CORE_NAMES = (
    "train/CE loss",
    "train/Z loss",
    "train/load balancing loss",
    "train/router Z loss",
    "optim/LR (group 0)",
    "optim/total grad norm",
)
METRICS = dict(
    zip((*STEP_METRICS, "skipped"), (*OLMO_CORE_NAMES, "optim/step skipped"), strict=True)
)
"""Trace tensor (our train step's metric) -> OLMo-core metric; per MoE block also
"train/block NN/{load balancing loss, router Z loss}"."""
DIR = "trace"
PERTURBED_SEEDS = (1, 2)
"""Seeds of the one-ulp perturbations of the step-0 weights."""
MASTER_PORT = "29551"
"""The gloo process group's port, unless MASTER_PORT is set."""
RUN_PARTS = ("model", "train", "flags")
"""The config parts OLMo-core's run is made of; `scale` (sharding rules, remat) is JAX's alone."""


def run_config(cfg: Config) -> dict:
    """The manifest's record of the config the trace was made for: its `RUN_PARTS`."""
    return {part: cfg.as_dict()[part] for part in RUN_PARTS}


def sockets_refused() -> bool:
    """Whether this machine refuses internet sockets, loopback too (a sandbox such as a TPU
    host's): gloo cannot run there."""
    try:
        socket.socket().close()
    except OSError:
        return True
    return False


def process_group_backend() -> str:
    """The world-size-1 process group OLMo-core trains in: "gloo" over the loopback (the trace's),
    or where sockets are refused torch's in-process group "threaded". With one rank both leave
    every tensor as it is: three lockstep steps of OLMo-core gave the same bits in each."""
    return "threaded" if sockets_refused() else "gloo"


PROCESS_GROUP = (
    "torch.distributed: a process group of world size 1, gloo over the loopback (env://), or "
    "where the machine refuses sockets torch's in-process \"threaded\" group, OLMo-core's CPU "
    "check told of it (the entry's machine.process_group names which; three OLMo-core steps gave "
    "the same bits in each)"
)


def use_free_port() -> None:
    """Unless MASTER_PORT is set, the gloo group listens on a port free now (another OLMo-core
    run, or one just ended, may hold MASTER_PORT's default)."""
    if "MASTER_PORT" not in os.environ and process_group_backend() == "gloo":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def init_process_group() -> None:
    """torch.distributed's world of one process, unless one exists: `process_group_backend`'s
    group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if process_group_backend() == "threaded":
        _in_process_group()
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", MASTER_PORT),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    dist.init_process_group("gloo", rank=0, world_size=1)


def _in_process_group() -> None:
    """torch's in-process group of one rank, no sockets; OLMo-core's device choice
    (`olmo_core.distributed.utils.backend_supports_cpu`, which knows gloo and mpi) is told it
    runs on the CPU."""
    import olmo_core.distributed.utils as olmo_dist
    import torch.distributed as dist
    import torch.testing._internal.distributed.multi_threaded_pg  # noqa: F401  registers it

    dist.init_process_group("threaded", rank=0, world_size=1, store=dist.HashStore())
    knows = olmo_dist.backend_supports_cpu
    olmo_dist.backend_supports_cpu = lambda backend=None: (
        (backend or dist.get_backend()) == "threaded" or knows(backend)
    )


def record_pool_draws(model, on_draw: Callable[[int, object, int], None]) -> None:
    """Make every `EmoRouterV2` of `model` report each training call's draw tensor to
    `on_draw(layer, raw [B, T] int64, documents)`: OLMo-core's per-document `torch.randint`,
    rebuilt from the RNG state before the call and checked against the pools it used."""
    import torch
    from olmo_core.nn.moe.v2.emo_router import EmoRouterV2

    routers = [m for m in model.modules() if isinstance(m, EmoRouterV2)]
    for layer, router in enumerate(routers):
        original = router._pool_sizes

        def pool_sizes(segment_ids, router=router, layer=layer, original=original):
            state = torch.get_rng_state()
            pools = original(segment_ids)
            if router.training:
                generator = torch.Generator()
                generator.set_state(state)
                emo = router.emo
                raw = torch.randint(
                    emo.min_document_expert_pool,
                    emo.max_document_expert_pool + 1,
                    segment_ids.shape,
                    generator=generator,
                )
                assert torch.equal(raw.gather(1, segment_ids), pools), "draw not reproduced"
                on_draw(layer, raw, int(segment_ids.max()) + 1)
            return pools

        router._pool_sizes = pool_sizes


def _callbacks(snapshots: dict, states: dict, rows: dict, draws: list):
    from olmo_core.train.callbacks import Callback

    class Capture(Callback):
        """Params at SNAPSHOT_STEPS, the optimizer's state at STATE_STEPS, metrics every step,
        router draws of every training call."""

        def _state(self):
            model = unwrapped(self.trainer.train_module)
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

        def pre_train(self):
            snapshots[0] = self._state()
            record_pool_draws(
                unwrapped(self.trainer.train_module),
                lambda layer, raw, docs: draws.append((self.step, layer, raw, docs)),
            )

        def post_step(self):
            if self.step in SNAPSHOT_STEPS:
                snapshots[self.step] = self._state()
            if self.step in STATE_STEPS:
                states[self.step] = optimizer_state(self.trainer.train_module)

        def log_metrics(self, step, metrics):
            rows[step] = dict(metrics)

    return {"capture": Capture()}


def perturb_one_ulp(model, seed: int) -> None:
    """Every weight times 1 + s 2^-23, s uniform in {-1, 0, 1} (one ulp near 1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            sign = torch.randint(-1, 2, param.shape, generator=generator).to(param.dtype)
            param.mul_(1 + sign * 2.0**-23)


def train_module(cfg: Config):
    """OLMo-core's `OLMoDDPTrainModule` training the model of `cfg` on this CPU with its recipe
    (stand-ins installed, gloo process group, fp32), not yet attached to a `Trainer`."""
    import torch
    from olmo_core.nn.ddp.model import OLMoDDPModel
    from olmo_core.optim import ConstantWithWarmup, OLMoDDPOptimizerConfig, OptimGroupOverride
    from olmo_core.train.train_module import OLMoDDPTrainModuleConfig, TransformerDataParallelConfig

    from goldens.runtime.models import build

    train = cfg.train
    install()
    install_moe()
    init_process_group()
    OLMoDDPModel._training_dtype = torch.float32
    model = build(cfg.model)
    return OLMoDDPTrainModuleConfig(
        rank_microbatch_size=train.micro_batch_size * train.seq_len,
        max_sequence_length=train.seq_len,
        z_loss_multiplier=train.z_loss_weight,
        optim=OLMoDDPOptimizerConfig(
            lr=train.lr,
            betas=train.betas,
            eps=train.eps,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
            sigma_factor=int(train.skip_step_sigma),
            rolling_interval_length=train.skip_step_window,
            group_overrides=[
                OptimGroupOverride(
                    params=["*embeddings.weight"],
                    opts={"weight_decay": train.embedding_weight_decay},
                )
            ],
        ),
        dp_config=TransformerDataParallelConfig(name="ddp", only_allreduce_last_microbatch=True),
        scheduler=ConstantWithWarmup(warmup=train.warmup_steps),
    ).build(model, device=torch.device("cpu"))


def fit(
    cfg: Config, module, work: Path, *, steps: int, callbacks: dict, skip_before: int = 1
) -> None:
    """OLMo-core's `Trainer.fit` of `module` for `steps` steps on the data goldens' loader (files
    under `work`), metrics collected every step, no checkpoints; `callbacks` run after the one
    that reseeds torch's RNG before every step. Steps before `skip_before` draw their batch and
    do nothing else (OLMo-core's `steps_to_skip`)."""
    import torch
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.common import StepSkipRange

    class StepSeed(Callback):
        priority = 100

        def pre_step(self, batch):
            torch.manual_seed(STEP_SEED + self.step)

    token_files = list(write_token_files(cfg, work).values())
    loader = olmo_core_loader(cfg, token_files, work / "data")
    TrainerConfig(
        save_folder=str(work / "run"),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        no_checkpoints=True,
        device="cpu",
        cancel_check_interval=10_000,
        callbacks={"step_seed": StepSeed(), **callbacks},
        steps_to_skip=[StepSkipRange(1, skip_before)] if skip_before > 1 else None,
    ).build(module, loader).fit()


def _train(work: Path, perturb_seed: int | None = None):
    cfg = olmo_core(micro())
    module = train_module(cfg)
    if perturb_seed is not None:  # after the build, which initialises the weights
        perturb_one_ulp(module.model, perturb_seed)
    snapshots, states, rows, draws = {}, {}, {}, []
    fit(cfg, module, work, steps=STEPS, callbacks=_callbacks(snapshots, states, rows, draws))
    return cfg, snapshots, states, rows, draws


@dataclass(frozen=True)
class RegeneratedStep:
    """OLMo-core's step `step` run alone from the state after step - 1: the model's weights after
    it (`OLMoDDPModel.state_dict()`) and its metrics as `trace_metrics` names them ([1, ...])."""

    step: int
    params: dict[str, np.ndarray]
    metrics: dict[str, np.ndarray]


def regenerate_step(cfg: Config, state: dict[str, np.ndarray], step: int) -> RegeneratedStep:
    """OLMo-core's trace step `step` from `state` (goldens.train_state's, after step - 1): a
    train module built as the trace's, the state restored into it, and `Trainer.fit` to `step`
    with the steps before it skipped, so that the loader, the LR schedule and the reseed are at
    `step`. On the trace's own CPU it gives the trace's bits."""
    from olmo_core.train.callbacks import Callback

    module = train_module(cfg)
    restore_optimizer_state(module, state)
    params, rows = {}, {}

    class Capture(Callback):
        def post_step(self):
            if self.step == step:
                weights = unwrapped(self.trainer.train_module).state_dict()
                params.update({k: v.detach().numpy().copy() for k, v in weights.items()})

        def log_metrics(self, logged, metrics):
            rows[logged] = dict(metrics)

    with tempfile.TemporaryDirectory(prefix="goldens-step-") as tmp:
        fit(cfg, module, Path(tmp), steps=step, callbacks={"capture": Capture()}, skip_before=step)
    return RegeneratedStep(step, params, trace_metrics(rows, range(step, step + 1))[1])


def _block_metrics(rows: dict, steps: range, name: str) -> tuple[list[int], np.ndarray]:
    """Per-MoE-block metric `name`: (block indices, [steps, blocks])."""
    prefix, suffix = "train/block ", f"/{name}"
    blocks = sorted(
        int(k[len(prefix) : -len(suffix)])
        for k in rows[steps[0]]
        if k.startswith(prefix) and k.endswith(suffix)
    )
    values = [[rows[s][f"{prefix}{b:02d}{suffix}"] for b in blocks] for s in steps]
    return blocks, np.array(values, np.float64)


def _draw_tensor(draws: list, steps: range, ga: int) -> tuple[np.ndarray, int]:
    """Training draws of steps 1..N as [N, GA, MoE layers, b, D] uint8, D the most documents a
    row had (columns past it are never read)."""
    kept = [d for d in draws if d[0] >= steps[0]]
    documents = max(d[3] for d in kept)
    layers = max(d[1] for d in kept) + 1
    out = np.stack([d[2][:, :documents].numpy() for d in kept]).astype(np.uint8)
    return out.reshape(len(steps), ga, layers, *out.shape[1:]), documents


def trace_metrics(rows: dict, steps: range) -> tuple[list[int], dict[str, np.ndarray]]:
    """Every METRICS entry [steps] and the per-block aux losses [steps, blocks]."""
    tensors = {
        name: np.array([rows[s][key] for s in steps], np.float64) for name, key in METRICS.items()
    }
    blocks, tensors["lb_loss_per_block"] = _block_metrics(rows, steps, "load balancing loss")
    _, tensors["router_z_loss_per_block"] = _block_metrics(rows, steps, "router Z loss")
    return blocks, tensors


def _perturbed(golden_snapshots: dict, golden_states: dict, steps: range) -> dict[str, np.ndarray]:
    """The perturbed runs' metrics ([runs, ...] each), at the snapshot steps after 0 the distance
    of each param to the golden run's, |p - p_golden| / |p_golden| [runs, params], and at
    STATE_STEPS that of each optimizer state tensor (by norms) [runs, state tensors]."""
    runs = []
    for seed in PERTURBED_SEEDS:
        with tempfile.TemporaryDirectory(prefix="goldens-trace-") as tmp:
            _, snapshots, states, rows, _ = _train(Path(tmp), perturb_seed=seed)
        _, tensors = trace_metrics(rows, steps)
        for step in SNAPSHOT_STEPS[1:]:
            golden = golden_snapshots[step]
            tensors[f"params_rel_diff_step{step}"] = np.array(
                [float((snapshots[step][k] - v).norm() / v.norm()) for k, v in golden.items()]
            )
        for step in STATE_STEPS:
            golden = golden_states[step]
            tensors[f"state_rel_diff_step{step}"] = np.array(
                [norm_gap(states[step][k], v) for k, v in golden.items()]
            )
        runs.append(tensors)
    return {name: np.stack([run[name] for run in runs]) for name in runs[0]}


def export() -> list[GoldenFile]:
    with tempfile.TemporaryDirectory(prefix="goldens-trace-") as tmp:
        cfg, snapshots, states, rows, draws = _train(Path(tmp))
    steps = range(1, STEPS + 1)
    blocks, tensors = trace_metrics(rows, steps)
    tensors["pool_draws"], documents = _draw_tensor(draws, steps, cfg.train.ga_steps)
    common = {
        "producer": "olmo_core.train.Trainer with OLMoDDPModel, OLMoDDPTrainModule, "
        "OLMoDDPOptimizer, NumpyFSLDataLoader",
        "seeds": {"init": cfg.train.init_seed, "data": cfg.train.data_seed, "step_seed": STEP_SEED},
        "tolerances": {"regenerate": REGENERATE_TRACE.as_dict()},
        "substitutions": [
            *SUBSTITUTIONS,
            *MOE_SUBSTITUTIONS,
            *RUNTIME,
            PROCESS_GROUP,
        ],
    }
    files = [
        GoldenFile(
            path=f"{DIR}/metrics.safetensors",
            tensors=tensors,
            config={
                "config": run_config(cfg),
                "steps": STEPS,
                "metrics": METRICS,
                "moe_blocks": blocks,
                "pool_draws": "[step, micro-batch, MoE layer, row, document]: OLMo-core's draw "
                f"tensor's first {documents} columns (document d of a row uses column d)",
                "step_seed": f"torch.manual_seed({STEP_SEED} + step) before each step",
            },
            **common,
        )
    ]
    files.append(
        GoldenFile(
            path=f"{DIR}/perturbed.safetensors",
            tensors=_perturbed(snapshots, states, steps),
            config={
                "seeds": list(PERTURBED_SEEDS),
                "perturbation": "every step-0 weight times 1 + s 2^-23, s uniform in {-1, 0, 1} "
                "(torch.Generator().manual_seed(seed), parameters in model order)",
                "metrics": "as trace/metrics.safetensors, one row per seed",
                "params": list(snapshots[0]),
                "state": list(states[STATE_STEPS[0]]),
            },
            **common,
        )
    )
    for step in SNAPSHOT_STEPS:
        files.append(
            GoldenFile(
                path=f"{DIR}/params_step{step}.safetensors",
                tensors={k: v.numpy() for k, v in snapshots[step].items()},
                config={"step": step, "names": "OLMoDDPModel.state_dict()"},
                **common,
            )
        )
    for step in STATE_STEPS:
        files.append(
            GoldenFile(
                path=f"{DIR}/state_step{step}.safetensors",
                tensors=states[step],
                config={
                    "step": step,
                    "names": "OLMoDDPOptimizer.states without DDP's 'module.': <param>.main "
                    "(the fp32 weight, flat), .exp_avg, .exp_avg_sq (flat), .step; and the skip "
                    f"rule's {LOSSES} and {GRAD_NORMS}, oldest first",
                    "regenerates": f"step {step + 1} alone (goldens.trace.regenerate_step)",
                },
                **common,
            )
        )
    return files
