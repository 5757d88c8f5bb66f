"""`python -m parity.train` (`olmo-parity train`): train the model for N steps on OLMo-core's token
files, on one device or a mesh, on this CPU or a TPU; Orbax checkpoints and a bit-exact resume.

The step is free-running's (`parity.run.train_step`, compiled by `model.state`, the state's
buffers donated): the micro config trained from the trace's step-0 weights on the trace's data
gives free-running's numbers bit for bit. Data and EMO draws: `parity.train_data`. Each step
prints a line (step, CE, LB loss, grad norm, tokens/s, and on a TPU the fraction of the chips'
bfloat16 peak) and appends every metric to `<out>/metrics.jsonl`; `<out>/curves.png` plots them
at the end.

Checkpoints (`parity.checkpoint`, orbax-checkpoint): the params, Adam's moments and count, the
skip rule's history and the step (the `TrainState`), the run's key, and as JSON the config, the
data files and the data position. Saved as the mesh lays them out, restorable onto any other mesh.
`--resume` continues from the newest complete checkpoint: N steps straight and k steps, a
restart and N - k steps give the same params and moments bit for bit on the same mesh. A directory
that holds checkpoints is never written without `--resume`.

A step whose CE or grad norm is NaN or infinite is skipped where OLMo-core's skip rule skips it
(`model.optim`); `--max-nonfinite` such steps in a row stop the run, naming the first of them.

Starting points (`--init`): the trace's step-0 weights ("trace", the micro config's default), a
fresh init from `TrainConfig.init_seed` ("random"), or OLMo-core's params as a safetensors state
dict (a path); or OLMo-core's whole training state after some step (`--init-state`, the format
the trace keeps, `parity.olmo_core_state`). `--export-olmo-core` writes the final params under
OLMo-core's names. OLMo-core's own distributed checkpoints are not read: their metadata is
pickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from model import train_step as ts
from model.config import MATMUL_PRECISIONS, Config, micro, olmo35_slice, olmo35_tiny, olmo_core
from model.convert import from_olmo_core
from model.flops import fraction_of_peak
from model.state import abstract_params, abstract_state, init_train_state, make_model, placed
from parity import checkpoint
from parity.faults import InjectedFault
from parity.olmo_core_state import export_params, load_training_state, train_state
from parity.run import (
    PLATFORMS,
    MeshShape,
    Metrics,
    Run,
    plain_metrics,
    run_mesh,
    train_step,
    use_platform,
)
from parity.trace import bundled_data, load_trace
from parity.train_data import DataFiles, TrainData

PRESETS: dict[str, Callable[[], Config]] = {
    "micro": lambda: olmo_core(micro()),
    "slice": lambda: olmo_core(olmo35_slice()),
    "slice-16": lambda: olmo_core(olmo35_slice(16)),
    "hero": lambda: olmo_core(olmo35_tiny()),
}
"""The configs `--config` names, each with OLMo-core's flags: the micro config of the goldens, the
hero-width slices of one TPU chip (4 blocks, and the hero's 16), the hero."""
HERO_DEVICES = 1024
"""The hero is laid out on a TPU v4 8x8x16 pod (fsdp 256 x expert 4, docs/tpu_memory.md)."""
METRICS_FILE, CURVES_FILE = "metrics.jsonl", "curves.png"


class TrainingError(RuntimeError):
    """A run that cannot go on: its losses keep coming out NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    directory: Path
    save_every: int | None = None
    """Save after every this many steps (None: only after the last)."""
    keep: int = 3
    resume: bool = False

    def __post_init__(self):
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"--save-every must be >= 1, got {self.save_every}")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1, got {self.keep}")

    def saves_at(self, step: int, last: int) -> bool:
        return step == last or (self.save_every is not None and step % self.save_every == 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run: `steps` is the last step (from 1); `data` None trains on synthetic tokens."""

    config: Config
    steps: int
    data: DataFiles | None
    mesh: MeshShape = dataclasses.field(default_factory=MeshShape)
    init: str = "random"
    """"trace", "random", or the path of OLMo-core params (safetensors)."""
    init_state: Path | None = None
    init_step: int | None = None
    checkpoints: Checkpointing | None = None
    out: Path | None = None
    seed: int = 0
    """The key of the EMO draws the trace does not supply."""
    max_nonfinite: int = 3
    export: Path | None = None
    fault: InjectedFault | None = None
    """Tests only (`parity.faults`)."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.max_nonfinite < 1:
            raise ValueError(f"--max-nonfinite must be >= 1, got {self.max_nonfinite}")
        if (self.init_state is None) != (self.init_step is None):
            raise ValueError("--init-state and --init-step go together")
        if self.init_step is not None and not 0 <= self.init_step < self.steps:
            raise ValueError(f"--init-step must lie in 0..{self.steps - 1}, got {self.init_step}")

    @property
    def run(self) -> Run:
        return Run(self.config, mesh=self.mesh, fault=self.fault)

    def checkpoint_config(self) -> dict:
        """What a checkpoint must have been made with to be resumed by this plan: the config
        (the global-indices path aside, a machine's), the data files and the seed."""
        config = self.config.as_dict()
        config["flags"].pop("olmo_global_indices_path")
        data = "synthetic" if self.data is None else self.data.identity()
        return {**config, "data": data, "seed": self.seed}


def plan_mesh(plan: Plan):
    """The plan's mesh (None: one device), checked against the config."""
    experts, expert = plan.config.model.moe.num_experts, plan.mesh.expert
    if experts % expert:
        raise ValueError(
            f"--mesh {plan.mesh}: the {experts} routed experts do not split over expert={expert}"
        )
    return run_mesh(plan.run)


def initial_state(plan: Plan, mesh) -> ts.TrainState:
    """The plan's starting point laid out on `mesh` (None: one device)."""
    cfg = plan.config
    if plan.init_state is not None:
        template = abstract_params(cfg)[1]
        before = load_training_state(plan.init_state, cfg.model)
        return placed(train_state(before, template, cfg, plan.init_step), cfg, mesh)
    if plan.init == "random":
        if mesh is not None:
            return init_train_state(cfg, mesh)[1]
        return placed(ts.init_state(nnx.state(make_model(cfg)), cfg), cfg, None)
    weights = load_trace().params(0) if plan.init == "trace" else _read_params(Path(plan.init))
    params = nnx.state(from_olmo_core(weights, cfg.model, flags=cfg.flags))
    return placed(ts.init_state(params, cfg), cfg, mesh)


def _read_params(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"--init {path}: no such file")
    return safetensors.numpy.load_file(path)


def restore_checkpoint(plan: Plan, mesh, step: int) -> tuple[ts.TrainState, jax.Array, dict]:
    """The plan's checkpoint of `step` laid out on `mesh` (None: one device): (state, the run's
    key, its meta), after `parity.checkpoint.restore`'s checks."""
    target = {
        "state": abstract_state(plan.config, mesh),
        "key": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=_replicated(plan, mesh)),
    }
    cp = plan.checkpoints
    arrays, meta = checkpoint.restore(cp.directory, step, target, config=plan.checkpoint_config())
    return arrays["state"], jax.random.wrap_key_data(arrays["key"]), meta


def _replicated(plan: Plan, mesh):
    """Where the run's key lies: as the state's step count (replicated, or the one device)."""
    return abstract_state(plan.config, mesh).step.sharding


def save_checkpoint(plan: Plan, step: int, state: ts.TrainState, key: jax.Array) -> Path:
    """`state` and the run's key after `step` steps into the plan's checkpoint folder, with
    what `checkpoint_config` names, the mesh and the data position: the tokens of the `step`
    global batches read (OLMo-core's loader state, `tokens_processed`)."""
    train = plan.config.train
    meta = {
        "config": plan.checkpoint_config(),
        "step": step,
        "tokens_processed": step * train.global_batch_size * train.seq_len,
        "mesh": str(plan.mesh),
    }
    arrays = {"state": state, "key": jax.random.key_data(key)}
    cp = plan.checkpoints
    return checkpoint.save(cp.directory, step, arrays, meta, keep=cp.keep)


def _start(plan: Plan, mesh) -> tuple[ts.TrainState, jax.Array, int]:
    """(state, key, steps done): restored from the newest checkpoint with --resume, else
    the plan's starting point."""
    cp = plan.checkpoints
    if cp is not None:
        saved = checkpoint.steps(cp.directory)
        if saved and not cp.resume:
            raise checkpoint.CheckpointError(
                f"{cp.directory} holds checkpoints of steps {saved}: pass --resume to continue "
                "from the newest, or give another --checkpoint-dir"
            )
        if cp.resume:
            if not saved:
                raise checkpoint.CheckpointError(
                    f"--resume: {cp.directory} holds no complete checkpoint"
                )
            state, key, meta = restore_checkpoint(plan, mesh, saved[-1])
            return state, key, meta["step"]
    state = initial_state(plan, mesh)
    key = jax.device_put(jax.random.key(plan.seed), _replicated(plan, mesh))
    return state, key, int(state.step)


def _on_trace_data(plan: Plan) -> bool:
    """Whether the plan trains on the golden trace's data in its shapes (so takes its draws)."""
    micro_cfg = PRESETS["micro"]()
    if plan.data is None or (plan.config.model, plan.config.train) != (
        micro_cfg.model,
        micro_cfg.train,
    ):
        return False
    tokens, indices = bundled_data()
    return plan.data.tokens == tuple(tokens) and plan.data.global_indices in (indices, None)


def _row(step: int, data: TrainData, metrics: Metrics, seconds: float, plan: Plan) -> dict:
    epoch, batch = data.position(step)
    train = plan.config.train
    tokens = train.global_batch_size * train.seq_len
    kind = jax.devices()[0].device_kind
    peak = fraction_of_peak(plan.config, seconds, kind)
    return {
        "step": step,
        "epoch": epoch,
        "batch": batch,
        "draws": data.draws_source(step),
        **metrics,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "fraction_of_peak": None if peak is None else peak / plan.mesh.devices,
    }


def progress_line(row: dict, last: int) -> str:
    """One step's line: step, CE, LB loss, grad norm, tokens/s (and MFU on a TPU)."""
    line = (
        f"step {row['step']:>{len(str(last))}}/{last}  CE {row['ce']:.4f}  "
        f"LB {row.get('lb_loss', 0.0):.4f}  grad norm {row['grad_norm']:.4f}  "
        f"{row['tokens_per_s']:,.0f} tok/s"
    )
    if row["fraction_of_peak"] is not None:
        line += f"  {row['fraction_of_peak']:.1%} of peak"
    if row["skipped"]:
        line += "  skipped"
    return line


def _finite(row: dict) -> bool:
    return math.isfinite(row["ce"]) and math.isfinite(row["grad_norm"])


def _metrics_file(out: Path | None, done: int):
    """`<out>/metrics.jsonl` open for appending, its rows past step `done` dropped (the steps
    a killed run took after its last checkpoint)."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / METRICS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= done))
    return path.open("a")


def plot_curves(out: Path) -> Path:
    """`<out>/curves.png`: CE, LB loss and grad norm of every step in `<out>/metrics.jsonl`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    names = [n for n in ("ce", "lb_loss", "grad_norm") if n in rows[0]]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ax.plot([r["step"] for r in rows], [r[name] for r in rows])
        ax.set_xlabel("step")
        ax.set_title(name)
    fig.tight_layout()
    path = out / CURVES_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def train(plan: Plan, *, log: Callable[[str], None] = print) -> tuple[ts.TrainState, list[dict]]:
    """Run `plan`. Returns the final state and the rows of the steps this call took."""
    cfg, mesh = plan.config, plan_mesh(plan)
    graphdef = abstract_params(cfg)[0]
    state, key, done = _start(plan, mesh)
    if done >= plan.steps:
        log(f"step {done} is done already: nothing to train up to --steps {plan.steps}")
        return state, []
    trace = load_trace() if _on_trace_data(plan) else None
    data = TrainData(cfg, plan.data, key=key, trace=trace)
    sink = _metrics_file(plan.out, done)
    rows, nonfinite = [], []
    try:
        for step in range(done + 1, plan.steps + 1):
            batch = jax.tree.map(jnp.asarray, data.batch(step))
            start = time.perf_counter()
            state, out = train_step(plan.run, graphdef, state, batch)
            row = _row(step, data, plain_metrics(out), time.perf_counter() - start, plan)
            rows.append(row)
            log(progress_line(row, plan.steps))
            if sink is not None:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            nonfinite = [] if _finite(row) else [*nonfinite, step]
            if len(nonfinite) >= plan.max_nonfinite:
                raise TrainingError(
                    f"steps {nonfinite[0]}-{step}: CE or grad norm NaN or infinite "
                    f"{len(nonfinite)} steps in a row, from step {nonfinite[0]}"
                )
            cp = plan.checkpoints
            if cp is not None and cp.saves_at(step, plan.steps) and not nonfinite:
                log(f"saved {save_checkpoint(plan, step, state, key)}")
    finally:
        if sink is not None:
            sink.close()
    if plan.out is not None:
        log(f"wrote {plan.out / METRICS_FILE} and {plot_curves(plan.out)}")
    if plan.export is not None:
        export_params(state.params, cfg.model, plan.export)
        log(f"wrote OLMo-core's params to {plan.export}")
    return state, rows


def parser(prog: str = "python -m parity.train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=list(PRESETS), default="micro", help="the preset")
    parser.add_argument("--steps", type=int, required=True, help="the last step to train")
    parser.add_argument(
        "--mesh",
        type=MeshShape.argument,
        default=MeshShape(),
        help="data=D,fsdp=F,expert=E (default: one device)",
    )
    parser.add_argument("--platform", choices=PLATFORMS, default="cpu")
    parser.add_argument(
        "--matmul-precision",
        choices=MATMUL_PRECISIONS,
        default=None,
        help="ScaleConfig.matmul_precision (default: the config's)",
    )
    parser.add_argument(
        "--tokens",
        type=Path,
        nargs="+",
        default=None,
        help="OLMo-core token files (default: the bundled corpus the trace trained on)",
    )
    parser.add_argument(
        "--global-indices",
        type=Path,
        default=None,
        help="OLMo-core's global-indices file of the first epoch (default: the bundled one with "
        "the bundled corpus at the micro config's sequence length, else OLMo-core's order for "
        "TrainConfig.data_seed); later epochs are shuffled as OLMo-core's loader shuffles them",
    )
    parser.add_argument(
        "--token-dtype",
        choices=("uint8", "uint16", "uint32", "uint64"),
        default=None,
        help="the token files' dtype (default: OLMo-core's for the vocab; the bundled corpus: "
        "uint16)",
    )
    parser.add_argument("--synthetic", action="store_true", help="random tokens, no files")
    parser.add_argument(
        "--init",
        default=None,
        help="trace (the trace's step-0 weights; the micro config's default), random (the "
        "other configs' default) or the path of OLMo-core params as safetensors",
    )
    parser.add_argument(
        "--init-state",
        type=Path,
        default=None,
        help="OLMo-core's whole training state after --init-step steps (safetensors, as the "
        "trace keeps it: goldens/trace/state_step49.safetensors)",
    )
    parser.add_argument("--init-step", type=int, default=None)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--keep", type=int, default=3, help="complete checkpoints kept (3)")
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    parser.add_argument("--out", type=Path, default=Path("train"), help="metrics and curves")
    parser.add_argument("--seed", type=int, default=0, help="the EMO draws' key")
    parser.add_argument("--max-nonfinite", type=int, default=3)
    parser.add_argument(
        "--export-olmo-core", type=Path, default=None, help="the final params, OLMo-core's names"
    )
    return parser


def _data(args: argparse.Namespace, cfg: Config) -> DataFiles | None:
    if args.synthetic:
        if args.tokens or args.global_indices or args.token_dtype:
            raise ValueError("--synthetic takes no --tokens, --global-indices or --token-dtype")
        return None
    if args.tokens is None:
        tokens, indices = bundled_data()
        if args.global_indices is None and cfg.train.seq_len == micro().train.seq_len:
            args.global_indices = indices
        return DataFiles(tuple(tokens), args.global_indices, args.token_dtype or "uint16")
    return DataFiles(tuple(args.tokens), args.global_indices, args.token_dtype)


def plan_of(args: argparse.Namespace) -> Plan:
    cfg = PRESETS[args.config]()
    if args.matmul_precision is not None:
        scale = dataclasses.replace(cfg.scale, matmul_precision=args.matmul_precision)
        cfg = dataclasses.replace(cfg, scale=scale)
    if args.config == "hero" and args.mesh.devices < HERO_DEVICES:
        raise ValueError(
            f"the hero trains on a pod of {HERO_DEVICES} TPU chips (docs/tpu_memory.md); on "
            f"{args.mesh.devices} it is only compiled ahead of time: `tox -e tpu-aot`"
        )
    if args.init is not None and args.init_state is not None:
        raise ValueError("--init and --init-state: give one starting point")
    if args.init == "trace" and args.config != "micro":
        raise ValueError("--init trace: the trace's weights are the micro config's")
    checkpoints = None
    if args.checkpoint_dir is not None:
        checkpoints = Checkpointing(args.checkpoint_dir, args.save_every, args.keep, args.resume)
    elif args.save_every is not None or args.resume:
        raise ValueError("--save-every and --resume need --checkpoint-dir")
    default_init = "trace" if args.config == "micro" else "random"
    return Plan(
        config=cfg,
        steps=args.steps,
        data=_data(args, cfg),
        mesh=args.mesh,
        init=args.init or default_init,
        init_state=args.init_state,
        init_step=args.init_step,
        checkpoints=checkpoints,
        out=args.out,
        seed=args.seed,
        max_nonfinite=args.max_nonfinite,
        export=args.export_olmo_core,
    )


def _describe(data: DataFiles | None) -> str:
    if data is None:
        return "synthetic tokens"
    order = "its global-indices file" if data.global_indices else "OLMo-core's order"
    return f"{len(data.tokens)} token files ({data.tokens[0].parent}), {order}"


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_of(args)
        use_platform(args.platform, plan.mesh.devices)
        device = jax.devices(args.platform)[0].device_kind
        print(
            f"train: {args.config} to step {plan.steps} on mesh {plan.mesh} ({device}), "
            f"{_describe(plan.data)}; the first step compiles."
        )
        train(plan)
    except (ValueError, FileNotFoundError, TrainingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
