"""`python -m bench.tpu_memory [--config hero|micro] [--variants NAME ...] [--remat POLICY ...]
[--jobs N]`: the hero's
whole train step compiled for a TPU topology on this CPU, without a TPU (deviceless ahead-of-time
compilation, as MaxText's `train_compile.py`), and its per-device memory as XLA's TPU compiler
plans it.

The seed's setup: `olmo35_tiny`, seq 8192, 2,048 sequences a step, GA 2; v4 8x8x16 megacore (1,024
devices), expert 4 x fsdp 256, one sequence per device per micro-batch; dropless MoE; bfloat16
activations, float32 params and Adam state. Four variants: flat or seq-major vocab tiling, with or
without the GA params loop barrier, beside the seed's 49.9 / 26.3 / 44.3 GB temporaries. A variant
that needs more than the chip's HBM does not compile: the compiler's error gives its temporaries,
and the arguments and outputs come from the shardings. For each variant, what holds the most
memory at the compiler's peak (the ops of its live-range report), and the collectives flat's
program has and seq-major's has not (from the optimized HLO). Then one line per remat policy.

Run by `tox -e tpu-aot` (its own environment, with libtpu), which writes `docs/tpu_memory.json`
and `docs/tpu_memory.md`; `--config micro` is the same on v4 2x2x1 in a few minutes. Each compile
runs in a process of its own, mostly on one core, `--jobs` at a time (CI: the micro config's 2).
`--variants` compiles only those named (flat among them, the others' baseline; CI: flat and
seq-major, as the loop barrier changes no lowering the CPU's compiles do not see).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp

from model import config as c
from model import train_step as ts
from model.layout import layout_of, make_mesh, with_shardings
from model.state import abstract_params, compiled_train_step, state_shardings
from parity.tpu_topology import tpu_devices

GIB = 2**30
HBM_GIB = 32
"""HBM of one TPU v4 chip."""
SEED_GB = {"flat": 49.9, "seq-major": 26.3, "flat + barrier": 44.3}
"""The seed's temporaries on v4 8x8x16 (the MaxText PR)."""
GA_STEPS = 2
DOCS = Path(__file__).resolve().parents[1] / "docs"
PEAK_OPS = 6
"""How many of the ops holding the most memory at the peak each variant reports."""
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
REMOVED = 4
"""How many of the collectives flat has and seq-major has not the report names."""
JIT_PREFIX = "jit(train_step)/while/body/closed_call/"
HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
"""Bytes of one element of each HLO element type the train step has."""
LOOP_STATE = "wide."
"""How XLA names the GA loop's (a while loop's) parameters."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU topology, the (fsdp, expert) mesh over its devices and the config trained on it."""

    topology: str
    fsdp: int
    expert: int
    config: str
    vocab_tiles: int
    remat: str

    def devices(self):
        return tpu_devices(self.topology)


TARGETS = {
    "hero": Target(
        "v4:8x8x16", fsdp=256, expert=4, config="olmo35_tiny", vocab_tiles=8, remat="full"
    ),
    "micro": Target("v4:2x2x1", fsdp=2, expert=2, config="micro", vocab_tiles=2, remat="full"),
}
VARIANTS = {
    "flat": (False, False),
    "seq-major": (True, False),
    "flat + barrier": (False, True),
    "seq-major + barrier": (True, True),
}
"""name: (Flags.vocab_tiling_seq_major, Flags.ga_params_loop_barrier)."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of one compiled train step: XLA's arguments, outputs, aliased (donated)
    and temporaries, and its peak (None when it did not compile: XLA's TPU compiler refuses a
    program over the chip's HBM, and its error gives the temporaries)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int | None
    seconds: float
    peak_ops: tuple[tuple[str, int], ...]
    collectives: tuple[tuple[str, str, str, int], ...]
    """Every collective of the optimized program: (kind, JAX op, result shape, bytes)."""

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def fits(self) -> bool:
        return self.peak is not None


def step_config(target: Target, *, seq_major: bool, barrier: bool, remat: str) -> c.Config:
    """The target's config as the seed trained it: GA 2, one sequence per device per micro-batch,
    bfloat16 activations, OLMo-core's flags but the two under test."""
    cfg = c.olmo_core(getattr(c, target.config)())
    devices = target.fsdp * target.expert
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, compute_dtype="bfloat16"),
        train=dataclasses.replace(
            cfg.train,
            ga_steps=GA_STEPS,
            global_batch_size=GA_STEPS * devices,
            vocab_tiles=target.vocab_tiles,
        ),
        flags=dataclasses.replace(
            cfg.flags, vocab_tiling_seq_major=seq_major, ga_params_loop_barrier=barrier
        ),
        scale=dataclasses.replace(cfg.scale, remat_policy=remat),
    )


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def _peak_ops(dump: Path) -> tuple[tuple[str, int], ...]:
    """The ops holding the most bytes at the peak (the leaves of the compiler's live-range
    report's peak breakdown, the bytes each holds), largest first."""
    reports = sorted(
        dump.glob("*after_optimizations-live-range.txt"), key=lambda p: p.stat().st_size
    )
    if not reports:
        return ()
    text = reports[-1].read_text()  # the train step's; smaller modules may be dumped beside it
    start = text.find("Stack trace breakdown for peak usage")
    held = re.findall(
        r"[├└]── (.+?) \(\S+, total: [\d ]+ bytes, current: ([\d ]+) bytes", text[start:]
    )
    merged: dict[str, int] = {}
    for name, size in held:
        key = re.sub(r"\{\d+\}$", "", name.removeprefix(JIT_PREFIX))
        if key.startswith(LOOP_STATE):
            key = "the GA loop's carried state (params, summed gradients)"
        merged[key] = merged.get(key, 0) + int(size.replace(" ", ""))
    return tuple(sorted(merged.items(), key=lambda kv: -kv[1])[:PEAK_OPS])


def _collectives(dump: Path) -> tuple[tuple[str, str, str, int], ...]:
    """The collectives of the optimized train step's HLO (its largest dumped module): kind, the
    JAX op each came from ("" when XLA's SPMD partitioner made it), result shape, bytes (of an
    async start, its result; of a combined collective, all of its results)."""
    programs = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not programs:
        return ()
    found = []
    for line in programs[-1].read_text().splitlines():
        op = re.search(rf"= (.+?) ({'|'.join(COLLECTIVES)})(-start)?\(", line)
        if op is None:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", op.group(1))
        shapes = shapes[-1:] if op.group(3) else shapes
        size = sum(
            math.prod(int(d) for d in dims.split(",") if d) * HLO_ITEMSIZE[dtype]
            for dtype, dims in shapes
        )
        name = re.search(r'op_name="([^"]+)"', line)
        shape = ", ".join(f"{dtype}[{dims}]" for dtype, dims in shapes)
        found.append(
            (op.group(2), name.group(1).removeprefix(JIT_PREFIX) if name else "", shape, size)
        )
    return tuple(found)


def compile_step(cfg: c.Config, mesh) -> Memory:
    """Lower and compile `cfg`'s train step for `mesh`'s devices, donating the state."""
    layout = layout_of(cfg, mesh)
    graphdef, params = abstract_params(cfg)
    shardings = state_shardings(cfg, layout, params)
    state = with_shardings(jax.eval_shape(lambda p: ts.init_state(p, cfg), params), shardings)
    rows = cfg.train.micro_batch_size
    on_rows = layout.micro_batch_sharding(rows)
    tokens = jax.ShapeDtypeStruct((GA_STEPS, rows, cfg.train.seq_len), jnp.int32, sharding=on_rows)
    draws = (GA_STEPS, rows, len(cfg.model.moe_layers), cfg.train.seq_len)
    batch = {
        "inputs": tokens,
        "labels": tokens,
        "inputs_segmentation": tokens,
        "pool_draws": jax.ShapeDtypeStruct(draws, jnp.int32, sharding=on_rows),
    }
    step = compiled_train_step(cfg, graphdef, mesh, donate=True)
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    arguments = _shard_bytes((state, batch))
    with tempfile.TemporaryDirectory() as dump:
        try:
            stats = lowered.compile(compiler_options={"xla_dump_to": dump}).memory_analysis()
        except jax.errors.JaxRuntimeError as error:
            found = re.search(r"HLO temporaries \(([\d.]+)G\)", str(error))
            if found is None:
                raise
            state_bytes = _shard_bytes(state)
            return Memory(
                arguments=arguments,
                outputs=state_bytes,
                aliased=state_bytes,
                temporaries=int(float(found.group(1)) * GIB),
                peak=None,
                seconds=time.perf_counter() - start,
                peak_ops=_peak_ops(Path(dump)),
                collectives=_collectives(Path(dump)),
            )
        return Memory(
            arguments=stats.argument_size_in_bytes,
            outputs=stats.output_size_in_bytes,
            aliased=stats.alias_size_in_bytes,
            temporaries=stats.temp_size_in_bytes,
            peak=stats.peak_memory_in_bytes,
            seconds=time.perf_counter() - start,
            peak_ops=_peak_ops(Path(dump)),
            collectives=_collectives(Path(dump)),
        )


def compile_variant(name: str, variant: str, remat: str) -> Memory:
    """One variant of `name`'s train step with `remat`, compiled in this process."""
    target = TARGETS[name]
    mesh = make_mesh(fsdp=target.fsdp, expert=target.expert, devices=target.devices())
    seq_major, barrier = VARIANTS[variant]
    return compile_step(
        step_config(target, seq_major=seq_major, barrier=barrier, remat=remat), mesh
    )


def _in_child(name: str, variant: str, remat: str) -> dict:
    """`compile_variant` in a fresh process (a hero compile takes 13 GB of host memory that the
    allocator keeps): its record, read from the JSON the child prints last."""
    command = [sys.executable, "-m", "bench.tpu_memory", "--config", name]
    done = subprocess.run(
        [*command, "--compile", variant, remat], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"compiling {variant} (remat {remat}) failed:\n{done.stderr[-4000:]}")
    record = json.loads(done.stdout.splitlines()[-1])
    print(f"{variant}, remat {remat}: {_gib(record['temporaries'])} temporaries", flush=True)
    return record


def _hidden_state_bytes(target: Target) -> int:
    """Bytes of one micro-batch's hidden states [rows, seq, d_model] in the compute dtype."""
    cfg = step_config(target, seq_major=False, barrier=False, remat=target.remat)
    rows, seq, d = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.d_model
    return rows * seq * d * jnp.dtype(cfg.model.compute_dtype).itemsize


def measure(
    name: str, remats: list[str], jobs: int = 1, variants: tuple[str, ...] = tuple(VARIANTS)
) -> dict:
    """`variants` (each of VARIANTS by default) with the target's remat policy, then seq-major
    with each of `remats`, `jobs` compiles at a time (each in a process of its own, mostly on one
    core)."""
    target = TARGETS[name]
    runs = [(v, target.remat) for v in VARIANTS if v in variants]
    runs += [("seq-major", r) for r in remats if r != target.remat]
    with ThreadPoolExecutor(jobs) as pool:
        done = dict(zip(runs, pool.map(lambda run: _in_child(name, *run), runs), strict=True))
    compiled = {v: done[v, target.remat] for v in VARIANTS if v in variants}
    policies = {r: done["seq-major", r] for r in remats}
    return {
        "config": name,
        "target": dataclasses.asdict(target),
        "devices": target.fsdp * target.expert,
        "variants": compiled,
        "remat": policies,
        "hidden_state_bytes": _hidden_state_bytes(target),
        "peak_host_memory_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB,
    }


def _record(m: Memory) -> dict:
    return {
        **dataclasses.asdict(m),
        "peak_ops": [list(op) for op in m.peak_ops],
        "collectives": [list(op) for op in m.collectives],
        "total": m.total,
        "fits": m.fits,
    }


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _op_label(op: str) -> str:
    """A peak op as the report shows it: a JAX op's name, or an XLA instruction's marked so."""
    return f"`{op}`" if "/" in op or " " in op else f"`{op}` (made by XLA, no JAX op)"


def _peak(m: dict) -> str:
    return "-" if m["peak"] is None else _gib(m["peak"])


def _removed(record: dict) -> list[tuple[str, str, str, int]]:
    """The collectives flat's program has and seq-major's has not (same kind, JAX op and shape),
    largest first."""
    flat, seq = (
        collections.Counter(map(tuple, record["variants"][v]["collectives"]))
        for v in ("flat", "seq-major")
    )
    return sorted((flat - seq).elements(), key=lambda op: -op[3])


def _removed_lines(record: dict) -> list[str]:
    """Report lines for the largest of `_removed`; one the size of the micro-batch's hidden
    states is named so."""
    lines = []
    for kind, op, shape, size in _removed(record)[:REMOVED]:
        made = f"from `{op}`" if op else "made by XLA's SPMD partitioner"
        whole = (
            ": the whole micro-batch's hidden states on every device"
            if size == record["hidden_state_bytes"]
            else ""
        )
        lines.append(f"- {kind} {made}, {shape}, {_gib(size)}{whole}")
    return lines or ["- none"]


def _why(record: dict) -> str:
    """Why the hero's ratios differ from the seed's, from the record."""
    v = record["variants"]
    flat, seq = v["flat"]["temporaries"], v["seq-major"]["temporaries"]
    barrier = v["flat + barrier"]["temporaries"] - flat
    removed = sum(op[3] for op in _removed(record))
    return (
        f"Seq-major's saving is the collectives below ({_gib(removed)} of results, not all live "
        "at once); what fraction of flat's temporaries that is depends on what else is live. "
        "What seq-major keeps is mostly the MoE's (the ops at its peak, below): "
        f"{_gib(seq)} of temporaries here against the seed's {SEED_GB['seq-major']} GB, so the "
        "same saving is a "
        f"{'larger' if seq < SEED_GB['seq-major'] * 1e9 else 'smaller'} fraction. The loop "
        "barrier keeps work on the params alone inside the GA loop. It changes flat's "
        f"temporaries by {barrier / GIB:+.2f} GiB here: flat's peak is the hidden states' "
        "collectives, which depend on the micro-batch, so XLA never hoists them."
    )


def _ratios(record: dict) -> list[str]:
    """The line of the compiled variants' temporaries against flat's and the seed's ratios (and,
    for the hero with every variant, why they differ); none when flat alone was compiled."""
    variants = record["variants"]
    flat, seed = variants["flat"]["temporaries"], SEED_GB["flat"]
    against = {"seq-major": "seq-major", "flat + barrier": "the loop barrier"}
    shown = [v for v in against if v in variants]
    if not shown:
        return []
    ours = ", ".join(f"{against[v]} {variants[v]['temporaries'] / flat:.2f}x" for v in shown)
    seeds = " and ".join(f"{SEED_GB[v] / seed:.2f}x" for v in shown)
    why = record["config"] == "hero" and variants.keys() == VARIANTS.keys()
    return [
        f"Temporaries against flat's: {ours} (the seed's: {seeds})."
        + (f" {_why(record)}" if why else "")
    ]


def _variants_option(record: dict) -> str:
    """The `--variants` a record was made with; "" for every variant."""
    names = list(record["variants"])
    return (
        ""
        if names == list(VARIANTS)
        else " --variants " + " ".join(f"'{v}'" if " " in v else v for v in names)
    )


def report(record: dict) -> str:
    """docs/tpu_memory.md from the record."""
    t = record["target"]
    variants = record["variants"]
    flat = variants["flat"]["temporaries"]
    lines = [
        "# The train step's memory on TPU, compiled on a CPU",
        "",
        f"Generated by `tox -e tpu-aot -- --config {record['config']}{_variants_option(record)}` "
        "(`bench/tpu_memory.py`): "
        f"`{t['config']}` on {t['topology']} megacore ({record['devices']} devices), "
        f"expert {t['expert']} x fsdp {t['fsdp']}, GA {GA_STEPS}, one sequence per device per "
        f"micro-batch, bfloat16 activations, float32 params and Adam state, remat "
        f"`{t['remat']}`, {t['vocab_tiles']} vocab tiles. Per device, as XLA's TPU compiler "
        "plans it (total: arguments + outputs - aliased + temporaries; peak: XLA's own, buffers "
        f"reused). A variant over the chip's {HBM_GIB} GiB does not compile, and its temporaries "
        "are the compiler's error's. Peak host memory of one compile: "
        f"{record['peak_host_memory_gib']:.1f} GiB.",
        "",
        "| variant | arguments | outputs | aliased | temporaries | total | peak "
        "| / flat temporaries | seed | fits | compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in variants.items():
        seed = f"{SEED_GB[name]} GB" if name in SEED_GB and record["config"] == "hero" else ""
        lines.append(
            f"| {name} | {_gib(m['arguments'])} | {_gib(m['outputs'])} | {_gib(m['aliased'])} | "
            f"{_gib(m['temporaries'])} | {_gib(m['total'])} | {_peak(m)} | "
            f"{m['temporaries'] / flat:.2f}x | "
            f"{seed} | {'yes' if m['fits'] else 'no'} | {m['seconds']:.0f} s |"
        )
    ratios = _ratios(record)
    lines += ["", *ratios] if ratios else []
    if "seq-major" in variants:
        lines += [
            "",
            "## What seq-major removes",
            "",
            "The collectives of flat's compiled program that seq-major's has not (same kind, JAX "
            "op and shape), largest first. A flat tile is a run of the flattened rows, which a few "
            "devices hold, and every tile is laid out over all devices (as MaxText lays it out), "
            "so the partitioner moves the hidden states; a seq-major tile keeps every row where it "
            "is.",
            "",
            *_removed_lines(record),
        ]
    lines += [
        "",
        "## What holds the memory at the peak",
        "",
        "The ops whose buffers are live at the compiler's peak, largest first (its live-range "
        "report; `transpose(jvp(...))` is the backward pass, `rematted_computation` the "
        "recomputed forward):",
        "",
    ]
    for name, m in variants.items():
        lines.append(f"- {name}:{'' if m['peak_ops'] else ' not recorded'}")
        lines += [f"  - {_op_label(op)}: {_gib(size)}" for op, size in m["peak_ops"]]
    lines += [
        "",
        "## Remat policies (seq-major)",
        "",
        "| policy | temporaries | total | peak | fits |",
        "|---|---|---|---|---|",
    ]
    for policy, m in record["remat"].items():
        lines.append(
            f"| `{policy}` | {_gib(m['temporaries'])} | {_gib(m['total'])} | {_peak(m)} | "
            f"{'yes' if m['fits'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tpu_memory", description=__doc__)
    parser.add_argument("--config", choices=sorted(TARGETS), default="hero")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME"
    )
    parser.add_argument(
        "--remat", nargs="*", choices=c.REMAT_POLICIES, default=list(c.REMAT_POLICIES)
    )
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="compiles at a time (default 1: a hero compile takes up to 11 GiB of host memory)",
    )
    parser.add_argument("--compile", nargs=2, metavar=("VARIANT", "REMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if "flat" not in args.variants:
        parser.error("--variants must include flat, the baseline of the others' ratios")
    if jax.default_backend() != "cpu":
        raise SystemExit("bench.tpu_memory compiles for TPU on a CPU: set JAX_PLATFORMS=cpu")
    if args.compile:
        print(json.dumps(_record(compile_variant(args.config, *args.compile))))
        return
    record = measure(args.config, args.remat, args.jobs, tuple(args.variants))
    stem = "tpu_memory" if args.config == "hero" else f"tpu_memory_{args.config}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(report(record))
    print(report(record))
    if not any(v["fits"] for v in record["variants"].values()):
        raise SystemExit(f"no variant fits {HBM_GIB} GiB of HBM")


if __name__ == "__main__":
    main()
