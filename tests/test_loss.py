"""The LM loss against OLMo-core's `cross_entropy_loss` (goldens/loss.safetensors), and vocab
tiling, flat and seq-major, recomputing its logits in the backward pass or keeping them, against
the untiled loss, on 1 device and with the tiles laid out over 8 (rows split over the mesh, as the
model's `Layout` lays them out)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from goldens.envelope import norm_gap
from goldens.loss import Z_WEIGHT
from goldens.tolerances import (
    BF16_TILED_GRADIENT_ROUNDING,
    FP32_FORWARD,
    FP32_GRAD,
    VOCAB_TILING,
)
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


def _tiled_objective(labels, **tiling):
    def f(hidden, w_out):
        sums = lm_head_loss_sums(hidden, w_out, labels, **tiling)
        return _objective(sums), sums

    return f


@functools.partial(jax.jit, static_argnames=("tiles", "seq_major", "layout", "keep_logits"))
def _loss_and_grads(hidden, w_out, labels, **tiling):
    """The two sums, and the gradients of each (CE's, then z's) with respect to hidden and w_out:
    apart, so that z's small weight in the objective hides no error in its gradient."""
    sums, vjp = jax.vjp(lambda h, w: lm_head_loss_sums(h, w, labels, **tiling), hidden, w_out)
    one, zero = jnp.ones_like(sums[0]), jnp.zeros_like(sums[0])
    return sums, vjp((one, zero)), vjp((zero, one))


def _batch():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((8, 64, 32), dtype=np.float32)
    w_out = rng.standard_normal((32, 384), dtype=np.float32) / 4
    labels = rng.integers(0, 384, (8, 64)).astype(np.int32)
    labels[:, -1] = -100
    return hidden, w_out, labels


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("seq_major", [False, True], ids=["flat", "seq-major"])
def test_vocab_tiling_matches_untiled(seq_major, devices, keep_logits):
    hidden, w_out, labels = _batch()
    expected = _loss_and_grads(hidden, w_out, labels, tiles=1, seq_major=False)
    layout = None
    if devices > 1:
        layout = Layout(make_mesh(data=2, fsdp=2, expert=2))
        rows = layout.sharding(("batch",), labels.shape[:1])
        hidden, labels = jax.device_put(hidden, rows), jax.device_put(labels, rows)
    actual = _loss_and_grads(
        hidden,
        w_out,
        labels,
        tiles=4,
        seq_major=seq_major,
        layout=layout,
        keep_logits=keep_logits,
    )
    assert_close("loss and grads", expected=expected, actual=actual, tol=VOCAB_TILING)


@pytest.mark.parametrize("keep_logits", [False, True])
def test_tiles_keep_their_logits_only_when_asked(keep_logits, capsys):
    """What the backward pass keeps of the forward: with `keep_logits` every tile's logits
    [tiles, tokens / tiles, V] (so the LM head's matmul is not run again), without it nothing
    of the vocab's width but the weight."""
    hidden, w_out, labels = _batch()
    f = _tiled_objective(labels, tiles=4, keep_logits=keep_logits)
    capsys.readouterr()
    print_saved_residuals(lambda h, w: f(h, w)[0], hidden, w_out)
    kept = [
        tuple(map(int, s.split(","))) for s in re.findall(r"\[([\d,]+)\]", capsys.readouterr().out)
    ]
    V = w_out.shape[-1]
    logits = (4, labels.size // 4, V)
    assert [s for s in kept if V in s and s != w_out.shape] == ([logits] if keep_logits else [])


def _float64_ce_gradients(hidden, w_out, labels):
    """The oracle: d/d hidden and d/d w_out of sum CE(hidden @ w_out, labels), in numpy float64."""
    logits = hidden @ w_out
    d_logits = np.exp(logits - logits.max(-1, keepdims=True))
    d_logits /= d_logits.sum(-1, keepdims=True)
    d_logits[np.arange(len(labels)), labels] -= 1
    return d_logits @ w_out.T, hidden.T @ d_logits


@functools.partial(jax.jit, static_argnames="tiles")
def _ce_gradients(hidden, w_out, labels, tiles):
    ce = lambda h, w: lm_head_loss_sums(h, w, labels, tiles=tiles, keep_logits=True)[0]  # noqa: E731
    return jax.grad(ce, argnums=(0, 1))(hidden, w_out)


def test_bfloat16_tiles_round_each_gradient_once():
    """In bfloat16, 8 tiles' gradients are as far from float64 as the untiled loss's, each
    rounded to bfloat16 once (the hidden states' gradient summed over the vocab tiles in float32,
    the weight's columns written once)."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1024, 64)).astype(jnp.bfloat16)
    w_out = (rng.standard_normal((64, 4096)) / 8).astype(jnp.bfloat16)
    labels = rng.integers(0, 4096, 1024).astype(np.int32)
    oracle = _float64_ce_gradients(hidden.astype(np.float64), w_out.astype(np.float64), labels)

    def gaps(tiles):
        grads = _ce_gradients(hidden[None], w_out, labels[None], tiles)
        return np.array([norm_gap(g, o) for g, o in zip(grads, oracle, strict=True)])

    untiled, tiled = gaps(1), gaps(8)
    assert np.all(tiled <= BF16_TILED_GRADIENT_ROUNDING * untiled), (tiled, untiled)


def test_tiles_must_divide_the_tiled_axes():
    hidden, w_out, labels = _batch()
    with pytest.raises(ValueError, match="vocab tiles=3 must divide T=64"):
        lm_head_loss_sums(hidden, w_out, labels, tiles=3, seq_major=True)
    with pytest.raises(ValueError, match="vocab tiles=16 must divide the vocab V=376"):
        lm_head_loss_sums(hidden, w_out[:, :376], labels, tiles=16)
