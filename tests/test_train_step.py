"""Gradient accumulation on a small LM (embedding -> LM head, CE + z-loss): GA = 1, 2 and 4 give
the whole-batch gradients and report the same CE and z-loss (within GA_INVARIANT), with and without
the params loop barrier; D is OLMo-core's count of labels not ignored; aux reduction sum/mean."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goldens.tolerances import GA_INVARIANT
from model import config as c
from model import train_step as ts
from parity import small_lm
from tests.compare import assert_close

B, T = 8, 32
small_lm_terms = small_lm.terms_fn()


def _setup():
    return small_lm.params_and_rows(vocab=64, d_model=16, rows=B, seq_len=T)


_micro = small_lm.micro_batches


@functools.partial(jax.jit, static_argnames=("ga", "barrier"))
def _accumulate(params, rows, *, ga, barrier):
    cfg = c.micro()
    cfg = c.dataclasses.replace(cfg, flags=c.Flags(ga_params_loop_barrier=barrier))
    return ts.accumulate(params, _micro(rows, ga), cfg=cfg, terms_fn=small_lm_terms)


@pytest.mark.parametrize("barrier", [False, True], ids=["plain", "loop-barrier"])
def test_ga_gives_whole_batch_grads_and_losses(barrier):
    params, rows = _setup()
    expected = _accumulate(params, rows, ga=1, barrier=False)
    for ga in (2, 4):
        assert_close(
            f"GA={ga}",
            expected=expected,
            actual=_accumulate(params, rows, ga=ga, barrier=barrier),
            tol=GA_INVARIANT,
        )


def test_loss_div_factor_counts_olmo_core_labels():
    """D = labels not ignored: B rows of T - 1 (OLMo-core's last label is -100)."""
    _, rows = _setup()
    assert float(ts.loss_div_factor(_micro(rows, 2))) == B * (T - 1)


def test_reported_losses_are_the_batch_means():
    """GA=4 reports CE = the whole batch's mean CE, z-loss = weight * mean logsumexp^2."""
    params, rows = _setup()
    _, terms = _accumulate(params, rows, ga=4, barrier=False)
    logits = params["embeddings"][rows["inputs"]] @ params["w_out"]
    labels = rows["labels"]
    keep = labels != -100
    lse = jax.nn.logsumexp(logits, -1)
    ce = lse - jnp.take_along_axis(logits, jnp.where(keep, labels, 0)[..., None], -1)[..., 0]
    expected = {
        "ce": ce[keep].mean(),
        "z_loss": c.micro().train.z_loss_weight * (lse[keep] ** 2).mean(),
    }
    assert_close("terms", expected=expected, actual=terms, tol=GA_INVARIANT)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ga_reports_router_losses_once_per_batch(reduction):
    """LB is a per-micro-batch statistic (counts times mean scores), so GA changes it unless the
    micro-batches are alike: with the same 2 rows in every micro-batch, GA = 1, 2 and 4 report
    the same LB and router z-loss (the seed's bug reported them GA times too large) and give the
    same gradients, for either reduction over the routers."""
    params, rows = small_lm.params_and_rows(vocab=64, d_model=16, rows=2, seq_len=T, routers=3)
    rows = {k: np.tile(v, (4, 1)) for k, v in rows.items()}
    cfg = c.olmo_core(c.micro())
    cfg = c.dataclasses.replace(
        cfg, flags=c.dataclasses.replace(cfg.flags, moe_aux_loss_reduction=reduction)
    )
    accumulate = jax.jit(
        lambda p, mb: ts.accumulate(p, mb, cfg=cfg, terms_fn=small_lm_terms), static_argnums=()
    )
    expected = accumulate(params, _micro(rows, 1))
    assert set(expected[1]) == {
        "ce",
        "z_loss",
        "lb_loss",
        "router_z_loss",
        "lb_loss_per_layer",
        "router_z_loss_per_layer",
    }
    for ga in (2, 4):
        assert_close(
            f"GA={ga}",
            expected=expected,
            actual=accumulate(params, _micro(rows, ga)),
            tol=GA_INVARIANT,
        )


def test_aux_reduction_sum_and_mean():
    per_layer = jnp.array([0.5, 1.0, 2.0, 4.5])
    assert float(ts.combine_aux(per_layer, "sum")) == 8.0
    assert float(ts.combine_aux(per_layer, "mean")) == 2.0


def test_train_steps_move_params_the_same_for_any_ga():
    """Two full steps (accumulate, clip, AdamW) from the same params with GA = 1 and GA = 4."""
    params, rows = _setup()
    cfg = c.olmo_core(c.micro())
    step = jax.jit(
        lambda state, mb: ts.train_step(state, mb, cfg=cfg, terms_fn=small_lm_terms),
    )
    results = {}
    for ga in (1, 4):
        state = ts.init_state(params, cfg)
        for _ in range(2):
            state, metrics = step(state, _micro(rows, ga))
        results[ga] = (state.params, {k: metrics[k] for k in ("ce", "z_loss", "lr", "grad_norm")})
    assert_close("GA=4", expected=results[1], actual=results[4], tol=GA_INVARIANT)
    assert int(state.step) == 2
