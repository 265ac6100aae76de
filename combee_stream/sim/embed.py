"""Deterministic embeddings: a signed hashed bag of normalised word unigrams and bigrams.

Texts sharing most words (near-duplicates) get a cosine similarity close to 1, unrelated texts
close to 0. No model: it is a simulator.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import re
import struct

DIMENSIONS = 256
_WORD = re.compile(r"[a-z0-9]+")


def _features(text: str) -> list[str]:
    words = _WORD.findall(text.lower())
    return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]


def embed(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    """Unit-length vector of ``dimensions`` floats; the same text always gives the same vector."""
    vector = [0.0] * dimensions
    for feature in _features(text) or ["\x00empty"]:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        index = int.from_bytes(digest[:4], "big") % dimensions
        vector[index] += 1.0 if digest[4] & 1 else -1.0  # the sign halves collision bias
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0.0:  # every feature cancelled out: fall back to one fixed axis
        vector[0], norm = 1.0, 1.0
    return [x / norm for x in vector]


def to_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format="base64"``: little-endian float32, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


__all__ = ["DIMENSIONS", "cosine", "embed", "to_base64"]
