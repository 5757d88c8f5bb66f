"""The diagnosis (`parity.diagnosis`): every candidate's code path changes the quantity it should,
each on a small case (the golden-batch checks of all candidates run in `tox -e slow`), and the
report generator runs on a 2-step ablation of the golden trace: OLMo-core's own flags, the
report's floor, whose every gap at step 1 is within one step's rounding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import (
    BF16_LOGITS_ROUNDING,
    BITWISE,
    DRAWS_AGREE_BY_CHANCE,
    RAW_WEIGHT_SUMS_VISIBLE,
    ROUTING_WEIGHT_SUM,
    SHARDED,
    STEP_ONE_METRIC,
)
from model import train_step as ts
from model.config import micro, olmo_core
from model.optim import lr_at
from model.router import Router, route
from model.train_step import AUX_TERMS
from parity import small_lm
from parity.diagnosis import ablation, candidates, report, variants
from parity.diagnosis.ablation import GAPS
from parity.run import Run, micro_batches
from parity.trace import load_trace
from tests.compare import assert_close

STEPS = 2
GATE_CANDIDATES = ["olmo_core"]
"""No compile of its own: OLMo-core's flags are the free-running replay's step
(tests/test_replay.py, tests/test_train.py; one xdist scope, conftest.py). Every candidate's
step 1 is `tox -e slow`'s (tests/test_diagnosis_full.py)."""


@pytest.fixture(scope="module")
def ablated():
    trace = load_trace()
    return trace, ablation.run_all(trace, steps=STEPS, names=GATE_CANDIDATES)


def test_report_structure(ablated, snapshot, tmp_path):
    trace, results = ablated
    names = [c.name for c in candidates.candidates(trace.config)]
    rows = report.table(results)
    assert [len(r) for r in rows] == [len(report.COLUMNS)] * len(results)
    markdown = report.report(trace, results, steps=STEPS)
    assert all(f"`{r.name}`" in markdown for r in results)
    assert "+11-72%" in markdown and "+7-32%" in markdown, "the seed's pattern, from SEED_PATTERN"
    report.plot(results, tmp_path / "diagnosis.png")
    assert (tmp_path / "diagnosis.png").stat().st_size > 10_000
    assert {"columns": list(report.COLUMNS), "candidates": names} == snapshot


def test_unknown_candidate_is_named():
    with pytest.raises(ablation.UnknownCandidateError, match="aux_men"):
        ablation.run_all(load_trace(), steps=1, names=["aux_men"])


def test_olmo_core_s_own_flags_leave_no_gap_at_step_1(ablated):
    """The report's floor: from OLMo-core's step-0 weights, every gap within one step's rounding."""
    _, (result,) = ablated
    gaps = {name: per_step[0] for name, per_step in result.gaps.items()}
    assert set(gaps) == set(GAPS)
    assert all(abs(gap) <= STEP_ONE_METRIC for gap in gaps.values()), gaps


def test_warmup_from_0_starts_at_lr_0():
    cfg = olmo_core(micro())
    maxtext = dataclasses.replace(cfg, flags=dataclasses.replace(cfg.flags, warmup_step_offset=0))
    assert float(lr_at(0, maxtext)) == 0.0
    assert float(lr_at(0, cfg)) == pytest.approx(cfg.train.lr / cfg.train.warmup_steps)


def test_jax_draws_have_olmo_core_s_distribution_not_its_values():
    trace = load_trace()
    emo = trace.config.model.moe.emo
    run = Run(trace.config, draws=variants.JaxDraws(emo))
    ours = micro_batches(trace, run, 1)["pool_draws"]
    theirs = trace.micro_batches(1, trace.config.flags)["pool_draws"]
    assert ours.shape == theirs.shape
    assert ours.min() >= emo.min_pool and ours.max() <= emo.max_pool
    assert np.mean(ours[..., 0] == theirs[..., 0]) < DRAWS_AGREE_BY_CHANCE


def _router_logits(router_dtype, x):
    moe = dataclasses.replace(micro().model.moe, emo=None, router_dtype=router_dtype)
    return Router(moe, 64, std=micro().model.init_std, rngs=nnx.Rngs(0))(x).logits


def test_router_logits_in_bfloat16_round_them():
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    exact, rounded = _router_logits(None, x), _router_logits("bfloat16", x)
    err = float(jnp.max(jnp.abs(rounded - exact)) / jnp.max(jnp.abs(exact)))
    low, high = BF16_LOGITS_ROUNDING
    assert low < err < high, err
    with pytest.raises(ValueError, match=r"MoEConfig\.router_dtype"):
        dataclasses.replace(micro().model.moe, router_dtype="float16")


@pytest.mark.parametrize(
    ("normalize", "restore", "total"),
    [(True, True, 2.0), (True, False, 1.0), (False, False, None)],
    ids=["olmo_core", "no_scale_restore", "no_weight_norm"],
)
def test_expert_weight_normalisation_and_scale(normalize, restore, total):
    logits = jax.random.normal(jax.random.key(2), (2, 8, 16))
    routing = route(logits, top_k=2, normalize=normalize, restore_weight_scale=restore)
    sums = np.asarray(routing.weights.sum(-1))
    if total is None:  # the raw top-2 probabilities: below 1, varying
        assert sums.max() < 1.0 and sums.std() > RAW_WEIGHT_SUMS_VISIBLE
    else:
        assert_close(
            "weight sums", expected=np.full_like(sums, total), actual=sums, tol=ROUTING_WEIGHT_SUM
        )


def test_segments_per_row_give_one_document_a_row():
    trace = load_trace()
    flags = dataclasses.replace(trace.config.flags, olmo_segment_ids_from_eos=None)
    per_row = trace.micro_batches(1, flags)["inputs_segmentation"]
    per_document = trace.micro_batches(1, trace.config.flags)["inputs_segmentation"]
    assert (per_row == 1).all() and per_document.max() > 1


def _small_lm():
    params, rows = small_lm.params_and_rows(vocab=64, d_model=16, rows=2, seq_len=32, routers=3)
    return params, {k: np.tile(v, (4, 1)) for k, v in rows.items()}


def test_micro_batch_mean_logs_are_ga_times_too_large():
    """Four identical micro-batches: OLMo-core's logs equal GA = 1's, MaxText's old ones are 4
    times them for z-loss and both router losses (CE is right either way); the gradients are
    OLMo-core's."""
    params, rows = _small_lm()
    cfg = olmo_core(micro())
    run = jax.jit(
        lambda mb, wrap: ts.accumulate(params, mb, cfg=cfg, terms_fn=wrap(small_lm.terms_fn())),
        static_argnums=1,
    )
    same = lambda terms_fn: terms_fn  # noqa: E731
    grads, fixed = run(small_lm.micro_batches(rows, 4), same)
    old_grads, old = run(small_lm.micro_batches(rows, 4), variants.micro_batch_mean_logs)
    _, single = run(small_lm.micro_batches(rows, 1), same)
    assert_close("fixed = GA 1", expected=single, actual=fixed, tol=SHARDED)
    expected_old = {k: v if k == "ce" else 4 * v for k, v in single.items()}
    assert_close("old = 4 x GA 1", expected=expected_old, actual=old, tol=SHARDED)
    assert_close("grads", expected=grads, actual=old_grads, tol=BITWISE)


@pytest.mark.parametrize(
    ("wrap", "own"),
    [
        (variants.aux_per_micro_batch_labels, lambda mb: ts.loss_div_factor(mb)),
        (variants.aux_per_micro_batch_positions, lambda mb: float(mb["labels"].size)),
    ],
    ids=["labels", "positions"],
)
def test_micro_batch_aux_normalisers(wrap, own):
    """One micro-batch of four: the variants' router losses, and their gradients, are the
    OLMo-core terms computed with the micro-batch's own labels or positions as D; CE and z-loss
    keep the batch's D."""
    params, rows = _small_lm()
    mb = jax.tree.map(lambda x: x[0], small_lm.micro_batches(rows, 4))
    terms_fn, div = small_lm.terms_fn(), 4 * ts.loss_div_factor(mb)

    def value_and_grads(fn, d):
        return jax.value_and_grad(lambda p: fn(p, mb, d)["lb_loss"].sum())(params), fn(
            params, mb, d
        )

    (_, grads), terms = value_and_grads(wrap(terms_fn), div)
    (_, expected_grads), expected = value_and_grads(terms_fn, own(mb))
    for name in AUX_TERMS:
        assert_close(name, expected=expected[name], actual=terms[name], tol=SHARDED)
    assert_close("LB gradient", expected=expected_grads, actual=grads, tol=SHARDED)
    plain = terms_fn(params, mb, div)
    assert_close("ce, z", expected=plain["ce"], actual=terms["ce"], tol=BITWISE)
