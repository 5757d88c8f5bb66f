"""The diagnosis (`model.diagnosis`): every candidate's code path changes the quantity it should,
each on a small case (the golden-batch checks of all candidates run in `tox -e slow`), and the
report generator runs on a 2-step ablation of the golden trace: the mean-over-layers run, whose
aux losses at step 1 are OLMo-core's divided by the MoE layers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import (
    BF16_LOGITS_ROUNDING,
    DRAWS_AGREE_BY_CHANCE,
    RAW_WEIGHT_SUMS_VISIBLE,
    ROUTING_WEIGHT_SUM,
    STEP_ONE,
)
from model import diagnosis, replay
from model.config import micro, olmo_core
from model.golden_trace import load_trace
from model.optim import lr_at
from model.router import Router, route, set_logits_dtype
from tests.compare import assert_close

STEPS = 2
GATE_CANDIDATES = ["aux_mean"]
"""One compile: OLMo-core's own run at step 1 is the replay's (tests/test_replay.py), every
candidate's is `tox -e slow`'s (tests/test_diagnosis_full.py)."""


@pytest.fixture(scope="module")
def ablation():
    trace = load_trace()
    results = diagnosis.run_all(trace, steps=STEPS, names=GATE_CANDIDATES)
    return trace, [diagnosis._with_aux(trace, r) for r in results]


def test_report_structure(ablation, snapshot, tmp_path):
    trace, results = ablation
    names = [c.name for c in diagnosis.candidates(trace.config)]
    rows = diagnosis.table(results)
    assert [len(r) for r in rows] == [len(diagnosis.COLUMNS)] * len(results)
    report = diagnosis.report(trace, results, steps=STEPS)
    assert all(f"`{r['name']}`" in report for r in results)
    diagnosis.plot(results, tmp_path / "diagnosis.png")
    assert (tmp_path / "diagnosis.png").stat().st_size > 10_000
    assert {"columns": list(diagnosis.COLUMNS), "candidates": names} == snapshot


def test_mean_divides_by_the_moe_layers(ablation):
    trace, results = ablation
    by_name = {r["name"]: r for r in results}
    n_moe = len(trace.moe_blocks)
    step_1 = by_name["aux_mean"]["rows"][0]
    for name in diagnosis.AUX:
        golden = float(trace.metrics[name][0])
        assert_close(name, expected=golden / n_moe, actual=step_1[name], tol=STEP_ONE)


def test_warmup_from_0_starts_at_lr_0():
    cfg = olmo_core(micro())
    maxtext = dataclasses.replace(cfg, flags=dataclasses.replace(cfg.flags, warmup_step_offset=0))
    assert float(lr_at(0, maxtext)) == 0.0
    assert float(lr_at(0, cfg)) == pytest.approx(cfg.train.lr / cfg.train.warmup_steps)


def test_jax_draws_have_olmo_core_s_distribution_not_its_values():
    trace = load_trace()
    emo = trace.config.model.moe.emo
    ours = replay.micro_batches(trace, replay.Run(trace.config, draws="jax"), 1)["pool_draws"]
    theirs = trace.micro_batches(1, trace.config.flags)["pool_draws"]
    assert ours.shape == theirs.shape
    assert ours.min() >= emo.min_pool and ours.max() <= emo.max_pool
    assert np.mean(ours[..., 0] == theirs[..., 0]) < DRAWS_AGREE_BY_CHANCE


def _router():
    return Router(dataclasses.replace(micro().model.moe, emo=None), 64, rngs=nnx.Rngs(0))


def test_router_logits_in_bfloat16_round_them():
    router = _router()
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    exact = router(x).logits
    set_logits_dtype(router, "bfloat16")
    rounded = router(x).logits
    err = float(jnp.max(jnp.abs(rounded - exact)) / jnp.max(jnp.abs(exact)))
    low, high = BF16_LOGITS_ROUNDING
    assert low < err < high, err
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        set_logits_dtype(router, "float16")


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
