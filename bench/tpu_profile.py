"""`python -m bench tpu-profile`: where the chip's time goes in the slice's train step
(`bench.tpu_step`'s slice at matmul precision "default"), split by op family from a
`jax.profiler` trace of a few steps.

Each op the chip ran (the device plane's "XLA Ops" line) is given the family of the innermost
named scope in its HLO metadata (`jax.named_scope` in the model: `FAMILIES`); a fusion without
one takes the family most of its own ops carry. Ops of no family are "copies and layout" where
their opcode only moves data, else "other compute" (embeddings, norms, residuals, the dense and
shared SwiGLUs, the LM head's norm). "idle" is the step's wall time the chip ran no op. A
family's FLOP/s are the FLOPs the profiler gives its ops over their time.

`python -m bench.tpu_profile capture DIR` (on a TPU host) writes DIR/step.xplane.pb, the op
metadata (DIR/ops.json) and DIR/capture.json; `python -m bench.tpu_profile table DIR` (anywhere)
prints the split they hold.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = {
    "kda_inverse": "KDA chunk: inverse",
    "kda_intra_chunk": "KDA chunk: intra-chunk",
    "kda_inter_chunk": "KDA chunk: inter-chunk scan",
    "kda": "KDA: projections, conv, gates, norm",
    "attention": "attention",
    "router": "router",
    "grouped_matmul": "grouped matmuls",
    "moe_dispatch": "MoE dispatch",
    "moe": "MoE: latent projections, shared expert",
    "vocab_loss": "vocab-tiled loss",
    "optimizer": "optimizer",
}
"""Named scope in the model -> family."""
LAYOUT = "copies and layout"
OTHER = "other compute"
IDLE = "idle"
MOVES = {
    "copy",
    "copy-start",
    "copy-done",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "pad",
    "slice",
    "concatenate",
    "dynamic-slice",
    "dynamic-update-slice",
    "gather",
    "scatter",
    "tuple",
    "get-tuple-element",
}
"""Opcodes that only move data."""
STEPS, WARMUP = 3, 2
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S.*? ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_EVENT = re.compile(r"%?([\w.\-]+)")


def family_of(op_name: str) -> str | None:
    """The family of the innermost named scope of `FAMILIES` in an op's metadata path (a
    parameter's metadata, its argument's name, has no path)."""
    if "/" not in op_name:
        return None
    tokens = re.findall(r"[A-Za-z_]\w*", op_name)
    scoped = [t for t in tokens if t in FAMILIES]
    return FAMILIES[scoped[-1]] if scoped else None


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Each instruction of an HLO module's text: {"opcode", "op_name", "inner"} where "inner"
    holds the op names of the computation a fusion calls."""
    ops, inner = {}, collections.defaultdict(list)
    computation = None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            match = _COMPUTATION.match(line)
            computation = match.group(1) if match and "{" in line else computation
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, opcode = match.groups()
        op_name = _OP_NAME.search(line)
        calls = _CALLS.search(line) if opcode == "fusion" else None
        ops[name] = {
            "opcode": opcode,
            "op_name": op_name.group(1) if op_name else "",
            "calls": calls.group(1) if calls else None,
        }
        if op_name and computation is not None:
            inner[computation].append(op_name.group(1))
    for op in ops.values():
        op["inner"] = inner.get(op.pop("calls"), [])
    return ops


def classify(op: dict | None) -> str:
    """The family of one op of `hlo_ops` (None: an op the module text does not name)."""
    if op is None:
        return OTHER
    own = family_of(op["op_name"])
    if own is not None:
        return own
    inner = collections.Counter(f for f in map(family_of, op["inner"]) if f is not None)
    if inner:
        return inner.most_common(1)[0][0]
    return LAYOUT if op["opcode"] in MOVES else OTHER


def device_ops(xplane: Path) -> list[tuple[str, float]]:
    """(instruction name, seconds) of every op the first TPU ran in a trace, leaves only (a
    while loop's own event spans its body's ops)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    plane = next(p for p in data.planes if p.name.startswith("/device:TPU:0"))
    line = next(line for line in plane.lines if line.name == "XLA Ops")
    events = sorted((e.start_ns, e.end_ns, e.name) for e in line.events)
    starts = [start for start, _, _ in events[1:]] + [float("inf")]
    return [
        (_EVENT.match(name).group(1), (end - start) * 1e-9)
        for (start, end, name), following in zip(events, starts, strict=True)
        if following >= end
    ]


def split(work: Path) -> list[dict]:
    """The step's time by family from a capture in `work`: rows of family, seconds a step and
    share of the step, the largest first."""
    capture = json.loads((work / "capture.json").read_text())
    ops = json.loads((work / "ops.json").read_text())
    steps, step_s = capture["steps"], capture["step_s"]
    seconds = collections.Counter()
    for name, duration in device_ops(work / "step.xplane.pb"):
        seconds[classify(ops.get(name))] += duration / steps
    seconds[IDLE] = max(0.0, step_s - sum(seconds.values()))
    return [
        {"family": family, "seconds": s, "share": s / step_s} for family, s in seconds.most_common()
    ]


def capture(work: Path) -> None:
    """Trace `STEPS` steps of the slice after `WARMUP` on this host's TPU into `work`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.tpu_step import micro_batches, slice_config
    from model import train_step as ts
    from model.state import compiled_train_step, make_model

    if jax.default_backend() != "tpu":
        raise SystemExit(f"bench tpu-profile needs a TPU: JAX runs on {jax.default_backend()}")
    cfg = slice_config("default")
    graphdef, params = nnx.split(make_model(cfg))
    state = jax.tree.map(jnp.copy, ts.init_state(params, cfg))
    del params
    batch = micro_batches(cfg)
    compiled = compiled_train_step(cfg, graphdef, donate=True).lower(state, batch).compile()
    (work / "ops.json").write_text(json.dumps(hlo_ops(compiled.as_text())))
    for _ in range(WARMUP):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    trace = work / "trace"
    with jax.profiler.trace(str(trace)):
        start = time.perf_counter()
        for _ in range(STEPS):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - start) / STEPS
    shutil.move(next(trace.rglob("*.xplane.pb")), work / "step.xplane.pb")
    shutil.rmtree(trace)
    record = {"steps": STEPS, "step_s": step_s, "device": jax.devices()[0].device_kind}
    (work / "capture.json").write_text(json.dumps(record))


def run() -> dict[str, float]:
    """A capture in a child process (which holds the chip), then its split: figures named
    "<family>.seconds|share"."""
    with tempfile.TemporaryDirectory() as work:
        child = [sys.executable, "-m", "bench.tpu_profile", "capture", work]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench tpu-profile failed:\n{done.stderr[-3000:]}")
        rows = split(Path(work))
    return {f"{row['family']}.{key}": row[key] for row in rows for key in ("seconds", "share")}


def summary(figures: dict[str, float]) -> list[str]:
    shares = {k.rsplit(".", 1)[0]: v for k, v in figures.items() if k.endswith(".share")}
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
    return ["tpu-profile: " + ", ".join(f"{family} {share:.0%}" for family, share in top)]


if __name__ == "__main__":
    verb, work = sys.argv[1], Path(sys.argv[2])
    if verb == "capture":
        work.mkdir(parents=True, exist_ok=True)
        capture(work)
    else:
        for row in split(work):
            print(f"{row['family']:42s} {row['seconds'] * 1e3:9.1f} ms {row['share']:6.1%}")
