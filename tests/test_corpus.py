"""The corpus rule (goldens/corpus.py): documents start at scene, act and sonnet headings, a
heading alone joins the text after it, and every document's bytes are followed by the EOS id; the
committed token files are the shipped texts tokenised that way."""

import numpy as np
import pytest

from goldens.corpus import CORPUS_DIR, TEXTS, documents, tokenize

TEXT = """TITLE

by Someone


ACT I.

SCENE I. A heath.

Words here.

SCENE II. A camp.

More words.

XVIII

Shall I compare thee?
ACT V.
"""


def test_documents_start_at_headings():
    assert documents(TEXT) == [
        "TITLE\n\nby Someone",
        "ACT I.\n\nSCENE I. A heath.\n\nWords here.",
        "SCENE II. A camp.\n\nMore words.",
        "XVIII\n\nShall I compare thee?",
        "ACT V.",
    ]


def test_tokens_are_bytes_then_eos():
    tokens = tokenize(["ab", "é"], eos_token_id=256)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, [97, 98, 256, 0xC3, 0xA9, 256])


@pytest.mark.parametrize("eos", [255, 65536])
def test_eos_must_follow_the_bytes_and_fit_uint16(eos):
    with pytest.raises(ValueError, match=r"eos_token_id must lie in \[256, 65535\]"):
        tokenize(["a"], eos_token_id=eos)


def test_committed_token_files_are_the_shipped_texts(golden):
    """Each token file, cut at its EOS ids, is the documents of its text, byte for byte."""
    for name in TEXTS:
        g = golden(f"data/tokens/{name}.npy")
        tokens = g["tokens"]
        eos = g.entry["config"]["eos_token_id"]
        ends = np.flatnonzero(tokens == eos)
        assert ends[-1] == len(tokens) - 1
        assert tokens[tokens != eos].max() < 256
        docs = [bytes(d[:-1].astype(np.uint8)).decode() for d in np.split(tokens, ends + 1)[:-1]]
        assert docs == documents((CORPUS_DIR / f"{name}.txt").read_text(encoding="utf-8"))
