"""The LM loss against OLMo-core's `cross_entropy_loss` (goldens/loss.safetensors), and vocab
tiling, flat and seq-major, against the untiled loss, on 1 device and with the tiles laid out over
8 (rows split over the mesh, as the model's `Layout` lays them out)."""

import functools

import jax
import numpy as np
import pytest

from goldens.loss import Z_WEIGHT
from goldens.tolerances import FP32_FORWARD, FP32_GRAD, VOCAB_TILING
from model.layout import Layout, make_mesh
from model.loss import cross_entropy_sums, lm_head_loss_sums
from tests.compare import assert_close


def _objective(sums):
    ce, z = sums
    return ce + Z_WEIGHT * z


def test_cross_entropy_matches_olmo_core(golden):
    g = golden("loss.safetensors")
    ce, z = cross_entropy_sums(g["logits"], g["labels"])
    grad = jax.grad(lambda x: _objective(cross_entropy_sums(x, g["labels"])))(g["logits"])
    assert_close("ce", expected=g["ce"].reshape(()), actual=ce, tol=FP32_FORWARD)
    assert_close("z", expected=g["z"].reshape(()), actual=z, tol=FP32_FORWARD)
    assert_close("grad.logits", expected=g["grad.logits"], actual=grad, tol=FP32_GRAD)


@functools.partial(jax.jit, static_argnames=("tiles", "seq_major", "layout"))
def _loss_and_grads(hidden, w_out, labels, *, tiles, seq_major, layout=None):
    def f(hidden, w_out):
        sums = lm_head_loss_sums(
            hidden, w_out, labels, tiles=tiles, seq_major=seq_major, layout=layout
        )
        return _objective(sums), sums

    grads, sums = jax.grad(f, argnums=(0, 1), has_aux=True)(hidden, w_out)
    return sums, grads


def _batch():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((8, 64, 32), dtype=np.float32)
    w_out = rng.standard_normal((32, 384), dtype=np.float32) / 4
    labels = rng.integers(0, 384, (8, 64)).astype(np.int32)
    labels[:, -1] = -100
    return hidden, w_out, labels


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("seq_major", [False, True], ids=["flat", "seq-major"])
def test_vocab_tiling_matches_untiled(seq_major, devices):
    hidden, w_out, labels = _batch()
    expected = _loss_and_grads(hidden, w_out, labels, tiles=1, seq_major=False)
    layout = None
    if devices > 1:
        layout = Layout(make_mesh(data=2, fsdp=2, expert=2))
        rows = layout.sharding(("batch",), labels.shape[:1])
        hidden, labels = jax.device_put(hidden, rows), jax.device_put(labels, rows)
    actual = _loss_and_grads(hidden, w_out, labels, tiles=4, seq_major=seq_major, layout=layout)
    assert_close("loss and grads", expected=expected, actual=actual, tol=VOCAB_TILING)


def test_tiles_must_divide_the_tiled_axis():
    hidden, w_out, labels = _batch()
    with pytest.raises(ValueError, match="vocab tiles=3 must divide T=64"):
        lm_head_loss_sums(hidden, w_out, labels, tiles=3, seq_major=True)
