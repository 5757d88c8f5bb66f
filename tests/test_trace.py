"""The golden training trace (goldens/trace/, OLMo-core's Trainer on the micro model) is whole and
usable by the replay: every metric at every step, finite; its LR is our schedule's with OLMo-core's
step offset at every step; its EMO draws lie in the micro config's pool range; its parameter
snapshots load into our model and come back bit-exactly; its manifest records the config an export
today would write."""

import numpy as np
import pytest

from goldens.tolerances import LR_SCHEDULE, TRACE_BLOCK_SUM
from goldens.trace import run_config
from model.config import micro, olmo_core
from model.convert import from_olmo_core, to_olmo_core
from model.optim import lr_at
from model.train_step import AUX_TERMS, METRICS
from tests.compare import assert_close


def test_every_metric_at_every_step(golden):
    g = golden("trace/metrics.safetensors")
    steps = g.entry["config"]["steps"]
    moe_layers = len(micro().model.moe_layers)
    for name in (*METRICS, "skipped"):
        assert g[name].shape == (steps,) and np.isfinite(g[name]).all(), name
    for name in (f"{n}_per_block" for n in AUX_TERMS):
        assert g[name].shape == (steps, moe_layers) and np.isfinite(g[name]).all(), name
    assert_close(
        "lb_loss", expected=g["lb_loss"], actual=g["lb_loss_per_block"].sum(1), tol=TRACE_BLOCK_SUM
    )


def test_trace_lr_is_our_schedule(golden):
    g = golden("trace/metrics.safetensors")
    steps = np.arange(len(g["lr"]))
    actual = lr_at(steps, olmo_core(micro()))
    assert_close("lr", expected=g["lr"], actual=actual, tol=LR_SCHEDULE)


def test_pool_draws_lie_in_the_pool_range(golden):
    draws = golden("trace/metrics.safetensors")["pool_draws"]
    emo = micro().model.moe.emo
    cfg = micro().train
    assert draws.shape[:4] == (
        len(draws),
        cfg.ga_steps,
        len(micro().model.moe_layers),
        cfg.micro_batch_size,
    )
    assert draws.min() >= emo.min_pool and draws.max() <= emo.max_pool


@pytest.mark.parametrize("step", [0, 10, 50])
def test_param_snapshots_load_into_our_model(golden, step):
    state = golden(f"trace/params_step{step}.safetensors").tensors
    back = to_olmo_core(from_olmo_core(state, micro().model))
    assert back.keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_manifest_records_the_config_an_export_writes(golden):
    made_for = golden("trace/metrics.safetensors").entry["config"]["config"]
    assert made_for == run_config(olmo_core(micro()))
