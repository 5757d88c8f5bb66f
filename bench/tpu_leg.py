"""`python -m bench.tpu_leg [part ...] [--work DIR] [--steps N]`: the TPU leg on a TPU host, each
part in a process of its own (one process holds the chip), its record under DIR:

    tests             `pytest -m tpu --tpu-record DIR/tests.json` (tests/test_tpu.py), with
                      libtpu's accurate float32 transcendentals, held to the CPU's bars
    tests-default     the same with its default ones (DIR/tests-default.json)
    lockstep-highest  `python -m parity.replay --platform tpu --matmul-precision highest`
    lockstep-default  the same at "default" (DIR/lockstep-<precision>/replay.json)
    step              `python -m bench tpu-step --record DIR/step.json`
    train             `python -m bench tpu-train --record DIR/train.json`
    profile           `python -m bench tpu-profile --record DIR/profile.json`
    docs              docs/tpu.json and docs/tpu.md: the records DIR holds, in place of those
                      parts in today's docs/tpu.json (a part not run keeps its last record)

All of them by default, in that order. OLMo-core runs on the host's CPU. A part that fails (a
test, a lockstep step) is reported in the docs as it is; the leg exits 1 when any did.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from parity.lockstep_check import TENSOR_KINDS, tensor_bounds
from parity.report import LABELS, TENSOR_LABELS

PRECISIONS = ("highest", "default")
DOCS = Path(__file__).resolve().parents[1] / "docs"
STEPS = 50


def _commands(work: Path, steps: int) -> dict[str, list[str]]:
    python = sys.executable
    replay = [python, "-m", "parity.replay", "--platform", "tpu", "--steps", str(steps)]
    lockstep = {
        f"lockstep-{p}": [*replay, "--matmul-precision", p, "--out", str(work / f"lockstep-{p}")]
        for p in PRECISIONS
    }
    pytest = [python, "-m", "pytest", "-m", "tpu", "-p", "no:cacheprovider", "-rs"]
    return {
        "tests": [*pytest, "--tpu-record", str(work / "tests.json")],
        "tests-default": [
            *pytest,
            "--tpu-transcendentals",
            "default",
            "--tpu-record",
            str(work / "tests-default.json"),
        ],
        **lockstep,
        "step": [python, "-m", "bench", "tpu-step", "--record", str(work / "step.json")],
        "train": [python, "-m", "bench", "tpu-train", "--record", str(work / "train.json")],
        "profile": [python, "-m", "bench", "tpu-profile", "--record", str(work / "profile.json")],
    }


def _worst(steps: list[dict], where: str, gap: str) -> dict:
    """The largest `gap` of any entry of `where` over the steps (a per-layer list left out),
    with its step and name."""
    found = [
        (values[gap], step["step"], name)
        for step in steps
        for name, values in step[where].items()
        if not isinstance(values[gap], list)
    ]
    value, step, name = max(found)
    return {"rel_gap": value, "step": step, "name": name}


def _nearest_bound(steps: list[dict], kind: str, field: str) -> dict:
    """The tensor gap of `kind` nearest (or farthest over) the bound of its own step
    (`tensor_bounds`: step 1's update, rerouted steps and LOCKSTEP_OWN_ROUNDING's tensors are
    held looser), with that bound."""
    found = []
    for step in steps:
        for name, gaps in step["tensors"].items():
            bound = getattr(tensor_bounds(step["step"], step["rerouted_blocks"], name), field)
            gap = gaps[f"{kind}_rel_gap"]
            found.append((gap / bound, gap, bound, step["step"], name))
    _, gap, bound, step, name = max(found)
    return {"rel_gap": gap, "step": step, "name": name, "tolerance": bound}


def _first_tensor_over(steps: list[dict]) -> dict | None:
    """The first step where a tensor gap exceeds its bound, and its farthest-over tensor."""
    for step in steps:
        over = [
            (gap / bound, kind, name)
            for name, gaps in step["tensors"].items()
            for kind, field in TENSOR_KINDS.items()
            if (gap := gaps[f"{kind}_rel_gap"])
            > (bound := getattr(tensor_bounds(step["step"], step["rerouted_blocks"], name), field))
        ]
        if over:
            ratio, kind, name = max(over)
            return {"step": step["step"], "kind": kind, "name": name, "times_its_bound": ratio}
    return None


def lockstep_summary(replay: dict) -> dict:
    """What docs/tpu.md shows of one lockstep run's replay.json."""
    lock = replay["lockstep"]
    steps = lock["steps"]
    tensors = {kind: _nearest_bound(steps, kind, field) for kind, field in TENSOR_KINDS.items()}
    rerouted = [sum(s["tokens_rerouted"]) for s in steps]
    return {
        "steps": len(steps),
        "device": replay["device"],
        "matmul_precision": replay["matmul_precision"],
        "tpu_transcendentals": replay["tpu_transcendentals"],
        "kernels": replay.get("kernels"),
        "olmo_core_process_group": replay["olmo_core_process_group"],
        "passed": lock["passed"],
        "first_divergence": lock["first_divergence"],
        "first_tensor_over": _first_tensor_over(steps),
        "metric": _worst(steps, "metrics", "rel_gap"),
        "tensors": tensors,
        "steps_rerouted": sum(1 for r in rerouted if r),
        "most_slots_rerouted": max(rerouted),
        "tolerances": lock["tolerances"]["routed_alike"],
    }


def collect(work: Path, previous: dict) -> dict:
    """docs/tpu.json: the `previous` record with each part found under `work` in its place,
    lockstep runs summarised."""
    record = {**previous, "lockstep": dict(previous.get("lockstep", {}))}
    for part in ("tests", "tests-default"):
        if (work / f"{part}.json").exists():
            record[part] = json.loads((work / f"{part}.json").read_text())
    for p in PRECISIONS:
        replay = work / f"lockstep-{p}" / "replay.json"
        if replay.exists():
            record["lockstep"][p] = lockstep_summary(json.loads(replay.read_text()))
    if (work / "step.json").exists():
        record["step"] = json.loads((work / "step.json").read_text())["tpu-step"]
    if (work / "train.json").exists():
        record["train"] = json.loads((work / "train.json").read_text())["tpu-train"]
    if (work / "profile.json").exists():
        record["profile"] = json.loads((work / "profile.json").read_text())["tpu-profile"]
    if not record["lockstep"]:
        del record["lockstep"]
    return record


def _g(x: float) -> str:
    return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.3g}"


def _tests_table(accurate: dict, default: dict | None) -> list[str]:
    """A row a check: the run with libtpu's accurate transcendentals at both matmul precisions
    and its bound at "highest"; beside it the run with the default ones at "highest", if any."""
    other = {(r["check"], r["quantity"]): r for r in (default or {}).get("rows", [])}
    lines = [
        "| check | quantity | highest | default | bound (highest) | | default exp/log, highest "
        "| its bound | |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in accurate["rows"]:
        d = other.get((r["check"], r["quantity"]))
        beside = "| | |" if d is None else f"{_g(d['highest'])} | {_g(d['bound'])} | {_ok(d)} |"
        lines.append(
            f"| {r['check']} | {r['quantity']} | {_g(r['highest'])} | {_g(r['default'])} "
            f"| {_g(r['bound'])} | {_ok(r)} | {beside}"
        )
    return lines


def _ok(row: dict) -> str:
    return "ok" if row["ok"] else "**over**"


def _divergence(summary: dict) -> str:
    first = summary["first_divergence"]
    if first is None:
        return "every step within the lockstep tolerances"
    kind, name = first["kind"], first["name"]
    if kind in TENSOR_LABELS:
        what = f"{TENSOR_LABELS[kind]} of {name}"
    elif kind == "layer":
        what = f"{LABELS[name]} of MoE block {first['block']}"
    else:
        what = LABELS.get(name, name)
    return (
        f"first leaves them at step {first['step']}: {what} "
        f"{_g(first['rel_gap'])} > {_g(first['tolerance'])}"
    )


def _lockstep_table(lockstep: dict) -> list[str]:
    shown = [p for p in PRECISIONS if p in lockstep]
    tol = lockstep[shown[0]]["tolerances"]
    lines = [
        "| quantity | " + " | ".join(shown) + " | tolerance |",
        "|---|" + "---|" * len(shown) + "---|",
        "| steps | " + " | ".join(str(lockstep[p]["steps"]) for p in shown) + " | |",
        "| the chip's transcendentals (`--tpu-transcendentals`) | "
        + " | ".join(lockstep[p]["tpu_transcendentals"] for p in shown)
        + " | |",
        "| kernels: grouped matmuls, KDA intra-chunk scores, attention | "
        + " | ".join(_kernels(lockstep[p].get("kernels")) for p in shown)
        + " | |",
    ]
    lines.append(
        "| worst metric | "
        + " | ".join(
            f"{_g(s['metric']['rel_gap'])} ({LABELS[s['metric']['name']]}, step "
            f"{s['metric']['step']})"
            for s in (lockstep[p] for p in shown)
        )
        + f" | {_g(tol['metric'])} |"
    )
    for kind in TENSOR_KINDS:
        cells = [
            f"{_g(t['rel_gap'])} ({t['name']}, step {t['step']}; tolerance {_g(t['tolerance'])})"
            for t in (lockstep[p]["tensors"][kind] for p in shown)
        ]
        lines.append(
            f"| {TENSOR_LABELS[kind]} nearest its step's tolerance | " + " | ".join(cells) + " | |"
        )
    lines.append(
        "| steps with token slots rerouted (most slots) | "
        + " | ".join(
            f"{lockstep[p]['steps_rerouted']} ({lockstep[p]['most_slots_rerouted']})" for p in shown
        )
        + " | |"
    )
    lines.append("| verdict | " + " | ".join(_divergence(lockstep[p]) for p in shown) + " | |")
    lines.append(
        "| first tensor over its tolerance | "
        + " | ".join(_first_tensor(lockstep[p]["first_tensor_over"]) for p in shown)
        + " | |"
    )
    return lines


def _kernels(kernels: dict | None) -> str:
    if kernels is None:
        return "not recorded (a run before `model.kernels`)"
    names = ("grouped_matmul", "kda_intra_chunk", "attention")
    return ", ".join(str(kernels.get(k, "not recorded")) for k in names)


def _first_tensor(first: dict | None) -> str:
    if first is None:
        return "none"
    return (
        f"step {first['step']}: {TENSOR_LABELS[first['kind']]} of {first['name']}, "
        f"{first['times_its_bound']:.3g}x its tolerance"
    )


STEP_FIGURES = (
    ("compile_s", "compile (trace, lower, compile), s"),
    ("step_s", "step (best of 5), s"),
    ("tokens_per_s", "tokens / s"),
    ("model_flops_per_s", "model FLOP/s"),
    ("fraction_of_peak", "of the chip's bf16 peak"),
    ("arguments_gib", "compiler: arguments, GiB"),
    ("outputs_gib", "compiler: outputs, GiB"),
    ("temporaries_gib", "compiler: temporaries, GiB"),
    ("compiler_peak_gib", "compiler: peak, GiB"),
    ("measured_peak_gib", "measured peak (`memory_stats`), GiB"),
)


STEP_VARIANTS = {
    "default": "default",
    "highest": "highest",
    "default-xla-kda": "default, XLA's KDA intra-chunk ops",
    "default-xla-attention": "default, XLA's attention ops",
    "default-recompute-logits": "default, tiles recompute their logits",
    "default-tiles-4": "default, 4 tiles recompute their logits",
    "default-tiles-16": "default, 16 tiles",
    "default-rows-4-remat-full": "default, GA 2 of 4 rows, remat full, tiles recompute",
    "default-seq-8192": "default, seq 8192, GA 2 of 2 rows, remat full, tiles recompute",
}
"""bench.tpu_step's variants as the step table's columns (a record without one leaves it out)."""


def _step_table(step: dict) -> list[str]:
    variants = [v for v in STEP_VARIANTS if f"{v}.step_s" in step]
    lines = [
        "| figure | " + " | ".join(STEP_VARIANTS[v] for v in variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for key, label in STEP_FIGURES:
        cells = [step[f"{p}.{key}"] for p in variants]
        text = [f"{c:.1%}" if key == "fraction_of_peak" else _g(c) for c in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    return lines


TRAIN_FIGURES = (
    ("steps", "steps, straight"),
    ("resumed_at", "resumed from the checkpoint of step"),
    ("epochs", "epochs of the bundled corpus at seq 4096"),
    ("first_step_s", "first step (compile included), s"),
    ("step_s", "step (median), s"),
    ("tokens_per_s", "tokens / s (median)"),
    ("fraction_of_peak", "of the chip's bf16 peak (median)"),
    ("ce_first", "CE, first step"),
    ("ce_resumed_at", "CE at the checkpoint"),
    ("ce_last", "CE, last step"),
    ("resumed_first_step_s", "resumed process's first step (compile cache), s"),
    ("state_bit_identical", "last state, straight vs resumed, bit for bit"),
    ("metrics_bit_identical", "resumed steps' metrics, bit for bit"),
)


def _train_table(train: dict) -> list[str]:
    lines = ["| figure | value |", "|---|---|"]
    for key, label in TRAIN_FIGURES:
        value = train[key]
        if key.endswith("bit_identical"):
            text = "yes" if value else "**no**"
        elif key == "fraction_of_peak":
            text = f"{value:.1%}"
        elif key in ("steps", "resumed_at", "epochs"):
            text = str(int(value))
        else:
            text = _g(value)
        lines.append(f"| {label} | {text} |")
    return lines


def _profile_table(profile: dict) -> list[str]:
    lines = [
        "| op family | ms a step | share of the step | model TFLOP a step | model TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    families = [k.removesuffix(".share") for k in profile if k.endswith(".share")]
    for family in sorted(families, key=lambda f: -profile[f"{f}.share"]):
        seconds, share = profile[f"{family}.seconds"], profile[f"{family}.share"]
        flops = profile.get(f"{family}.flops")
        rate = ["", ""] if flops is None else [_g(flops * 1e-12), _g(flops / seconds * 1e-12)]
        cells = [family, f"{seconds * 1e3:.1f}", f"{share:.1%}", *rate]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(record: dict) -> str:
    """docs/tpu.md from docs/tpu.json's record."""
    device = record.get("tests", {}).get("device") or next(
        (s["device"] for s in record.get("lockstep", {}).values()), "a TPU"
    )
    out = [
        "# The TPU leg",
        "",
        f"Generated by `python -m bench.tpu_leg` on {device} (one chip; OLMo-core on the host's "
        'CPU). Matmul precision is `ScaleConfig.matmul_precision`: "highest" multiplies float32 '
        'as float32 (six bfloat16 passes), "default" in one bfloat16 pass. The chip\'s '
        "float32 exp, log, pow and sigmoid are libtpu's accurate ones (1 to 3 ulps from "
        "float64, a CPU's) in the tests and lockstep unless a table says otherwise, and its "
        "default ones (up to 4,000 ulps) in the step and in the tests' second run "
        "(`parity.tpu_runtime`).",
    ]
    if "tests" in record:
        out += [
            "",
            "## The model's numerics on the chip (`pytest -m tpu`, tests/test_tpu.py)",
            "",
            'Each check is held at "highest" to the bound shown: the one tests/test_tpu.py held '
            "when this record was made (goldens/tolerances.py names today's). With libtpu's "
            f"{record['tests'].get('transcendentals', 'default')} transcendentals; "
            '"default" is measured beside it. The last columns are the same tests run again '
            "with the default transcendentals (`--tpu-transcendentals default`), at "
            '"highest", held to their own bounds.',
            "",
            *_tests_table(record["tests"], record.get("tests-default")),
        ]
    if "lockstep" in record:
        group = next(iter(record["lockstep"].values()))["olmo_core_process_group"]
        out += [
            "",
            "## Lockstep, JAX on the chip "
            "(`python -m parity.replay --platform tpu --matmul-precision P`)",
            "",
            "Every step from OLMo-core's state, against the CPU's lockstep tolerances "
            "(`LOCKSTEP_ROUTED_ALIKE`, shown; `LOCKSTEP_REROUTED` at a step where a token slot "
            f"went to another expert). OLMo-core's process group: {group}.",
            "",
            *_lockstep_table(record["lockstep"]),
        ]
    out += [
        "",
        "## A hero-width slice's train step on the chip (`python -m bench tpu-step`)",
        "",
        "d_model 1024, 4 blocks (KDA 0-2, attention 3; block 0 dense), 64 routed experts of "
        "1024 in a 512 latent, top 16, seq 4096, GA 8 of 1 sequence, bf16 activations, "
        "fp32 params and Adam, remat none, 8 vocab tiles that keep their logits for the "
        "backward pass (bench/tpu_step.py); KDA's intra-chunk scores and attention by the Pallas "
        "kernels (`model.kda_pallas`, `model.attention_pallas`) unless a column says XLA's ops. "
        "Every column trains on the same 32,768 tokens a step.",
        "",
        *(
            _step_table(record["step"])
            if "step" in record
            else ["Not in this record: `python -m bench.tpu_leg step docs` on a TPU host adds it."]
        ),
        "",
        "## The slice trained, checkpointed and resumed (`python -m bench tpu-train`)",
        "",
        "`olmo-parity train --config slice --platform tpu` on the bundled corpus's tokens at seq "
        "4096 (150 instances, 18 global batches an epoch, later epochs in OLMo-core's order), "
        "EMO draws from the run's key, matmul precision default; a second process resumes from "
        "the checkpoint and both last checkpoints are compared array by array "
        "(bench/tpu_train.py).",
        "",
        *(
            _train_table(record["train"])
            if "train" in record
            else ["Not in this record: `python -m bench.tpu_leg train docs` on a TPU host adds it."]
        ),
        "",
        "## Where the slice's step spends the chip's time (`python -m bench tpu-profile`)",
        "",
        "`bench tpu-step`'s slice at matmul precision default, 3 steps traced by `jax.profiler` "
        "after 2: each op the chip ran goes to the family of the innermost named scope in its "
        "HLO metadata (`jax.named_scope` in the model; a fusion without one, to the family most "
        "of its ops carry), else to copies and layout or other compute by its opcode; idle is "
        "the step's wall time the chip ran no op (parity/profile.py). A family's model FLOPs "
        "are the step's (the tpu-step table's) split by the named scope that computes them "
        "(`model.flops.scope_flops`; other compute: the dense feed-forward and the norms): what "
        "the maths needs, not what the chip ran (a recomputation, the KDA chunk's blocks of 8 "
        "and padding run more).",
        "",
        *(
            _profile_table(record["profile"])
            if "profile" in record
            else [
                "Not in this record: `python -m bench.tpu_leg profile docs` on a TPU host adds it."
            ]
        ),
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tpu_leg", description=__doc__)
    commands = _commands(Path("."), STEPS)
    parser.add_argument("parts", nargs="*", choices=[[], *commands, "docs"], metavar="part")
    parser.add_argument("--work", type=Path, default=Path("tpu-leg"), help="records (tpu-leg/)")
    parser.add_argument("--steps", type=int, default=STEPS, help="lockstep steps (50)")
    args = parser.parse_args(argv)
    commands = _commands(args.work, args.steps)
    parts = args.parts or [*commands, "docs"]
    failed = []
    for part in parts:
        if part == "docs":
            docs = DOCS / "tpu.json"
            record = collect(args.work, json.loads(docs.read_text()) if docs.exists() else {})
            docs.write_text(json.dumps(record, indent=1))
            (DOCS / "tpu.md").write_text(render(record))
            print(f"wrote {DOCS / 'tpu.md'}")
            continue
        args.work.mkdir(parents=True, exist_ok=True)
        print(f"tpu leg: {part}: {' '.join(commands[part])}", flush=True)
        if subprocess.run(commands[part]).returncode != 0:
            failed.append(part)
    if failed:
        print(f"tpu leg: failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
