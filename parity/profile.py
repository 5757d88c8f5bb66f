"""A train step's chip time split by op family, from a `jax.profiler` trace and the compiled
module's HLO text (`python -m bench tpu-profile` captures both on a TPU host).

Each op the chip ran (the device plane's "XLA Ops" line, leaves only) is given the family of the
innermost named scope in its HLO metadata (`jax.named_scope` in the model: `FAMILIES`); a fusion
without one takes the family most of its own ops carry. Ops of no family are `LAYOUT` where their
opcode only moves data, else `OTHER` (embeddings, norms, residuals, the dense and shared SwiGLUs,
the LM head's norm). `IDLE` is the step's wall time the chip ran no op.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

from model.flops import UNSCOPED

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
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S.*? ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_EVENT = re.compile(r"%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One instruction of a compiled module."""

    opcode: str
    op_name: str
    """Its metadata's name-stack path ("" without one)."""
    inner: tuple[str, ...] = ()
    """The op names of the computation a fusion calls."""


@dataclasses.dataclass(frozen=True)
class FamilyTime:
    family: str
    seconds: float
    """A step's."""
    share: float
    """Of the step's wall time."""


def family_flops(flops: dict[str, float]) -> dict[str, float]:
    """`model.flops.scope_flops`' FLOPs by family: a named scope's as `FAMILIES` names it, those
    of no scope (`model.flops.UNSCOPED`) as `OTHER`."""
    unknown = sorted(set(flops) - set(FAMILIES) - {UNSCOPED})
    if unknown:
        raise ValueError(f"FLOPs of named scopes no profile family takes: {unknown}")
    return {FAMILIES.get(scope, OTHER): value for scope, value in flops.items()}


def family_of(op_name: str) -> str | None:
    """The family of the innermost named scope of `FAMILIES` in an op's metadata path (a
    parameter's metadata, its argument's name, has no path)."""
    if "/" not in op_name:
        return None
    scoped = [t for t in re.findall(r"[A-Za-z_]\w*", op_name) if t in FAMILIES]
    return FAMILIES[scoped[-1]] if scoped else None


def hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Each instruction of an HLO module's text (`Compiled.as_text()`), by name."""
    found, inner = [], collections.defaultdict(list)
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
        found.append((name, opcode, op_name.group(1) if op_name else "", calls and calls.group(1)))
        if op_name and computation is not None:
            inner[computation].append(op_name.group(1))
    return {
        name: HloOp(opcode, op_name, tuple(inner.get(calls, ())))
        for name, opcode, op_name, calls in found
    }


def classify(op: HloOp | None) -> str:
    """The family of one op (None: an op the module's text does not name)."""
    if op is None:
        return OTHER
    own = family_of(op.op_name)
    if own is not None:
        return own
    inner = collections.Counter(f for f in map(family_of, op.inner) if f is not None)
    if inner:
        return inner.most_common(1)[0][0]
    return LAYOUT if op.opcode in MOVES else OTHER


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


def split(
    ops: dict[str, HloOp], ran: list[tuple[str, float]], *, steps: int, step_s: float
) -> list[FamilyTime]:
    """A step's time by family, the largest first: `ran` (`device_ops`) over `steps` steps of
    `step_s` seconds each, its ops named in `ops` (`hlo_ops`)."""
    seconds = collections.Counter()
    for name, duration in ran:
        seconds[classify(ops.get(name))] += duration / steps
    seconds[IDLE] = max(0.0, step_s - sum(seconds.values()))
    return [FamilyTime(family, s, s / step_s) for family, s in seconds.most_common()]
