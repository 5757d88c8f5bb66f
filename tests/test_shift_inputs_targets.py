"""`shift_to_inputs_targets`: rows of L + 1 tokens give inputs, targets, positions and segment ids
of length L; segment ids come from the EOS in the inputs, as OLMo-core's `segment_ids_from_eos`
(goldens/data/segment_ids.safetensors) + 1; the last target is masked as OLMo-core's last label."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from model.data import IGNORE_INDEX, DataError, olmo_labels, shift_to_inputs_targets

KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
UNAFFECTED_BY_EOS = ("inputs", "targets", "inputs_position", "targets_segmentation")


@pytest.mark.parametrize("eos", [256, 100257], ids=["micro", "dolma2"])
def test_review_case(eos):
    """The seed review's example: segment ids on the inputs (length 8), not the tokens (9)."""
    tokens = np.array([eos, 5, 6, eos, 7, eos, eos, 8, 9], dtype=np.uint32)
    out = shift_to_inputs_targets(tokens, segment_ids_from_eos=eos)
    default = shift_to_inputs_targets(tokens)
    assert {k: v.shape for k, v in out.items()} == dict.fromkeys(KEYS, (8,))
    # OLMo-core: eos.cumsum() - eos = [0, 1, 1, 1, 2, 2, 3, 4] on the inputs; + 1 keeps 0 free.
    np.testing.assert_array_equal(out["inputs_segmentation"], [1, 2, 2, 2, 3, 3, 4, 5])
    np.testing.assert_array_equal(out["targets_segmentation"], [1] * 7 + [0])
    for key in UNAFFECTED_BY_EOS:
        np.testing.assert_array_equal(out[key], default[key], err_msg=key)


@st.composite
def token_rows(draw):
    """[L + 1] or [B, L + 1] ids in 0..299 with a drawn EOS id placed at drawn positions."""
    eos = draw(st.sampled_from([0, 256, 299]))
    length = draw(st.integers(1, 70))
    shape = draw(st.sampled_from([(length + 1,), (1, length + 1), (3, length + 1)]))
    ids = st.one_of(st.just(eos), st.integers(0, 299))
    return eos, draw(arrays(np.int64, shape, elements=ids))


@settings(max_examples=200)
@given(token_rows())
def test_shift_properties(rows):
    """Every output has length L; segment ids start at 1 and grow by exactly one after each EOS
    of the inputs (so never decrease); the flag changes nothing but the segment ids; a 2-D batch is
    its rows."""
    eos, tokens = rows
    out = shift_to_inputs_targets(tokens, segment_ids_from_eos=eos)
    default = shift_to_inputs_targets(tokens)
    length = tokens.shape[-1] - 1
    for key in KEYS:
        assert out[key].shape == (*tokens.shape[:-1], length), key
        assert out[key].dtype == np.int32, key
    np.testing.assert_array_equal(out["inputs"], tokens[..., :-1])
    np.testing.assert_array_equal(out["targets"], tokens[..., 1:])
    np.testing.assert_array_equal(
        out["inputs_position"], np.broadcast_to(np.arange(length), out["inputs"].shape)
    )
    np.testing.assert_array_equal(out["targets_segmentation"][..., :-1], 1)
    np.testing.assert_array_equal(out["targets_segmentation"][..., -1], 0)
    segments = out["inputs_segmentation"]
    np.testing.assert_array_equal(segments[..., 0], 1)
    steps = np.diff(segments, axis=-1)
    np.testing.assert_array_equal(steps, out["inputs"][..., :-1] == eos)
    np.testing.assert_array_equal(default["inputs_segmentation"], 1)
    for key in UNAFFECTED_BY_EOS:
        np.testing.assert_array_equal(out[key], default[key], err_msg=key)
    if tokens.ndim == 2:
        for row, row_tokens in enumerate(tokens):
            one = shift_to_inputs_targets(row_tokens, segment_ids_from_eos=eos)
            for key in KEYS:
                np.testing.assert_array_equal(out[key][row], one[key], err_msg=key)


def test_segment_ids_match_olmo_core(golden):
    """Our segment ids are OLMo-core's `segment_ids_from_eos` of the inputs, plus one."""
    g = golden("data/segment_ids.safetensors")
    eos = g.entry["config"]["eos_token_id"]
    out = shift_to_inputs_targets(g["tokens"], segment_ids_from_eos=eos)
    np.testing.assert_array_equal(out["inputs_segmentation"], g["segment_ids"] + 1)


def test_labels_and_loss_token_count_are_olmo_core_s(golden):
    """An instance plus a lookahead token gives OLMo-core's `get_labels` of the instance, and so
    the token count its loss is normalised by (S - 1 an instance)."""
    g = golden("data/order.safetensors")
    instances = g["input_ids"][0]  # [I, S], batch 0
    rows = np.pad(instances, ((0, 0), (0, 1)), constant_values=7)
    out = shift_to_inputs_targets(rows)
    labels = olmo_labels(out["targets"], out["targets_segmentation"])
    np.testing.assert_array_equal(out["inputs"], instances)
    np.testing.assert_array_equal(labels, g["labels"])
    count = instances.shape[0] * (instances.shape[1] - 1)
    assert (labels != IGNORE_INDEX).sum() == (g["labels"] != IGNORE_INDEX).sum() == count


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (np.array([1.0, 2.0, 3.0]), "integer token ids needed, got dtype float64"),
        (np.array([5]), r"rows of L \+ 1 >= 2 ids needed, got shape \(1,\)"),
        (np.array(5), r"got shape \(\)"),
        (np.array([1, -2, 3]), r"ids must lie in \[0, 2\*\*31\)"),
    ],
    ids=["float", "too-short", "scalar", "negative"],
)
def test_bad_tokens(tokens, message):
    with pytest.raises(DataError, match=message):
        shift_to_inputs_targets(tokens)
