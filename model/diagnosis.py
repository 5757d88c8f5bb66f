"""`python -m model.diagnosis`: which MaxText behaviour makes the seed's aux loss 11-72% and grad
norm 7-32% high? Replays OLMo-core's golden trace with one behaviour at a time switched to its
MaxText form (all else OLMo-core's), records each step's signed relative gap of CE, z-loss, LB
loss, router z-loss and grad norm to the trace, and writes `docs/diagnosis.md` (table, plots,
conclusion) and `docs/diagnosis.json`. Every number in the report comes from these runs.

The seed's pattern, from its TPU replay of the hero (1000 steps): aux loss equal at step 0, then
11-72% above; grad norm 7-32% above; CE within 0.4%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.config import Config
from model.golden_trace import GoldenTrace, load_trace
from model.replay import Run, free_running, release_compiled

GAPS = ("ce", "z_loss", "lb_loss", "router_z_loss", "grad_norm")
AUX = ("lb_loss", "router_z_loss")
SEED_PATTERN = {"aux_after_step_1": (0.11, 0.72), "grad_norm": (0.07, 0.32), "ce": 0.004}
"""The seed's replay against the hero: aux +11-72% after step 0 (where it matched), grad norm
+7-32%, CE within 0.4%."""
MATCHES_AT_STEP_1 = 1e-3
"""An aux gap this small at the first step counts as "matches at step 0"."""
DEVICES = 4
"""Data devices of the per-device load-balancing candidate (one row of a micro-batch each)."""


def _flags(config: Config, **changes) -> Config:
    return dataclasses.replace(config, flags=dataclasses.replace(config.flags, **changes))


def _moe(config: Config, **changes) -> Config:
    moe = dataclasses.replace(config.model.moe, **changes)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, moe=moe))


@dataclass(frozen=True)
class Candidate:
    name: str
    what: str
    """The MaxText behaviour, and where it lives."""
    run: Run


def candidates(config: Config) -> list[Candidate]:
    """The OLMo-core run itself, then each MaxText behaviour alone, from `config` (OLMo-core's)."""
    olmo = Run(config)
    each = [
        ("olmo_core", "every behaviour OLMo-core's (the floor: fp32 drift only)", olmo),
        (
            "aux_mean",
            "MoE aux losses averaged over layers, not summed (`moe_aux_loss_reduction`)",
            Run(_flags(config, moe_aux_loss_reduction="mean")),
        ),
        (
            "lb_per_device",
            f"load balancing on each of {DEVICES} devices' own counts, device 0's value logged "
            "(`moe_global_load_balancing` off)",
            Run(_flags(config, moe_global_load_balancing=False), devices=DEVICES),
        ),
        (
            "ga_logs",
            "z-loss and aux losses logged as the sum of micro-batch means: GA times too large "
            "(`ga_reporting`)",
            dataclasses.replace(olmo, ga_reporting="micro_batch_means"),
        ),
        (
            "lb_div_micro_batch",
            "router losses divided by the micro-batch's labelled tokens, not the batch's "
            "(`aux_loss_div`)",
            dataclasses.replace(olmo, aux_loss_div="micro_batch_labels"),
        ),
        (
            "lb_div_positions",
            "router losses divided by the micro-batch's positions, ignored labels included "
            "(`aux_loss_div`)",
            dataclasses.replace(olmo, aux_loss_div="micro_batch_positions"),
        ),
        (
            "warmup_from_0",
            "LR warmup counted from step 0, not 1 (`warmup_step_offset`)",
            Run(_flags(config, warmup_step_offset=0)),
        ),
        (
            "jax_draws",
            "EMO pool sizes drawn by JAX's RNG: same distribution, other values (`Run.draws`)",
            dataclasses.replace(olmo, draws="jax"),
        ),
        (
            "router_bf16",
            "router logits computed in bfloat16 (`Router.logits_dtype`)",
            dataclasses.replace(olmo, router_logits_dtype="bfloat16"),
        ),
        (
            "no_weight_norm",
            "selected expert weights not L1-normalised, nor scaled by top_k "
            "(`MoEConfig.normalize_expert_weights`)",
            Run(_moe(config, normalize_expert_weights=False, restore_weight_scale=False)),
        ),
        (
            "no_scale_restore",
            "selected weights normalised but not scaled back by top_k "
            "(`MoEConfig.restore_weight_scale`)",
            Run(_moe(config, restore_weight_scale=False)),
        ),
        (
            "segments_per_row",
            "EMO pools per row, documents not split at EOS (`olmo_segment_ids_from_eos` off)",
            Run(_flags(config, olmo_segment_ids_from_eos=None)),
        ),
        (
            "mixers_per_document",
            "KDA and attention restarted at every document (`olmoe3_mixers_ignore_segment_ids` "
            "off)",
            Run(_flags(config, olmoe3_mixers_ignore_segment_ids=False)),
        ),
        (
            "jax_draws+router_bf16",
            "the two behaviours the seed's flags leave as MaxText's: its own EMO draws (it cannot "
            "replay torch's RNG) and router logits in its bf16 activation dtype",
            dataclasses.replace(olmo, draws="jax", router_logits_dtype="bfloat16"),
        ),
    ]
    return [Candidate(name, what, run) for name, what, run in each]


def signed_gaps(trace: GoldenTrace, rows: list[dict]) -> dict[str, list[float]]:
    """(ours - golden) / |golden| of every GAPS metric at every step."""
    out = {}
    for name in GAPS:
        golden = trace.metrics[name][: len(rows)]
        ours = np.array([row[name] for row in rows])
        out[name] = ((ours - golden) / np.abs(golden)).tolist()
    return out


def run_all(trace: GoldenTrace, *, steps: int, names: list[str] | None = None) -> list[dict]:
    """Each candidate's replay: {"name", "what", "gaps": {metric: [steps]}, "metrics": rows}."""
    chosen = [c for c in candidates(trace.config) if names is None or c.name in names]
    results = []
    for candidate in chosen:
        rows, _ = free_running(trace, candidate.run, steps=steps, on_step=lambda *_: None)
        release_compiled()  # a dozen compiled steps in one process exhaust LLVM's memory maps
        gaps = signed_gaps(trace, rows)
        results.append({"name": candidate.name, "what": candidate.what, "gaps": gaps, "rows": rows})
        print(f"{candidate.name}: {_summary(gaps)}", flush=True)
    return results


def _summary(gaps: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {min(v):+.1e}..{max(v):+.1e}" for k, v in gaps.items())


# --- the report -------------------------------------------------------------------------------

COLUMNS = (
    "candidate",
    "aux gap step 1",
    "aux gap range after step 1",
    "grad-norm gap range",
    "CE gap range",
    "seed's pattern",
)


def verdict(result: dict) -> dict:
    """Which parts of the seed's pattern this candidate shows, from its gaps."""
    aux = np.array(result["gaps"]["aux"])
    grad = np.array(result["gaps"]["grad_norm"])
    ce = np.array(result["gaps"]["ce"])
    later = aux[1:] if len(aux) > 1 else aux
    low, high = SEED_PATTERN["aux_after_step_1"]
    glow, ghigh = SEED_PATTERN["grad_norm"]
    parts = {
        "aux matches at step 1": bool(abs(aux[0]) <= MATCHES_AT_STEP_1),
        "aux then 11-72% high": bool(
            later.max() >= low and later.min() > 0 and later.max() <= high
        ),
        "grad norm 7-32% high": bool(
            grad.max() >= glow and grad.min() > -glow and grad.max() <= ghigh
        ),
        "CE within 0.4%": bool(np.abs(ce).max() <= SEED_PATTERN["ce"]),
    }
    return parts


def _with_aux(trace: GoldenTrace, result: dict) -> dict:
    """The candidate's total aux gap: (LB + router z) ours vs golden, per step."""
    rows = result["rows"]
    golden = trace.metrics["lb_loss"][: len(rows)] + trace.metrics["router_z_loss"][: len(rows)]
    ours = np.array([r["lb_loss"] + r["router_z_loss"] for r in rows])
    gaps = dict(result["gaps"], aux=((ours - golden) / golden).tolist())
    return dict(result, gaps=gaps)


def _range(x: np.ndarray) -> str:
    return f"{x.min():+.2%} .. {x.max():+.2%}"


def table(results: list[dict]) -> list[list[str]]:
    """COLUMNS rows, one per candidate."""
    rows = []
    for result in results:
        aux = np.array(result["gaps"]["aux"])
        later = aux[1:] if len(aux) > 1 else aux
        parts = verdict(result)
        shown = [k for k, ok in parts.items() if ok]
        rows.append(
            [
                f"`{result['name']}`",
                f"{aux[0]:+.2%}",
                _range(later),
                _range(np.array(result["gaps"]["grad_norm"])),
                _range(np.array(result["gaps"]["ce"])),
                f"{len(shown)}/4" + (f": {', '.join(shown)}" if shown else ""),
            ]
        )
    return rows


def conclusion(results: list[dict]) -> list[str]:
    """Sentences from the verdicts and gaps: the floor, which candidates show the whole pattern,
    which part each other one misses, and which moves aux and grad norm most, with numbers."""
    floor = next((r for r in results if r["name"] == "olmo_core"), None)
    lines = []
    if floor is not None:
        aux, grad = np.array(floor["gaps"]["aux"]), np.array(floor["gaps"]["grad_norm"])
        lines.append(
            f"The floor (`olmo_core`, fp32 drift only): aux {_range(aux)}, grad norm "
            f"{_range(grad)}, CE {_range(np.array(floor['gaps']['ce']))}."
        )
    others = [r for r in results if r["name"] != "olmo_core"]
    full = [r["name"] for r in others if all(verdict(r).values())]
    if full:
        lines.append(f"Reproduce the seed's whole pattern alone: {', '.join(map(_code, full))}.")
    else:
        lines.append("No single candidate reproduces the seed's whole pattern alone.")
    for key, label in (("aux", "aux loss"), ("grad_norm", "grad norm")):
        if others:
            top = max(others, key=lambda r: np.abs(np.array(r["gaps"][key][1:] or [0.0])).max())
            gaps = np.array(top["gaps"][key])
            lines.append(
                f"Moves the {label} most after step 1: {_code(top['name'])} ({_range(gaps)})."
            )
    lines.append("")
    for r in others:
        missing = [k for k, ok in verdict(r).items() if not ok]
        aux, grad = np.array(r["gaps"]["aux"]), np.array(r["gaps"]["grad_norm"])
        shown = "shows the whole pattern" if not missing else f"ruled out: not {', '.join(missing)}"
        lines.append(
            f"- {_code(r['name'])} {shown} (aux {aux[0]:+.2%} at step 1, "
            f"{_range(aux[1:] if len(aux) > 1 else aux)} after; grad norm {_range(grad)}; "
            f"CE {_range(np.array(r['gaps']['ce']))})."
        )
    return lines


def _code(name: str) -> str:
    return f"`{name}`"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("aux", "grad_norm", "ce", "lb_loss", "router_z_loss", "z_loss")
    fig, axes = plt.subplots(2, 3, figsize=(18, 9), constrained_layout=True)
    for ax, name in zip(axes.flat, names, strict=True):
        for i, r in enumerate(results):
            gaps = np.array(r["gaps"][name])
            style = "-" if i < 10 else "--"
            ax.plot(range(1, len(gaps) + 1), 100 * gaps, style, label=r["name"], lw=1.2)
        ax.set_title(f"{name}: (ours - OLMo-core) / OLMo-core, %")
        ax.set_xlabel("step")
        ax.set_yscale("symlog", linthresh=0.1)
    axes.flat[0].axhspan(11, 72, color="grey", alpha=0.15, label="seed: aux +11-72%")
    axes.flat[1].axhspan(7, 32, color="grey", alpha=0.15, label="seed: grad norm +7-32%")
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(trace: GoldenTrace, results: list[dict], *, steps: int) -> str:
    """The markdown of docs/diagnosis.md."""
    lines = [
        "# Diagnosis: the seed's aux-loss and grad-norm gap",
        "",
        "Generated by `python -m model.diagnosis` (do not edit): each candidate replays "
        f"{steps} steps of OLMo-core's golden trace (micro config, "
        f"GA {trace.config.train.ga_steps}) with one MaxText behaviour switched on, "
        "all else OLMo-core's. Gaps are signed, "
        "(ours - OLMo-core) / OLMo-core; aux is LB + router z-loss. The seed's pattern (hero, "
        "TPU): aux equal at step 0, then +11-72%; grad norm +7-32%; CE within 0.4%.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table(results)]
    lines += ["", "What each candidate switches:", ""]
    lines += [f"- `{c['name']}`: {c['what']}" for c in results]
    lines += ["", "![gaps per step](diagnosis.png)", "", "## Conclusion", ""]
    lines += conclusion(results)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.diagnosis", description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="steps (default: the whole trace)")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder of the report")
    parser.add_argument("--only", nargs="*", default=None, help="candidate names (default: all)")
    args = parser.parse_args(argv)
    from model.replay import _use_devices

    _use_devices(DEVICES)
    trace = load_trace()
    steps = trace.steps if args.steps is None else args.steps
    results = [_with_aux(trace, r) for r in run_all(trace, steps=steps, names=args.only)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnosis.md").write_text(report(trace, results, steps=steps))
    plot(results, args.out / "diagnosis.png")
    kept = [{k: r[k] for k in ("name", "what", "gaps")} | {"verdict": verdict(r)} for r in results]
    (args.out / "diagnosis.json").write_text(
        json.dumps({"steps": steps, "candidates": kept}, indent=1)
    )
    print(f"wrote {args.out / 'diagnosis.md'}, diagnosis.png and diagnosis.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
