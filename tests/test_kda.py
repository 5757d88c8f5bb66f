"""KDA against FLA's references and OLMo-core's `KimiDeltaAttention` (goldens/kda_*.safetensors):
the recurrent form, the chunked form (its chunk system A and (I + A)^-1 too), their gradients, the
whole layer with OLMo-core's weights; segment ids restart the state exactly as separate runs."""

import functools
import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import KDA_FORWARD, KDA_GRAD, KDA_SEPARATE_RUNS, SEGMENTS_VISIBLE
from model.config import micro
from model.convert import kda_entries, load_olmo_core, params_to_olmo_core
from model.kda import KimiDeltaAttention
from model.kda_chunk import chunk_kda, invert_unit_lower, kda_chunk_system, recurrent_kda
from tests.compare import assert_close
from tests.modules import apply, module_vjp

INPUTS = ("q", "k", "v", "g", "beta")


def _inputs(g, prefix):
    return [g[f"{prefix}.{n}"] for n in INPUTS], g[f"{prefix}.initial_state"]


@functools.partial(jax.jit, static_argnames="form")
def _kda_vjp(q, k, v, g, beta, state, do, dstate, form):
    fn = {"recurrent": recurrent_kda, "chunk": chunk_kda}[form]
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5]), q, k, v, g, beta, state)
    return out, vjp((do, dstate))


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_kda_forms_match_fla_with_gradients(golden, form):
    """Both forms equal FLA's naive_recurrent_kda at T=256 (4 chunks), value and gradient."""
    g = golden("kda_chunk.safetensors")
    inputs, state = _inputs(g, "chunk")
    (o, final), grads = _kda_vjp(*inputs, state, g["recurrent.do"], g["recurrent.dstate"], form)
    assert_close("o", expected=g["recurrent.o"], actual=o, tol=KDA_FORWARD)
    assert_close("final_state", expected=g["recurrent.final_state"], actual=final, tol=KDA_FORWARD)
    names = [*INPUTS, "initial_state"]
    expected = {n: g[f"recurrent.grad.{n}"] for n in names}
    assert_close(
        "grad", expected=expected, actual=dict(zip(names, grads, strict=True)), tol=KDA_GRAD
    )


def test_chunk_matches_fla_naive_chunk(golden):
    """The chunk system, its inverse and the outputs equal FLA's naive_chunk_kda internals."""
    g = golden("kda_chunk.safetensors")
    inputs, state = _inputs(g, "chunk")
    _q, k, _v, gate, beta = inputs
    A = kda_chunk_system(k, gate, beta)
    assert_close("A", expected=g["chunk.A"], actual=A, tol=KDA_FORWARD)
    beta_chunks = np.moveaxis(beta.reshape(1, 4, 64, -1), 3, 1)  # [B, H, N, C]
    T_beta = invert_unit_lower(A) * beta_chunks[..., None, :]
    assert_close("T_beta", expected=g["chunk.T_beta"], actual=T_beta, tol=KDA_FORWARD)
    o, final = jax.jit(chunk_kda)(*inputs, initial_state=state)
    assert_close("o", expected=g["chunk.o"], actual=o, tol=KDA_FORWARD)
    assert_close("final_state", expected=g["chunk.final_state"], actual=final, tol=KDA_FORWARD)


@pytest.mark.parametrize("form", [recurrent_kda, chunk_kda], ids=["recurrent", "chunk"])
def test_sixteen_chunks_match_fla(golden, form):
    g = golden("kda_chunk.safetensors")
    inputs, state = _inputs(g, "long")
    o, final = jax.jit(form)(*inputs, initial_state=state)
    assert_close("o", expected=g["long.o"], actual=o, tol=KDA_FORWARD)
    assert_close("final_state", expected=g["long.final_state"], actual=final, tol=KDA_FORWARD)


def _olmo_core_layer(golden, **flags):
    g = golden("kda_layer.safetensors")
    layer = KimiDeltaAttention(
        micro().model.kda,
        g.entry["config"]["d_model"],
        inverse=flags.get("inverse", "forward_substitution"),
        ignore_segment_ids=flags.get("ignore_segment_ids", True),
        std=micro().model.init_std,
        rngs=nnx.Rngs(0),
    )
    load_olmo_core(layer, g.group("param."), kda_entries())
    return g, layer


def test_layer_matches_olmo_core(golden):
    """OLMo-core's KimiDeltaAttention weights in our layer: output, input and weight grads."""
    g, layer = _olmo_core_layer(golden)
    y, (grad_layer, grad_x) = module_vjp(layer, g["x"], g["cotangent"])
    assert_close("y", expected=g["y"], actual=y, tol=KDA_FORWARD)
    assert_close("grad.x", expected=g["grad.x"], actual=grad_x, tol=KDA_GRAD)
    grads = params_to_olmo_core(grad_layer, kda_entries())
    expected = {k: g[f"grad.{k}"] for k in grads}
    assert_close("grad", expected=expected, actual=grads, tol=KDA_GRAD)


def test_chunk_segments_restart_like_separate_documents(golden):
    """chunk_kda with segment ids gives each document the output and state it has alone
    (through recurrent_kda, checked against FLA above); documents straddle chunk boundaries."""
    g = golden("kda_chunk.safetensors")
    inputs, _ = _inputs(g, "chunk")
    bounds = [0, 37, 130, 256]
    seg = np.repeat(np.arange(3), np.diff(bounds))[None]
    o, final = jax.jit(chunk_kda)(*inputs, segment_ids=seg)
    for start, end in itertools.pairwise(bounds):
        alone, state = jax.jit(recurrent_kda)(*(x[:, start:end] for x in inputs))
        assert_close(
            f"o[{start}:{end}]", expected=alone, actual=o[:, start:end], tol=KDA_SEPARATE_RUNS
        )
    assert_close("final_state", expected=state, actual=final, tol=KDA_SEPARATE_RUNS)


def test_layer_segments_restart_like_separate_documents(golden):
    """Without olmoe3_mixers_ignore_segment_ids, four documents of 48 tokens in one row (across
    chunk boundaries) each get the layer output they have alone, convolution included; with the
    flag, later documents see earlier ones."""
    x = golden("kda_layer.safetensors")["x"][:1, :192]
    seg = np.repeat(np.arange(4), 48)[None]
    for ignore in (False, True):
        layer = _olmo_core_layer(golden, ignore_segment_ids=ignore)[1]
        in_row = apply(layer, x, seg)
        alone = apply(layer, x.reshape(4, 48, -1), np.zeros((4, 48), np.int64))
        if ignore:
            assert not np.allclose(
                in_row[0, 48:], alone.reshape(192, -1)[48:], atol=SEGMENTS_VISIBLE
            )
        else:
            assert_close(
                "y", expected=alone.reshape(1, 192, -1), actual=in_row, tol=KDA_SEPARATE_RUNS
            )
