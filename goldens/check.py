"""`python -m goldens.check`: regenerate every golden into a temporary folder and compare it with
the committed one, as its manifest entry's `tolerances.regenerate` says (goldens.tolerances
`Regenerate`): integers bit-identical, float32 results within the rounding another CPU's kernels
give, chaotic training outputs (the trace, its perturbed runs, the trained keys) within OLMo-core's
own one-ulp envelope (goldens.envelope). A golden built from other goldens is regenerated from the
committed ones, so no component inherits the trace's chaos. The envelope is wide by step 50 (a
median 6% of a tensor's norm), so each later snapshot's step is also run alone from the committed
state one step before it (goldens.trace.regenerate_step) and held to one step's rounding
(goldens.tolerances.REGENERATE_SAVED_STEP): every tensor's update and every metric of that step.
The exports run in parallel lanes, one per core, each component alone in its own process, beside
the saved steps in this one (goldens.lanes).
Prints, per file, whether it came out bit-identical, within rounding, within the envelope or
within one step's rounding, names both CPUs when they differ, and each lane's jobs and wall time;
exits 1 naming every file and tensor that does not hold, any manifest field that changed, and any
golden whose exporter source (goldens.source) changed since it was made, or an export that failed
(at once, with its stderr)."""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from goldens.envelope import metric_spread, norm_gap, param_spread, rel_gap
from goldens.export import COMPONENTS, make_torch_deterministic
from goldens.lanes import ExportFailed, available_cores, export_in_lanes
from goldens.store import GOLDENS_DIR, Golden, load_golden, read_manifest
from goldens.tolerances import ENVELOPE_FLOOR, REGENERATE_SAVED_STEP
from goldens.trace import STATE_STEPS, RegeneratedStep, regenerate_step, use_free_port
from model.config import micro, olmo_core

UNCOMPARED_FIELDS = ("sha256", "machine", "source")
"""Manifest fields a regeneration may change: the bytes, and the CPU they were made on; the
exporter source is compared on its own (`source_changes`)."""
TRACE_METRICS = "trace/metrics.safetensors"
TRACE_PERTURBED = "trace/perturbed.safetensors"
SNAPSHOT = "trace/params_step{}.safetensors"
STATE = "trace/state_step{}.safetensors"
SPREADS = {
    "trace/params_step": ("params_rel_diff_step", "params"),
    "trace/state_step": ("state_rel_diff_step", "state"),
}
"""A snapshot file's path before its step -> (the perturbed runs' distances at that step, the
perturbed entry's config list naming their columns)."""


def describe(machine: dict[str, str] | None) -> str:
    """ "<cpu> (torch <isa>; <simd flags>)" of a manifest entry's machine."""
    if not machine:
        return "an unrecorded CPU"
    return f"{machine['cpu']} (torch {machine['torch_cpu_capability']}; {machine['simd']})"


@dataclass(frozen=True)
class Verdict:
    """One tensor's comparison: ok, how it held ("bit-identical", "rounding", "envelope") and
    the measured gap against what was allowed."""

    ok: bool
    how: str
    what: str


def compare_exact(committed: np.ndarray, fresh: np.ndarray) -> Verdict:
    same = committed.tobytes() == fresh.tobytes()
    return Verdict(same, "bit-identical", "bit-identical" if same else "bytes differ")


def compare_rounding(
    committed: np.ndarray, fresh: np.ndarray, rtol: float, of_max: float
) -> Verdict:
    """|fresh - committed| <= rtol |committed| + of_max max|committed| elementwise."""
    a, b = committed.astype(np.float64), fresh.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return Verdict(False, "rounding", "NaN in one and not the other")
    a, b = np.nan_to_num(a), np.nan_to_num(b)
    bound = rtol * np.abs(a) + of_max * (np.abs(a).max() if a.size else 0.0)
    excess = np.abs(a - b) / np.where(bound > 0, bound, np.finfo(float).tiny)
    worst = float(excess.max()) if a.size else 0.0
    return Verdict(
        worst <= 1.0,
        "rounding",
        f"max |gap| / (rtol |x| + of_max max|x|) = {worst:.3g} (rtol {rtol:g}, of_max {of_max:g})",
    )


def _within(gaps, spread, factor: float, what: str) -> Verdict:
    """gaps <= factor x max(spread, ENVELOPE_FLOOR) everywhere; a 0-d gap is a whole tensor's (by
    norms)."""
    ratio = np.asarray(gaps) / np.maximum(spread, ENVELOPE_FLOOR)
    worst = float(ratio.max()) if ratio.size else 0.0
    if ratio.ndim:
        what += str(list(map(int, np.unravel_index(int(np.argmax(ratio)), ratio.shape))))
    return Verdict(
        worst <= factor,
        "envelope",
        f"largest gap / OLMo-core's one-ulp spread {worst:.3g} at {what} (allowed {factor:g})",
    )


def _alike(fresh, committed, factor: float, what: str) -> Verdict:
    """A spread regenerated within `factor` of the committed one either way (each at least
    ENVELOPE_FLOOR): a rerun whose one-ulp runs stopped spreading (the perturbation lost) fails
    as surely as one whose runs spread far more."""
    fresh, committed = np.maximum(fresh, ENVELOPE_FLOOR), np.maximum(committed, ENVELOPE_FLOOR)
    ratio = np.asarray(fresh / committed)
    at = int(np.argmax(np.maximum(ratio, 1 / ratio)))
    worst = float(ratio.flat[at])
    if ratio.ndim:
        what += str(list(map(int, np.unravel_index(at, ratio.shape))))
    return Verdict(
        1 / factor <= worst <= factor,
        "envelope",
        f"regenerated one-ulp spread / committed {worst:.3g} at {what} "
        f"(allowed 1/{factor:g} to {factor:g})",
    )


def _median_ratio(fresh: np.ndarray, committed: np.ndarray) -> float:
    """The median over tensors of fresh / committed spread (each at least ENVELOPE_FLOOR): one
    tensor's distance is too chaotic to bound from below (a rerun on another CPU measured 0.13
    of the committed for one tensor at step 10, the median 0.64)."""
    floor = lambda x: np.maximum(x, ENVELOPE_FLOOR)  # noqa: E731
    return float(np.median(floor(fresh) / floor(committed)))


def _both(first: Verdict, second: Verdict) -> Verdict:
    return Verdict(first.ok and second.ok, "envelope", f"{first.what}; {second.what}")


class Envelope:
    """The committed goldens' one-ulp spreads, for the chaotic tensors, and the regenerated trace
    its regenerated one-ulp runs are measured from (each file loaded and verified once, not once
    per tensor)."""

    def __init__(self, root: Path, fresh_root: Path):
        self.root, self.fresh_root = root, fresh_root

    @functools.cached_property
    def metrics(self) -> Golden:
        return load_golden(TRACE_METRICS, self.root)

    @functools.cached_property
    def fresh_metrics(self) -> Golden:
        return load_golden(TRACE_METRICS, self.fresh_root, check_inputs=False)

    @functools.cached_property
    def perturbed(self) -> Golden:
        return load_golden(TRACE_PERTURBED, self.root)

    def compare(self, path: str, name: str, old: Golden, fresh: np.ndarray, factor: float):
        """Verdict of a chaotic tensor, or None when `name` of `path` is not chaotic."""
        committed = old.tensors[name]
        if name.startswith("fp32_error."):  # a rounding error's size, itself a rounding result
            ratio = max(fresh.item() / committed.item(), committed.item() / fresh.item())
            return Verdict(
                ratio <= factor,
                "envelope",
                f"float32 error {fresh.item():.3g} vs committed {committed.item():.3g} "
                f"(a factor {ratio:.3g}, allowed {factor:g})",
            )
        if name.startswith("spread."):  # a spread itself: how far its run went
            return _alike(fresh.item(), committed.item(), factor, name)
        if path == "kda_trained_keys.safetensors" and f"spread.{name}" in old.tensors:
            spread = old.tensors[f"spread.{name}"]
            return _within(norm_gap(fresh, committed), spread.item(), factor, name)
        for prefix, (distances, columns) in SPREADS.items():
            if path.startswith(prefix) and path != SNAPSHOT.format(0):
                step = path.removeprefix(prefix).removesuffix(".safetensors")
                perturbed = self.perturbed
                names = perturbed.entry["config"][columns]
                spread = param_spread(perturbed[f"{distances}{step}"])[names.index(name)]
                return _within(norm_gap(fresh, committed), spread, factor, name)
        if path not in (TRACE_METRICS, TRACE_PERTURBED):
            return None
        perturbed, golden = self.perturbed, self.metrics
        if name.startswith(tuple(d for d, _ in SPREADS.values())):  # a spread: how far runs went
            spread = param_spread(perturbed[name])
            return _both(
                _within(fresh, spread[None], factor, name),
                _alike(_median_ratio(param_spread(fresh), spread), 1.0, factor, f"{name} median"),
            )
        if name not in golden.tensors or name not in perturbed.tensors:
            return None
        spread = metric_spread(perturbed[name], golden[name])
        if path == TRACE_PERTURBED:  # each rerun of a perturbed run: one more run of the process
            return _both(
                _within(rel_gap(fresh, golden[name][None]), spread[None], factor, name),
                _alike(metric_spread(fresh, self.fresh_metrics[name]), spread, factor, name),
            )
        return _within(rel_gap(fresh, committed), spread, factor, name)


def source_changes(committed: dict[str, str], fresh: dict[str, str]) -> list[str]:
    """The exporter modules whose sha256 differs between two entries' `source`, or that only one
    of them lists."""
    return sorted(p for p in set(committed) | set(fresh) if committed.get(p) != fresh.get(p))


def compare_file(
    path: str, old: Golden, new: Golden, envelope: Envelope
) -> list[tuple[str, Verdict]]:
    """Each tensor's verdict under the committed entry's `tolerances.regenerate`."""
    rule = old.entry["tolerances"]["regenerate"]
    out = []
    for name in sorted(old.tensors):
        committed, fresh = old.tensors[name], new.tensors[name]
        if committed.shape != fresh.shape or committed.dtype != fresh.dtype:
            what = f"{fresh.shape} {fresh.dtype} vs committed {committed.shape} {committed.dtype}"
            out.append((name, Verdict(False, "shape", what)))
            continue
        verdict = compare_exact(committed, fresh)
        if not verdict.ok and rule["kind"] == "rounding":
            verdict = compare_rounding(committed, fresh, rule["rtol"], rule["of_max"])
        elif not verdict.ok and rule["kind"] == "envelope":
            chaotic = envelope.compare(path, name, old, fresh, rule["factor"])
            if chaotic is not None:
                verdict = chaotic
            elif rule["rtol"] or rule["of_max"]:  # the deterministic parts of a chaotic file
                verdict = compare_rounding(committed, fresh, rule["rtol"], rule["of_max"])
        out.append((name, verdict))
    return out


def regenerate_saved_steps(root: Path = GOLDENS_DIR) -> list[RegeneratedStep]:
    """Each later snapshot's step run by OLMo-core alone from the committed state before it, as
    the exporter runs (one torch thread, deterministic algorithms)."""
    make_torch_deterministic()
    use_free_port()
    cfg = olmo_core(micro())
    return [
        regenerate_step(cfg, load_golden(STATE.format(step), root).tensors, step + 1)
        for step in STATE_STEPS
    ]


@dataclass(frozen=True)
class StepGap:
    """One tensor of a saved step run alone from the committed state before it: its gap to the
    committed value (a parameter's update p(s) - p(s - 1) by norms, a metric elementwise), both
    relative, against the bound."""

    path: str
    name: str
    step: int
    gap: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.gap <= self.bound

    @property
    def what(self) -> str:
        return (
            f"step {self.step} run alone from {STATE.format(self.step - 1)}: gap {self.gap:.3g} "
            f"(allowed {self.bound:g})"
        )


def weights_before(state: dict[str, np.ndarray], snapshot: dict[str, np.ndarray]) -> dict:
    """Each tensor of a step's snapshot as the state before that step holds it (its flat "main"
    copy, float64, in the snapshot's shape): what the step's update starts from."""
    return {
        name: state[f"{name}.main"].reshape(after.shape).astype(np.float64)
        for name, after in snapshot.items()
    }


def saved_step_gaps(root: Path, regenerated: RegeneratedStep) -> list[StepGap]:
    """Each parameter tensor's and metric's gap of one regenerated step to the committed trace."""
    step, bounds = regenerated.step, REGENERATE_SAVED_STEP
    before = load_golden(STATE.format(step - 1), root)
    snapshot = load_golden(SNAPSHOT.format(step), root)
    metrics = load_golden(TRACE_METRICS, root)
    gaps, priors = [], weights_before(before.tensors, snapshot.tensors)
    for name, committed in sorted(snapshot.tensors.items()):
        prior = priors[name]
        gap = norm_gap(regenerated.params[name] - prior, committed - prior)
        gaps.append(StepGap(snapshot.path, name, step, gap, bounds.update))
    for name, value in sorted(regenerated.metrics.items()):
        gap = float(rel_gap(value, metrics[name][step - 1 : step]).max())
        gaps.append(StepGap(metrics.path, f"{name}[{step - 1}]", step, gap, bounds.metric))
    return gaps


def saved_steps_report(
    root: Path, regenerated: Sequence[RegeneratedStep]
) -> tuple[list[str], list[str]]:
    """(report lines, failures) of the regenerated saved steps."""
    report, failures = [], []
    for one in regenerated:
        gaps = saved_step_gaps(root, one)
        failures += [f"{g.path} {g.name}: {g.what}" for g in gaps if not g.ok]
        for path in sorted({g.path for g in gaps}):
            held = [g for g in gaps if g.path == path]
            if all(g.ok for g in held):
                nearest = max(held, key=lambda g: g.gap / g.bound)
                report.append(
                    f"{path}: step {one.step} within one step's rounding ({len(held)} tensors; "
                    f"nearest its bound {nearest.name}: {nearest.what})"
                )
    return report, failures


def compare(
    committed_root: Path, fresh_root: Path, regenerated: Sequence[RegeneratedStep] = ()
) -> tuple[list[str], list[str]]:
    """(report lines, failures) of the fresh goldens against the committed ones, and of the
    `regenerated` saved steps against the committed trace."""
    committed = read_manifest(committed_root)["files"]
    fresh = read_manifest(fresh_root)["files"]
    report, failures = [], []
    for path in sorted(set(committed) - set(fresh)):
        failures.append(f"{path}: committed but no longer exported")
    for path in sorted(set(fresh) - set(committed)):
        failures.append(f"{path}: exported but not committed (run `tox -e goldens`)")
    machines = {
        (describe(e.get("machine")), describe(f.get("machine")))
        for p, e in committed.items()
        if (f := fresh.get(p)) is not None
    }
    for made, now in sorted(machines):
        if made != now:
            report.append(f"CPUs differ: committed goldens made on {made}; regenerated on {now}")
    envelope = Envelope(committed_root, fresh_root)
    unrecorded = []
    for path in sorted(set(committed) & set(fresh)):
        old = load_golden(path, committed_root)
        new = load_golden(path, fresh_root, check_inputs=False)
        if "source" not in old.entry:
            unrecorded.append(path)
        elif changed_source := source_changes(old.entry["source"], new.entry["source"]):
            failures.append(
                f"{path}: made by another exporter source ({', '.join(changed_source)} changed "
                "since); run `tox -e goldens`"
            )
        changed = sorted(
            k
            for k in set(old.entry) | set(new.entry)
            if k not in UNCOMPARED_FIELDS and old.entry.get(k) != new.entry.get(k)
        )
        if changed:
            failures.append(f"{path}: manifest fields differ: {changed}")
            continue
        verdicts = compare_file(path, old, new, envelope)
        for name, verdict in verdicts:
            if not verdict.ok:
                failures.append(f"{path} {name}: {verdict.what}")
        held = sorted({v.how for _, v in verdicts})
        if all(v.ok for _, v in verdicts):
            report.append(f"{path}: {' + '.join(held)} ({len(verdicts)} tensors)")
            report += [f"  {path} {n}: {v.what}" for n, v in verdicts if v.how != "bit-identical"]
    if unrecorded:
        report.append(
            f"{len(unrecorded)} committed goldens record no exporter source (made before "
            "goldens.source); `tox -e goldens` records it"
        )
    step_report, step_failures = saved_steps_report(committed_root, regenerated)
    return report + step_report, failures + step_failures


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="goldens-check-") as tmp:
        try:
            regenerated, lanes = export_in_lanes(
                list(COMPONENTS),
                Path(tmp),
                ("saved steps", regenerate_saved_steps),
                workers=available_cores(),
            )
        except ExportFailed as failed:
            print(f"goldens-check: {failed}")
            return 1
        report, failures = compare(GOLDENS_DIR, Path(tmp), regenerated)
    print("goldens-check:")
    for line in report:
        print(f"  {line}")
    for line in failures:
        print(f"  MISMATCH: {line}")
    for number, lane in enumerate(lanes, 1):
        print(f"  lane {number}: {lane.describe()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
