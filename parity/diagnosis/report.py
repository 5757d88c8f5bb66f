"""docs/diagnosis.md from the candidates' gaps: the table, the plot, the conclusion. Every number
in it comes from the runs; the seed's pattern is `SEED_PATTERN`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.diagnosis.ablation import Ablation
from parity.trace import GoldenTrace


@dataclass(frozen=True)
class SeedPattern:
    """The seed's TPU replay of the hero (1000 steps) against OLMo-core: aux loss equal at step 0,
    then `aux_after_step_1` high; grad norm `grad_norm` high; CE within `ce`."""

    aux_after_step_1: tuple[float, float]
    grad_norm: tuple[float, float]
    ce: float


SEED_PATTERN = SeedPattern(aux_after_step_1=(0.11, 0.72), grad_norm=(0.07, 0.32), ce=0.004)
MATCHES_AT_STEP_1 = 1e-3
"""An aux gap this small at the first step counts as "matches at step 0"."""
COLUMNS = (
    "candidate",
    "aux gap step 1",
    "aux gap range after step 1",
    "grad-norm gap range",
    "CE gap range",
    "seed's pattern",
)


def _percent(bounds: tuple[float, float]) -> str:
    return f"{bounds[0]:.0%}-{bounds[1]:.0%}".replace("%-", "-")


def _after_step_1(gaps: list[float]) -> np.ndarray:
    return np.array(gaps[1:] if len(gaps) > 1 else gaps)


def verdict(result: Ablation) -> dict[str, bool]:
    """Which parts of the seed's pattern this candidate shows, from its gaps."""
    aux, later = np.array(result.gaps["aux"]), _after_step_1(result.gaps["aux"])
    grad, ce = np.array(result.gaps["grad_norm"]), np.array(result.gaps["ce"])
    low, high = SEED_PATTERN.aux_after_step_1
    glow, ghigh = SEED_PATTERN.grad_norm
    return {
        "aux matches at step 1": bool(abs(aux[0]) <= MATCHES_AT_STEP_1),
        f"aux then {_percent(SEED_PATTERN.aux_after_step_1)} high": bool(
            later.max() >= low and later.min() > 0 and later.max() <= high
        ),
        f"grad norm {_percent(SEED_PATTERN.grad_norm)} high": bool(
            grad.max() >= glow and grad.min() > -glow and grad.max() <= ghigh
        ),
        f"CE within {SEED_PATTERN.ce:.1%}": bool(np.abs(ce).max() <= SEED_PATTERN.ce),
    }


def _range(x: np.ndarray) -> str:
    return f"{x.min():+.2%} .. {x.max():+.2%}"


def table(results: list[Ablation]) -> list[list[str]]:
    """COLUMNS rows, one per candidate."""
    rows = []
    for result in results:
        shown = [k for k, ok in verdict(result).items() if ok]
        rows.append(
            [
                f"`{result.name}`",
                f"{result.gaps['aux'][0]:+.2%}",
                _range(_after_step_1(result.gaps["aux"])),
                _range(np.array(result.gaps["grad_norm"])),
                _range(np.array(result.gaps["ce"])),
                f"{len(shown)}/4" + (f": {', '.join(shown)}" if shown else ""),
            ]
        )
    return rows


def conclusion(results: list[Ablation]) -> list[str]:
    """Sentences from the verdicts and gaps: the floor, which candidates show the whole pattern,
    which part each other one misses, and which moves aux and grad norm most, with numbers."""
    floor = next((r for r in results if r.name == "olmo_core"), None)
    lines = []
    if floor is not None:
        aux, grad = np.array(floor.gaps["aux"]), np.array(floor.gaps["grad_norm"])
        lines.append(
            f"The floor (`olmo_core`, fp32 drift only): aux {_range(aux)}, grad norm "
            f"{_range(grad)}, CE {_range(np.array(floor.gaps['ce']))}."
        )
    others = [r for r in results if r.name != "olmo_core"]
    full = [r.name for r in others if all(verdict(r).values())]
    if full:
        lines.append(f"Reproduce the seed's whole pattern alone: {', '.join(map(_code, full))}.")
    else:
        lines.append("No single candidate reproduces the seed's whole pattern alone.")
    for key, label in (("aux", "aux loss"), ("grad_norm", "grad norm")):
        if others:
            top = max(others, key=lambda r: np.abs(np.array(r.gaps[key][1:] or [0.0])).max())
            lines.append(
                f"Moves the {label} most after step 1: {_code(top.name)} "
                f"({_range(np.array(top.gaps[key]))})."
            )
    lines.append("")
    for r in others:
        missing = [k for k, ok in verdict(r).items() if not ok]
        aux, grad = np.array(r.gaps["aux"]), np.array(r.gaps["grad_norm"])
        shown = "shows the whole pattern" if not missing else f"ruled out: not {', '.join(missing)}"
        lines.append(
            f"- {_code(r.name)} {shown} (aux {aux[0]:+.2%} at step 1, "
            f"{_range(_after_step_1(r.gaps['aux']))} after; grad norm {_range(grad)}; "
            f"CE {_range(np.array(r.gaps['ce']))})."
        )
    return lines


def _code(name: str) -> str:
    return f"`{name}`"


def plot(results: list[Ablation], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("aux", "grad_norm", "ce", "lb_loss", "router_z_loss", "z_loss")
    fig, axes = plt.subplots(2, 3, figsize=(18, 9), constrained_layout=True)
    for ax, name in zip(axes.flat, names, strict=True):
        for i, r in enumerate(results):
            gaps = np.array(r.gaps[name])
            style = "-" if i < 10 else "--"
            ax.plot(range(1, len(gaps) + 1), 100 * gaps, style, label=r.name, lw=1.2)
        ax.set_title(f"{name}: (ours - OLMo-core) / OLMo-core, %")
        ax.set_xlabel("step")
        ax.set_yscale("symlog", linthresh=0.1)
    for ax, (what, bounds) in zip(
        axes.flat,
        (("aux", SEED_PATTERN.aux_after_step_1), ("grad norm", SEED_PATTERN.grad_norm)),
        strict=False,
    ):
        low, high = 100 * bounds[0], 100 * bounds[1]
        ax.axhspan(low, high, color="grey", alpha=0.15, label=f"seed: {what} +{_percent(bounds)}")
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(trace: GoldenTrace, results: list[Ablation], *, steps: int) -> str:
    """The markdown of docs/diagnosis.md."""
    pattern = (
        f"aux equal at step 0, then +{_percent(SEED_PATTERN.aux_after_step_1)}; grad norm "
        f"+{_percent(SEED_PATTERN.grad_norm)}; CE within {SEED_PATTERN.ce:.1%}"
    )
    lines = [
        "# Diagnosis: the seed's aux-loss and grad-norm gap",
        "",
        "Generated by `python -m parity.diagnosis` (do not edit): each candidate replays "
        f"{steps} steps of OLMo-core's golden trace (micro config, "
        f"GA {trace.config.train.ga_steps}) with one MaxText behaviour switched on, "
        "all else OLMo-core's. Gaps are signed, "
        "(ours - OLMo-core) / OLMo-core; aux is LB + router z-loss. The seed's pattern (hero, "
        f"TPU): {pattern}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table(results)]
    lines += ["", "What each candidate switches:", ""]
    lines += [f"- `{r.name}`: {r.what}" for r in results]
    lines += ["", "![gaps per step](diagnosis.png)", "", "## Conclusion", ""]
    lines += conclusion(results)
    return "\n".join(lines) + "\n"
