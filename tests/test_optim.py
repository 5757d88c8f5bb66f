"""The optimizer step against OLMo-core's schedulers and SkipStepAdamW (goldens/optim.safetensors):
every schedule's LR at every step, with OLMo-core's step offset and without it; three AdamW steps
with clipping and the embedding group's zero weight decay; the skip-step decisions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goldens.tolerances import ADAMW_STEP, BITWISE, LR_SCHEDULE
from model import config as c
from model import optim
from tests.compare import assert_close

SCHEDULES = ["constant_with_warmup", "cosine", "linear", "wsd"]


def _config(schedule="constant_with_warmup", offset=1):
    cfg = c.olmo_core(c.micro())
    flags = dataclasses.replace(cfg.flags, warmup_step_offset=offset)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, schedule=schedule), flags=flags
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lr_matches_olmo_core_every_step(golden, schedule):
    """Trainer step s (from 0) uses OLMo-core's current = s + 1; MaxText's offset 0 lags a step."""
    expected = golden("optim.safetensors")[f"lr.{schedule}"]
    steps = jnp.arange(len(expected) - 1)
    assert_close(
        "lr", expected=expected[1:], actual=optim.lr_at(steps, _config(schedule)), tol=LR_SCHEDULE
    )
    assert_close(
        "lr",
        expected=expected[:-1],
        actual=optim.lr_at(steps, _config(schedule, 0)),
        tol=LR_SCHEDULE,
    )


def _params(g, step):
    prefix = f"adamw.param.{step}."
    tree = {k.removeprefix(prefix): v for k, v in g.tensors.items() if k.startswith(prefix)}
    return {
        "embeddings": {"weight": tree["embeddings.weight"]},
        "w": {"weight": tree["w.weight"]},
        "norm": tree["norm"],
    }


def _grads(g, step):
    return {
        "embeddings": {"weight": g[f"adamw.grad.{step}.embeddings.weight"]},
        "w": {"weight": g[f"adamw.grad.{step}.w.weight"]},
        "norm": g[f"adamw.grad.{step}.norm"],
    }


def test_adamw_steps_match_olmo_core(golden):
    g = golden("optim.safetensors")
    cfg = _config()
    params = jax.tree.map(jnp.asarray, _params(g, 0))
    state = optim.init(params, cfg)
    step = jax.jit(lambda p, gr, s, i: optim.step(p, gr, s, step=i, loss=3.0, cfg=cfg))
    for i in range(3):
        params, state, metrics = step(params, _grads(g, i + 1), state, i)
        assert_close(
            f"params after step {i + 1}", expected=_params(g, i + 1), actual=params, tol=ADAMW_STEP
        )
        assert_close(
            "grad_norm",
            expected=g["adamw.grad_norm"][i],
            actual=metrics["grad_norm"],
            tol=ADAMW_STEP,
        )
        assert_close("lr", expected=g["adamw.lr"][i], actual=metrics["lr"], tol=LR_SCHEDULE)
        assert not metrics["skipped"]


def test_skip_step_decisions_match_olmo_core(golden):
    g = golden("optim.safetensors")
    cfg = _config()
    state = optim.init({"x": jnp.zeros(1)}, cfg).skip
    record = jax.jit(optim.record)
    decide = jax.jit(
        lambda s: optim.proceeds(
            s, sigma=cfg.train.skip_step_sigma, window=cfg.train.skip_step_window
        )
    )
    factors = []
    for loss, norm in zip(g["skip.loss"], g["skip.grad_norm"], strict=True):
        state = record(state, loss, norm)
        factors.append(float(decide(state)))
    np.testing.assert_array_equal(np.array(factors), g["skip.factor"])
    assert np.flatnonzero(g["skip.factor"] == 0).tolist() == [70, 75]


def test_skipped_step_changes_nothing_but_the_history(golden):
    g = golden("optim.safetensors")
    cfg = _config()
    params = jax.tree.map(jnp.asarray, _params(g, 0))
    state = optim.init(params, cfg)
    for i in range(70):  # a flat history, then a loss 100 sigma above it
        params, state, _ = optim.step(
            params,
            jax.tree.map(jnp.zeros_like, params),
            state,
            step=i,
            loss=3.0 + 1e-3 * (i % 2),
            cfg=cfg,
        )
    after, new_state, metrics = optim.step(params, _grads(g, 2), state, step=70, loss=4.0, cfg=cfg)
    assert metrics["skipped"]
    assert_close("params", expected=params, actual=after, tol=BITWISE)
    assert_close("adam", expected=state.adam, actual=new_state.adam, tol=BITWISE)


def test_resumed_state_steps_as_olmo_core(golden):
    """Adam's moments and count taken out after step 1 and put back with `resume` give
    OLMo-core's params after step 2 (a count off by one changes the bias correction)."""
    g = golden("optim.safetensors")
    cfg = _config()
    params = jax.tree.map(jnp.asarray, _params(g, 0))
    params, state, _ = optim.step(
        params, _grads(g, 1), optim.init(params, cfg), step=0, loss=3.0, cfg=cfg
    )
    mu, nu = optim.moments(state)
    resumed = optim.resume(params, cfg, mu=mu, nu=nu, count=1, losses=[3.0], grad_norms=[1.0])
    params, _, _ = optim.step(params, _grads(g, 2), resumed, step=1, loss=3.0, cfg=cfg)
    assert_close("params after step 2", expected=_params(g, 2), actual=params, tol=ADAMW_STEP)


def test_resumed_history_decides_as_olmo_core(golden):
    """The skip history OLMo-core held before its first skipped step (oldest first), put back
    with `resume`, skips that step."""
    g = golden("optim.safetensors")
    cfg = _config()
    window = cfg.train.skip_step_window + 1
    first_skip = int(np.flatnonzero(g["skip.factor"] == 0)[0])
    start = max(0, first_skip - window + 1)
    losses = g["skip.loss"][start:first_skip].tolist()
    norms = g["skip.grad_norm"][start:first_skip].tolist()
    x = {"x": jnp.zeros(1)}
    state = optim.resume(x, cfg, mu=x, nu=x, count=0, losses=losses, grad_norms=norms).skip
    state = optim.record(state, g["skip.loss"][first_skip], g["skip.grad_norm"][first_skip])
    sigma, w = cfg.train.skip_step_sigma, cfg.train.skip_step_window
    assert not optim.proceeds(state, sigma=sigma, window=w)


def test_resume_refuses_a_history_longer_than_the_window():
    cfg = _config()
    x = {"x": jnp.zeros(1)}
    too_long = [1.0] * (cfg.train.skip_step_window + 2)
    with pytest.raises(ValueError, match="skip history"):
        optim.resume(x, cfg, mu=x, nu=x, count=0, losses=too_long, grad_norms=too_long)
