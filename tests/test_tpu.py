"""The TPU leg (`pytest -m tpu` on a TPU host; elsewhere every test skips, saying why): the model's
numerics on the chip, each held at matmul precision "highest" and also measured at "default" for
docs/tpu.md (`--tpu-record`, `python -m bench.tpu_leg`):

- rounding parity through the fp64 oracles (the whole micro model at trained weights, three
  blocks and two mixers at OLMo-core's initial and trained weights): each tensor within
  ROUNDING_PARITY (3, the CPU's bar) times OLMo-core float32's own error with libtpu's accurate
  float32 transcendentals (`--tpu-transcendentals accurate`, the default), and within
  TPU_ROUNDING_PARITY with its default ones, whose exp and log miss the CPU's bar;
- chunk_kda against FLA's naive reference (goldens/kda_chunk.safetensors), value and gradients,
  within the CPU's KDA_FORWARD and the chip's TPU_KDA_GRAD;
- the KDA chunk inverse against float64 on correlated keys (beta near 1 and near 2) and on keys
  OLMo-core trained;
- megablox's grouped matmuls at the hero's expert widths against the naive dispatch, values and
  gradients;
- the Pallas intra-chunk scores kernel at the slice's chunk (64 tokens, 128 channels) against
  float64 on the host's CPU, values and gradients, on keys OLMo-core trained (zero-padded to 128
  channels, which adds nothing) and correlated keys, within the CPU's KDA_PALLAS_SCORES
  (TPU_KDA_PALLAS_SCORES with the default exp); XLA's ops on the chip measured beside it;
- the micro model's train step (the golden trace's step 1) against the same step on the host's
  CPU: every reported term, every gradient, the expert counts equal.

Bounds measured on the chip are named TPU_* in goldens/tolerances.py."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from goldens.blocks import BLOCKS
from goldens.envelope import norm_gap
from goldens.oracle import MIXERS, WEIGHTS
from goldens.tolerances import (
    ATTENTION_PALLAS,
    KDA_FORWARD,
    KDA_PALLAS_SCORES,
    ROUNDING_PARITY,
    TPU_KDA_GRAD,
    TPU_KDA_INVERSE_BETA_1,
    TPU_KDA_INVERSE_BETA_2,
    TPU_KDA_PALLAS_SCORES,
    TPU_MEGABLOX,
    TPU_ROUNDING_PARITY,
    TPU_STEP_GRAD,
    TPU_STEP_TERMS,
)
from model import train_step as ts
from model.attention import causal_attention
from model.attention_pallas import pallas_causal_attention
from model.config import olmo35_tiny
from model.convert import from_olmo_core, model_entries, params_to_olmo_core
from model.kda_chunk import chunk_kda, intra_chunk_score_pair, invert_unit_lower, kda_chunk_system
from model.kda_pallas import pallas_intra_chunk_scores
from model.moe import megablox_matmul, naive_routed_experts, routed_experts
from model.objective import model_terms_fn
from model.precision import TPU_LANES
from parity.kda_systems import (
    WEAK_TO_STRONG,
    correlated_chunks,
    correlated_system,
    float64_scores,
    fp64_inverse,
    scores_and_grads,
    scores_error,
    trained_chunks,
    with_cotangents,
)
from parity.trace import load_trace
from tests.attention_cases import (
    attention_case,
    attention_error,
    float32_case,
    float64_attention,
    value_and_grads,
)
from tests.compare import (
    assert_close,
    assert_rounding_parity,
    rounding_ratios,
    tolerance_used,
)
from tests.micro_olmo_core import block_outputs, mixer_outputs, model_outputs, olmo_core_model

pytestmark = pytest.mark.tpu

PRECISIONS = ("highest", "default")
"""Held at the first, measured at both."""
ORACLE_CASES = [
    pytest.param("model", "trained", model_outputs, id="model-trained"),
    *(
        pytest.param(f"{kind}_{k}", w, outputs, id=f"{kind}_{k}-{w}")
        for kind, cases, outputs in (
            ("block", BLOCKS, block_outputs),
            ("mixer", MIXERS, mixer_outputs),
        )
        for k in cases
        for w in WEIGHTS
    ),
]
"""The fp64 oracles run on the chip (the whole model at its trained weights, where rounding
grows most; its initial weights are the gate's)."""
CORRELATED_SEEDS = range(16)
BETA_BANDS = {
    "near 1": ((0.9, 1.1), TPU_KDA_INVERSE_BETA_1),
    "near 2": ((1.9, 2.0), TPU_KDA_INVERSE_BETA_2),
}
MEGABLOX_TOKENS = 2048
MEGABLOX_EXPERTS = 64
"""The hero-width slice's routed experts (bench.tpu_step): 64 of the hero's width, top 16."""


@pytest.fixture(scope="module", autouse=True)
def on_tpu():
    if jax.default_backend() != "tpu":
        pytest.skip(
            f"no TPU: JAX runs on {jax.default_backend()} here; run `pytest -m tpu` on a TPU host"
        )


def _both(measure):
    """`measure()` at each of PRECISIONS: {precision: its result}."""
    out = {}
    for precision in PRECISIONS:
        with jax.default_matmul_precision(precision):
            out[precision] = measure()
    return out


@pytest.mark.parametrize(("case", "weights", "outputs"), ORACLE_CASES)
def test_rounding_parity_on_the_chip(
    golden, tpu_record, tpu_transcendentals, case, weights, outputs
):
    oracle = golden(f"oracle/{case}_{weights}.safetensors")
    model = olmo_core_model(golden, weights)
    ours = _both(lambda: outputs(model, oracle))
    if case == "model":
        ours = {p: tensors for p, (tensors, _) in ours.items()}

    def worst_ratio(tensors) -> float:
        return max(gap / own for gap, own in rounding_ratios(oracle, tensors).values())

    factor = ROUNDING_PARITY if tpu_transcendentals == "accurate" else TPU_ROUNDING_PARITY
    tpu_record(
        f"fp64 oracle, {case} at {weights} weights",
        f"worst tensor's error / OLMo-core float32's (the CPU's bar: {ROUNDING_PARITY:g})",
        **{p: worst_ratio(tensors) for p, tensors in ours.items()},
        bound=factor,
    )
    case_name = f"{case} at {weights} weights on the chip ({tpu_transcendentals} exp and log)"
    assert_rounding_parity(case_name, oracle, ours["highest"], factor=factor)


@jax.jit
def _chunk_kda_vjp(q, k, v, g, beta, state, do, dstate):
    out, vjp = jax.vjp(lambda *a: chunk_kda(*a[:5], initial_state=a[5]), q, k, v, g, beta, state)
    return out, vjp((do, dstate))


def test_chunk_kda_against_fla_on_the_chip(golden, tpu_record):
    g = golden("kda_chunk.safetensors")
    names = ("q", "k", "v", "g", "beta", "initial_state")
    inputs = [g[f"chunk.{n}"] for n in names]
    ours = _both(lambda: _chunk_kda_vjp(*inputs, g["recurrent.do"], g["recurrent.dstate"]))
    expected_out = (g["recurrent.o"], g["recurrent.final_state"])
    expected_grads = [g[f"recurrent.grad.{n}"] for n in names]
    for what, tol, pick, expected in (
        ("output and final state", KDA_FORWARD, 0, expected_out),
        ("gradients", TPU_KDA_GRAD, 1, expected_grads),
    ):
        used = {p: tolerance_used(expected, out[pick], tol) for p, out in ours.items()}
        tpu_record(f"chunk_kda vs FLA, {what}", "largest error / its tolerance", **used, bound=1.0)
    (o, final), grads = ours["highest"]
    assert_close("o", expected=g["recurrent.o"], actual=o, tol=KDA_FORWARD)
    assert_close("final_state", expected=g["recurrent.final_state"], actual=final, tol=KDA_FORWARD)
    assert_close("grad", expected=expected_grads, actual=list(grads), tol=TPU_KDA_GRAD)


_inverse = jax.jit(invert_unit_lower)


def _inverse_error(A: np.ndarray) -> dict[str, float]:
    """max |T - (I + A)^-1| over every entry, T from the chip at each precision."""
    exact = fp64_inverse(A)
    return {
        p: float(np.max(np.abs(np.asarray(T, np.float64) - exact)))
        for p, T in _both(lambda: _inverse(A)).items()
    }


@pytest.mark.parametrize("band", list(BETA_BANDS))
def test_kda_inverse_on_correlated_keys_on_the_chip(tpu_record, band):
    beta_range, tol = BETA_BANDS[band]
    errors = [
        _inverse_error(correlated_system(seed, sigma, beta_range, WEAK_TO_STRONG)[0])
        for seed in CORRELATED_SEEDS
        for sigma in (0.02, 0.2)
    ]
    worst = {p: max(e[p] for e in errors) for p in PRECISIONS}
    tpu_record(
        f"KDA chunk inverse, correlated keys, beta {band}",
        "max abs error vs float64",
        **worst,
        bound=tol.atol,
    )
    assert worst["highest"] <= tol.atol, worst


def test_kda_inverse_on_trained_keys_on_the_chip(golden, tpu_record):
    g = golden("kda_trained_keys.safetensors")
    A = np.asarray(jax.jit(kda_chunk_system)(g["k"], g["g"], g["beta"]))
    worst = _inverse_error(A)
    tol = TPU_KDA_INVERSE_BETA_1
    tpu_record(
        "KDA chunk inverse, trained keys", "max abs error vs float64", **worst, bound=tol.atol
    )
    assert worst["highest"] <= tol.atol, worst


KDA_SCORE_CASES = {
    "trained keys": lambda golden: trained_chunks(
        golden("kda_trained_keys.safetensors"), channels=TPU_LANES
    ),
    "correlated keys": lambda _: correlated_chunks(0, 0.2, WEAK_TO_STRONG, N=64),
}
_kernel_scores = scores_and_grads(pallas_intra_chunk_scores)
_xla_scores = scores_and_grads(intra_chunk_score_pair)


@pytest.mark.parametrize("case", list(KDA_SCORE_CASES))
def test_kda_intra_chunk_kernel_on_the_chip(golden, tpu_record, tpu_transcendentals, case):
    inputs = with_cotangents(*KDA_SCORE_CASES[case](golden))
    bound = KDA_PALLAS_SCORES if tpu_transcendentals == "accurate" else TPU_KDA_PALLAS_SCORES
    exact = float64_scores(inputs, jax.devices("cpu")[0])
    errors = {
        name: _both(lambda f=f: max(scores_error(f(*inputs), exact).values()))
        for name, f in (("kernel", _kernel_scores), ("XLA", _xla_scores))
    }
    _hold_the_kernel_beside_xla(
        tpu_record, f"KDA intra-chunk scores ({{}}) vs float64, {case}", errors, bound
    )


def _hold_the_kernel_beside_xla(tpu_record, check: str, errors: dict, bound: float):
    """Record a kernel's and XLA's errors on the chip ({"kernel" | "XLA": {precision: error}}) as
    `check` (its {} the name), and hold the kernel's at "highest" to `bound`."""
    for name, worst in errors.items():
        quantity = "worst tensor's largest error / its largest element"
        tpu_record(check.format(name), quantity, **worst, bound=bound)
    assert errors["kernel"]["highest"] <= bound, errors


_flash_vjps = jax.jit(functools.partial(value_and_grads, pallas_causal_attention))
_xla_attention_vjps = jax.jit(functools.partial(value_and_grads, causal_attention))


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "whole_rows"])
def test_flash_attention_on_the_chip(tpu_record, documents):
    """The Pallas flash kernel and XLA's ops on the chip against `causal_attention` in float64
    on the host's CPU: output and gradients, three documents a row or whole rows."""
    inputs, segments = attention_case(documents)
    with jax.default_device(jax.devices("cpu")[0]):
        exact = float64_attention(*inputs, segments)
    f32, ids = float32_case(inputs, segments)
    errors = {
        name: _both(lambda f=f: attention_error(exact, f(*f32, ids)))
        for name, f in (("kernel", _flash_vjps), ("XLA", _xla_attention_vjps))
    }
    rows = "documents" if documents else "whole rows"
    check = f"flash attention ({{}}) vs float64, {rows}"
    _hold_the_kernel_beside_xla(tpu_record, check, errors, ATTENTION_PALLAS)


@jax.jit
def _dispatch_vjps(z, indices, weights, w_up_gate, w_down, cotangent):
    """Value and gradients (z, weights, w_up_gate, w_down) of the naive spec and of megablox."""

    def vjp(dispatch):
        out, pullback = jax.vjp(
            lambda *a: dispatch(a[0], indices, *a[1:]), z, weights, w_up_gate, w_down
        )
        return out, pullback(cotangent)

    megablox = lambda *a: routed_experts(*a, matmul=megablox_matmul)  # noqa: E731
    return vjp(naive_routed_experts), vjp(megablox)


def test_megablox_against_the_naive_dispatch_at_hero_widths(tpu_record):
    moe = olmo35_tiny().model.moe
    N, E, k, L, H = MEGABLOX_TOKENS, MEGABLOX_EXPERTS, moe.top_k, moe.latent_dim, moe.expert_hidden
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    indices = np.argsort(rng.random((N, E)), axis=1)[:, :k].astype(np.int32)
    weights = rng.dirichlet(np.ones(k), N).astype(np.float32) * k
    args = (normal(N, L), indices, weights, 0.02 * normal(E, 2 * H, L), 0.02 * normal(E, H, L))
    runs = _both(lambda: _dispatch_vjps(*args, normal(N, L)))
    names = ("output", "grad z", "grad weights", "grad w_up_gate", "grad w_down")

    def gaps(run):
        (naive, naive_grads), (ours, our_grads) = run
        pairs = zip((naive, *naive_grads), (ours, *our_grads), strict=True)
        return {
            n: norm_gap(np.asarray(o), np.asarray(e))
            for n, (e, o) in zip(names, pairs, strict=True)
        }

    measured = {p: gaps(run) for p, run in runs.items()}
    for name in names:
        tpu_record(
            f"megablox vs naive dispatch, {name}",
            "relative error (norms)",
            **{p: m[name] for p, m in measured.items()},
            bound=TPU_MEGABLOX,
        )
    over = {n: g for n, g in measured["highest"].items() if not g <= TPU_MEGABLOX}
    assert not over, over


def _micro_step(trace, precision: str, device):
    """The micro train step's gradients (OLMo-core names) and reported terms at trace step 1,
    from OLMo-core's step-0 weights, on `device`."""
    cfg = trace.config
    cfg = dataclasses.replace(cfg, scale=dataclasses.replace(cfg.scale, matmul_precision=precision))
    graphdef, params = nnx.split(from_olmo_core(trace.params(0), cfg.model, flags=cfg.flags))
    accumulate = jax.jit(
        lambda p, mb: ts.accumulate(p, mb, cfg=cfg, terms_fn=model_terms_fn(graphdef, cfg))
    )
    params, batch = jax.device_put((params, trace.micro_batches(1, cfg.flags)), device)
    grads, terms = accumulate(params, batch)
    named = params_to_olmo_core(grads, model_entries(cfg.model))
    return {n: np.asarray(g) for n, g in named.items()}, {
        n: np.asarray(t) for n, t in terms.items()
    }


@pytest.fixture(scope="module")
def micro_steps():
    """{precision: (chip's (grads, terms), the host CPU's)}: the CPU multiplies float32 in float32
    at every precision."""
    trace = load_trace()
    tpu, cpu = jax.devices("tpu")[0], jax.devices("cpu")[0]
    return {p: (_micro_step(trace, p, tpu), _micro_step(trace, p, cpu)) for p in PRECISIONS}


def test_micro_train_step_against_the_cpu(micro_steps, tpu_record):
    def gaps(chip, cpu):
        (grads, terms), (cpu_grads, cpu_terms) = chip, cpu
        tensor = {n: norm_gap(grads[n], cpu_grads[n]) for n in cpu_grads}
        whole = norm_gap(
            np.concatenate([g.ravel() for g in grads.values()]),
            np.concatenate([g.ravel() for g in cpu_grads.values()]),
        )
        counts = "expert_counts"
        reported = {n: norm_gap(terms[n], cpu_terms[n]) for n in cpu_terms if n != counts}
        rerouted = int(np.abs(terms[counts] - cpu_terms[counts]).sum()) // 2
        return tensor, whole, reported, rerouted

    measured = {p: gaps(*runs) for p, runs in micro_steps.items()}
    worst_tensor = {p: max(m[0].values()) for p, m in measured.items()}
    rows = (
        (
            "gradient, whole model",
            "relative error (norms)",
            {p: m[1] for p, m in measured.items()},
            TPU_STEP_GRAD,
        ),
        ("gradient, worst tensor", "relative error (its norm)", worst_tensor, TPU_STEP_GRAD),
        (
            "gradient, median tensor",
            "relative error (its norm)",
            {p: float(np.median(list(m[0].values()))) for p, m in measured.items()},
            TPU_STEP_GRAD,
        ),
        (
            "reported terms, worst",
            "relative error",
            {p: max(m[2].values()) for p, m in measured.items()},
            TPU_STEP_TERMS,
        ),
        ("token slots routed elsewhere", "slots", {p: m[3] for p, m in measured.items()}, 0),
    )
    for quantity, unit, values, bound in rows:
        tpu_record(f"micro train step vs the CPU's, {quantity}", unit, **values, bound=bound)
    tensor, _, reported, rerouted = measured["highest"]
    assert rerouted == 0, f"{rerouted} token slots routed elsewhere than on the CPU"
    over = {
        n: g
        for n, g in {**tensor, **reported}.items()
        if not g <= (TPU_STEP_GRAD if n in tensor else TPU_STEP_TERMS)
    }
    assert not over, over
