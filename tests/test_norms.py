"""RMSNorm against OLMo-core's `RMSNorm` (goldens/rms_norm.safetensors): output and the input and
weight gradients of sum(y * cotangent), over d_model and per head with (H, D) gains."""

import jax
import pytest

from goldens.norms import EPS
from goldens.tolerances import FP32_FORWARD, FP32_GRAD
from model.norms import rms_norm
from tests.compare import assert_close


@jax.jit
def _norm_and_vjp(x, weight, cotangent):
    y, vjp = jax.vjp(lambda x, w: rms_norm(x, w, eps=EPS), x, weight)
    return y, vjp(cotangent)


@pytest.mark.parametrize("case", ["d_model", "per_head"])
def test_rms_norm_matches_olmo_core(golden, case):
    g = golden("rms_norm.safetensors")
    assert g.entry["config"]["eps"] == EPS
    y, (dx, dweight) = _norm_and_vjp(g[f"{case}.x"], g[f"{case}.weight"], g[f"{case}.cotangent"])
    assert_close("y", expected=g[f"{case}.y"], actual=y, tol=FP32_FORWARD)
    assert_close("dx", expected=g[f"{case}.dx"], actual=dx, tol=FP32_GRAD)
    assert_close("dweight", expected=g[f"{case}.dweight"], actual=dweight, tol=FP32_GRAD)
