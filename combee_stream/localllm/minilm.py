"""all-MiniLM-L6-v2 in NumPy: the sentence-transformers model (BERT, 6 layers, mean pooling, L2
norm) as a plain forward pass over its safetensors, so semantic dedup needs no torch (a 1.5 GB
install) on a CPU machine. Same vectors as sentence-transformers to 2e-7, deterministic, about
200 sentences/s on 2 cores (``../shared/notes/local-llm.md``, section 3.3).

NumPy, tokenizers and safetensors are optional dependencies (the ``local`` extra):
:func:`available` says whether they are installed, and the embeddings server is started only
then.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import numpy as np

MAX_TOKENS: Final = 256  # the model's trained sequence length; longer texts are cut
_LAYERS: Final = 6
_HIDDEN: Final = 384
_HEADS: Final = 12


def available() -> bool:
    return all(
        importlib.util.find_spec(m) is not None for m in ("numpy", "tokenizers", "safetensors")
    )


class MiniLM:
    """``MiniLM(folder).encode(texts)``: unit vectors of 384 floats, one per text."""

    dimensions: Final = _HIDDEN

    def __init__(self, folder: Path, batch_size: int = 32) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self._w: dict[str, np.ndarray] = load_file(str(folder / "model.safetensors"))
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tok.enable_truncation(MAX_TOKENS)
        self._tok.enable_padding(pad_id=0, pad_token="[PAD]")
        self._batch_size = batch_size

    def count_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(e.ids) for e in self._tok.encode_batch(list(texts)))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        # Batches of similar lengths pad less; the order back is restored by index.
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), _HIDDEN), dtype=np.float32)
        for start in range(0, len(texts), self._batch_size):
            index = order[start : start + self._batch_size]
            out[index] = self._batch([texts[j] for j in index])
        return out

    def _norm(self, x: np.ndarray, prefix: str) -> np.ndarray:
        import numpy as np

        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        w = self._w
        out: np.ndarray = (x - mean) / np.sqrt(var + 1e-12) * w[prefix + ".weight"]
        out += w[prefix + ".bias"]
        return out

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        # One 2-D matrix product: NumPy's batched 3-D path is about twice as slow.
        w = self._w
        y: np.ndarray = x.reshape(-1, x.shape[-1]) @ w[prefix + ".weight"].T + w[prefix + ".bias"]
        out: np.ndarray = y.reshape(*x.shape[:-1], -1)
        return out

    def _batch(self, texts: list[str]) -> np.ndarray:
        import numpy as np

        encoded = self._tok.encode_batch(texts)
        ids = np.array([e.ids for e in encoded])
        mask = np.array([e.attention_mask for e in encoded], dtype=np.float32)
        batch, length = ids.shape
        heads, head = _HEADS, _HIDDEN // _HEADS
        w = self._w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:length]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        padding = (1.0 - mask)[:, None, None, :] * -1e9
        for layer in range(_LAYERS):
            p = f"encoder.layer.{layer}."

            def split(name: str, x: np.ndarray = x, p: str = p) -> np.ndarray:
                return self._linear(x, p + name).reshape(batch, length, heads, head)

            q = split("attention.self.query").transpose(0, 2, 1, 3)
            k = split("attention.self.key").transpose(0, 2, 3, 1)
            v = split("attention.self.value").transpose(0, 2, 1, 3)
            scores = q @ k / math.sqrt(head) + padding
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attended = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, length, _HIDDEN)
            x = self._norm(
                x + self._linear(attended, p + "attention.output.dense"),
                p + "attention.output.LayerNorm",
            )
            h = self._linear(x, p + "intermediate.dense")
            h = 0.5 * h * (1.0 + _erf(h / np.float32(math.sqrt(2))))
            x = self._norm(x + self._linear(h, p + "output.dense"), p + "output.LayerNorm")
        pooled = (x * mask[:, :, None]).sum(1) / np.clip(mask.sum(1, keepdims=True), 1e-9, None)
        result: np.ndarray = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return result


def _erf(x: np.ndarray) -> np.ndarray:
    """GELU's erf without SciPy: the Numerical Recipes erfc approximation, |error| < 1.2e-7."""
    import numpy as np

    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))  # fmt: skip
    result: np.ndarray = np.sign(x) * (1 - t * np.exp(poly))
    return result


__all__ = ["MAX_TOKENS", "MiniLM", "available"]
