"""An OpenAI-compatible ``/v1/embeddings`` endpoint for the local embedding model
(:class:`~combee_stream.localllm.minilm.MiniLM`), so semantic dedup reaches it the way it
reaches any provider's (``llm.embeddings.base_url``): the learner knows one kind of embedder.

Run as its own process by :func:`~combee_stream.localllm.server.local_model`, beside
``llama-server`` (``python -m combee_stream.localllm.embedder --model-dir D --port P``).
Encoding runs on one worker thread at a time: on 2 cores a second one would only slow both.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.http import Receive, Scope, Send, read_body, send_json, serve_asgi
from combee_stream.localllm.minilm import MiniLM

MAX_INPUTS = 2048  # texts per request, as OpenAI allows


def _error(status: int, message: str, param: str | None = None) -> tuple[int, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": None}}


class EmbeddingsApp:
    """ASGI app: ``POST /v1/embeddings`` (strings in, float or base64 vectors out),
    ``GET /v1/models`` and ``GET /health``."""

    def __init__(self, encoder: MiniLM, model: str) -> None:
        self._encoder = encoder
        self._model = model
        self._one_at_a_time = anyio.CapacityLimiter(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        payload: Any
        match scope["method"], scope["path"]:
            case "GET", "/health":
                status, payload = 200, {"status": "ok"}
            case "GET", "/v1/models":
                status, payload = (
                    200,
                    {"object": "list", "data": [{"id": self._model, "object": "model"}]},
                )
            case "POST", "/v1/embeddings":
                status, payload = await self._embeddings(await read_body(receive))
            case _:
                status, payload = _error(404, f"no route {scope['method']} {scope['path']}")
        await send_json(send, status, payload)

    async def _embeddings(self, body: bytes) -> tuple[int, Any]:
        try:
            request = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(request, dict):
            return _error(400, "the body must be a JSON object")
        if request.get("model") != self._model:
            return _error(
                404,
                f"model {request.get('model')!r} is not served here (only {self._model!r})",
                "model",
            )
        raw = request.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            return _error(400, "'input' must be a string or a non-empty list of strings", "input")
        if len(texts) > MAX_INPUTS:
            return _error(400, f"at most {MAX_INPUTS} inputs a request", "input")
        encoding = request.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            return _error(400, "'encoding_format' must be float or base64", "encoding_format")
        if request.get("dimensions") not in (None, MiniLM.dimensions):
            return _error(400, f"this model has {MiniLM.dimensions} dimensions only", "dimensions")
        vectors, tokens = await anyio.to_thread.run_sync(
            self._encode, texts, limiter=self._one_at_a_time
        )
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode()
                if encoding == "base64"
                else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return 200, {"object": "list", "data": data, "model": self._model, "usage": usage}

    def _encode(self, texts: list[str]) -> tuple[Any, int]:
        # float32 little-endian is what the openai client decodes from base64.
        return self._encoder.encode(texts).astype("<f4"), self._encoder.count_tokens(texts)


async def serve(model_dir: Path, model: str, host: str, port: int) -> None:
    app = EmbeddingsApp(MiniLM(model_dir), model)
    async with serve_asgi(app, host, port, capture_signals=True) as server:
        await server.wait_stopped()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model", required=True, help="the name it answers to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    anyio.run(serve, args.model_dir, args.model, args.host, args.port)


if __name__ == "__main__":
    main()


__all__ = ["EmbeddingsApp", "main", "serve"]
