"""The corpus the data goldens and the replay train on: five Shakespeare texts shipped in
`goldens/data/corpus/` (see its NOTICE.md), cut into documents, tokenised byte by byte.

Tokenisation (defined here, no tokenizer package): a document's UTF-8 bytes are token ids 0..255 and
the EOS id (256 in the micro config) follows every document, as OLMo-core's token files expect
(`NumpyFSLDataset` adds no special tokens). The real id range is 257 ids; the model pads its vocab
to 384. Each text becomes one token file, in `TEXTS` order.

Documents: a new document starts at every scene heading ("SCENE II. A Camp near Forres."), act
heading ("ACT III.") and sonnet number ("XVIII" alone on a line); a heading with no text before the
next heading ("ACT I." right above "SCENE I.") opens the document that follows it. Text before the
first heading (title, list of persons) is a document too. Documents are stripped of surrounding
white space. This gives about 270 documents of 0.5 to 18 KB: some 256-token instances hold no EOS,
others several.
"""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

import numpy as np

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "corpus"
TEXTS = ("sonnets", "macbeth", "julius_caesar", "antony_and_cleopatra", "henry_v")
"""The shipped texts (`<name>.txt`), in token-file order."""
BYTE_VOCAB = 256
"""Token ids of the bytes; the EOS id comes right after them."""
HEADING = re.compile(r"^(?:ACT [IVXLC]+\b.*|SCENE [IVXLC]+\..*|[IVXLC]+)$", re.MULTILINE)


def documents(text: str) -> list[str]:
    """`text` cut into documents at its headings (see the module docstring)."""
    starts = [0, *(m.start() for m in HEADING.finditer(text)), len(text)]
    docs, headings = [], ""
    for start, end in pairwise(starts):
        chunk = text[start:end].strip()
        if HEADING.fullmatch(chunk):
            headings += chunk + "\n\n"
        elif chunk:
            docs.append(headings + chunk)
            headings = ""
    if headings:
        docs.append(headings.strip())
    return docs


def tokenize(docs: list[str], *, eos_token_id: int) -> np.ndarray:
    """Byte-level ids of `docs`, each followed by `eos_token_id`: [T] uint16, OLMo-core's token
    file dtype for a vocab of at most 65536 ids."""
    if not BYTE_VOCAB <= eos_token_id <= np.iinfo(np.uint16).max:
        raise ValueError(f"eos_token_id must lie in [{BYTE_VOCAB}, 65535], got {eos_token_id}")
    parts = []
    for doc in docs:
        parts.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([eos_token_id], dtype=np.uint16))
    return np.concatenate(parts)


def token_arrays(*, eos_token_id: int) -> dict[str, np.ndarray]:
    """Text name -> its token ids, in `TEXTS` order."""
    return {
        name: tokenize(
            documents((CORPUS_DIR / f"{name}.txt").read_text(encoding="utf-8")),
            eos_token_id=eos_token_id,
        )
        for name in TEXTS
    }
