"""The Pallas intra-chunk scores kernel (model/kda_pallas.py) in Pallas's interpreter on a CPU:
chunk_kda through it against FLA's references (values and gradients), its scores and gradients
against float64 on keys OLMo-core trained and on correlated keys, and where the model uses it.
Mosaic's compile of it is in tests/test_tpu_compile.py, its numbers on the chip in
tests/test_tpu.py."""

import functools

import jax
import pytest

from goldens.tolerances import KDA_FORWARD, KDA_GRAD, KDA_PALLAS_SCORES
from model.config import KDA_KERNELS, KDAConfig, ScaleConfig
from model.kda import intra_chunk_scores_for
from model.kda_chunk import chunk_kda, intra_chunk_score_pair
from model.kda_pallas import pallas_intra_chunk_scores
from parity.kda_systems import (
    WEAK_TO_STRONG,
    correlated_chunks,
    float64_scores,
    scores_and_grads,
    scores_error,
    trained_chunks,
    with_cotangents,
)
from tests.compare import assert_close

interpreted = functools.partial(pallas_intra_chunk_scores, interpret=True)
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@jax.jit
def _chunk_kda_vjp(q, k, v, g, beta, state, do, dstate):
    def kda(*a):
        return chunk_kda(*a[:5], initial_state=a[5], scores=interpreted)

    out, vjp = jax.vjp(kda, q, k, v, g, beta, state)
    return out, vjp((do, dstate))


def test_chunk_kda_through_the_kernel_matches_fla(golden):
    """FLA's naive_recurrent_kda at T=256 (4 chunks of 64, blocks of 8), value and gradients."""
    g = golden("kda_chunk.safetensors")
    inputs = [g[f"chunk.{n}"] for n in NAMES]
    (o, final), grads = _chunk_kda_vjp(*inputs, g["recurrent.do"], g["recurrent.dstate"])
    assert_close("o", expected=g["recurrent.o"], actual=o, tol=KDA_FORWARD)
    assert_close("final_state", expected=g["recurrent.final_state"], actual=final, tol=KDA_FORWARD)
    expected = {n: g[f"recurrent.grad.{n}"] for n in NAMES}
    actual = dict(zip(NAMES, grads, strict=True))
    assert_close("grad", expected=expected, actual=actual, tol=KDA_GRAD)


@pytest.fixture(scope="module")
def trained(golden):
    """(q, k, g [B, H, N, 64, K] of a KDA layer OLMo-core trained, float32, and two cotangents),
    and their scores and gradients in float64."""
    inputs = with_cotangents(*trained_chunks(golden("kda_trained_keys.safetensors")))
    return inputs, float64_scores(inputs)


_kernel = scores_and_grads(interpreted)


def _errors(inputs, exact) -> dict[str, float]:
    with jax.default_matmul_precision("highest"):
        return scores_error(_kernel(*inputs), exact)


def test_kernel_matches_float64_on_trained_keys(trained):
    errors = _errors(*trained)
    assert max(errors.values()) <= KDA_PALLAS_SCORES, errors


def test_kernel_matches_float64_on_correlated_keys():
    """Keys around one direction, gates from weak to past exp's underflow (K = 32, as the
    trained keys', to share their compiled kernel)."""
    inputs = with_cotangents(*correlated_chunks(0, 0.2, WEAK_TO_STRONG, N=2, K=32))
    errors = _errors(inputs, float64_scores(inputs))
    assert max(errors.values()) <= KDA_PALLAS_SCORES, errors


def test_gates_one_percent_off_are_caught(trained):
    """The check has the power to fail: the kernel fed gates 1% off misses every tensor."""
    (q, k, gate, *cotangents), exact = trained
    errors = _errors((q, k, gate * 1.01, *cotangents), exact)
    assert min(errors.values()) > 100 * KDA_PALLAS_SCORES, errors


def test_the_kernel_runs_on_a_tpu_where_a_chunk_fits(monkeypatch):
    wide, narrow = KDAConfig(n_heads=2, head_dim=128), KDAConfig(n_heads=2, head_dim=32)
    assert intra_chunk_scores_for("pallas", wide, None) is intra_chunk_score_pair  # a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert intra_chunk_scores_for("pallas", wide, None) is pallas_intra_chunk_scores
    assert intra_chunk_scores_for("pallas", narrow, None) is intra_chunk_score_pair
    assert intra_chunk_scores_for("xla", wide, None) is intra_chunk_score_pair


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kda_kernel") as error:
        ScaleConfig(kda_kernel="triton")
    assert all(name in str(error.value) for name in KDA_KERNELS)
