"""The Pallas flash attention kernel (model/attention_pallas.py) in Pallas's TPU interpreter on a
CPU: its output and gradients against `causal_attention` in float64, with documents and without,
and where the model uses it. Mosaic's compile of it is in tests/test_tpu_compile.py."""

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from goldens.tolerances import ATTENTION_PALLAS
from model.attention import attention_kernel, causal_attention, causal_attention_for
from model.attention_pallas import pallas_causal_attention
from model.config import ATTENTION_KERNELS, AttentionConfig, ScaleConfig
from tests.attention_cases import (
    HKV,
    D,
    H,
    T,
    attention_case,
    attention_error,
    float32_case,
    float64_attention,
    value_and_grads,
)


@jax.jit
def _kernel(q, k, v, cotangent, segment_ids):
    with pltpu.force_tpu_interpret_mode():
        return value_and_grads(pallas_causal_attention, q, k, v, cotangent, segment_ids)


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "whole_rows"])
def test_kernel_matches_float64(documents):
    inputs, segments = attention_case(documents)
    expected = float64_attention(*inputs, segments)
    f32, ids = float32_case(inputs, segments)
    assert attention_error(expected, _kernel(*f32, ids)) <= ATTENTION_PALLAS
    off = _kernel(f32[0] * 1.01, *f32[1:], ids)  # a 1% error in the softmax's scale
    assert attention_error(expected, off) > 100 * ATTENTION_PALLAS


def test_the_model_runs_the_kernel_on_a_tpu_where_it_fits():
    config = AttentionConfig(n_heads=H, n_kv_heads=HKV, head_dim=D)
    assert attention_kernel("pallas", config, T, "tpu") == "pallas"
    assert attention_kernel("pallas", config, T, "cpu") == "xla"
    assert attention_kernel("xla", config, T, "tpu") == "xla"
    assert attention_kernel("pallas", config, T + 64, "tpu") == "xla"  # not whole 128 lanes
    narrow = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=32)  # the micro config's
    assert attention_kernel("pallas", narrow, T, "tpu") == "xla"
    assert causal_attention_for("pallas", config, T, None) is causal_attention  # a CPU
    with pytest.raises(ValueError, match="attention_kernel") as error:
        ScaleConfig(attention_kernel="splash")
    assert all(name in str(error.value) for name in ATTENTION_KERNELS)
