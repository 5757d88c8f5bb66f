"""Gated NoPE attention against OLMo-core's `Attention` (goldens/attention.safetensors): output,
input and weight gradients with OLMo-core's weights; the scalable-softmax positions per document
as OLMo-core's `cu_doc_lens`; segment masking makes a document in a row equal the document alone."""

import numpy as np
from flax import nnx

from goldens.tolerances import ATTENTION_SEPARATE_RUNS, FP32_FORWARD, FP32_GRAD, SEGMENTS_VISIBLE
from model.attention import Attention
from model.config import micro
from model.convert import attention_entries, load_olmo_core, params_to_olmo_core
from tests.compare import assert_close
from tests.modules import apply, module_vjp

GOLDEN = "attention.safetensors"


def _olmo_core_layer(golden, *, ignore_segment_ids=True):
    g = golden(GOLDEN)
    layer = Attention(
        micro().model.attention,
        g.entry["config"]["d_model"],
        ignore_segment_ids=ignore_segment_ids,
        std=micro().model.init_std,
        rngs=nnx.Rngs(0),
    )
    load_olmo_core(layer, g.group("param."), attention_entries())
    return g, layer


def test_attention_matches_olmo_core(golden):
    """OLMo-core's weights in our layer: output, input and weight gradients."""
    g, layer = _olmo_core_layer(golden)
    y, (grad_layer, grad_x) = module_vjp(layer, g["x"], g["cotangent"])
    assert_close("y", expected=g["y"], actual=y, tol=FP32_FORWARD)
    grads = params_to_olmo_core(grad_layer, attention_entries())
    assert_close("grad", expected=g.group("grad."), actual={"x": grad_x, **grads}, tol=FP32_GRAD)


def test_document_positions_match_olmo_core_cu_doc_lens(golden):
    """With segment masking, the scalable-softmax length restarts at each document, as
    OLMo-core's `_prepare_qkv` with `cu_doc_lens` (document starts where the id changes)."""
    g, layer = _olmo_core_layer(golden, ignore_segment_ids=False)
    bounds = g.entry["config"]["doc_bounds"]
    seg = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))[None]
    q, _, _ = nnx.jit(lambda m, x, s: m.qkv(x, s))(layer, g["x"][:1], seg)
    assert_close("doc.q", expected=g["doc.q"], actual=q, tol=FP32_FORWARD)


def test_segments_attend_like_separate_documents(golden):
    """Without olmoe3_mixers_ignore_segment_ids, three documents in one row each get the output
    they have alone; with the flag, later documents see earlier ones."""
    x = golden(GOLDEN)["x"][:1, :192]
    seg = np.repeat(np.arange(3), 64)[None]
    for ignore in (False, True):
        layer = _olmo_core_layer(golden, ignore_segment_ids=ignore)[1]
        in_row = apply(layer, x, seg)
        alone = apply(layer, x.reshape(3, 64, -1), np.zeros((3, 64), np.int64))
        if ignore:
            assert not np.allclose(
                in_row[0, 64:], alone.reshape(192, -1)[64:], atol=SEGMENTS_VISIBLE
            )
        else:
            assert_close(
                "y", expected=alone.reshape(1, 192, -1), actual=in_row, tol=ATTENTION_SEPARATE_RUNS
            )
