"""Run ``llama-server`` on loopback for the duration of a block, and tell when it answers.

``async with local_model(cfg) as server:`` builds the server and assembles the model if needed
(once), starts ``llama-server`` as a child process (it dies with its parent, even on SIGKILL),
waits until ``/health`` says the model is loaded, and yields its OpenAI base URL. Beside it, when
``local_llm.embeddings`` is on and the NumPy encoder's packages are installed, the embedding
model's ``/v1/embeddings`` (:mod:`~combee_stream.localllm.embedder`, a child process too), so
:func:`local_llm_config` turns semantic dedup on in every driver. The processes are stopped on
exit, whatever happened.

Structured output: ``llama-server`` constrains replies by a grammar derived from a JSON Schema
given as ``response_format = {"type": "json_object", "schema": ...}``, which is the LLM layer's
``json_object`` mode (:func:`role_config` sets it).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import httpx2
import msgspec
from msgspec import Struct

from combee_stream.config import EmbeddingsConfig, LLMConfig, LocalLLMConfig, RoleConfig
from combee_stream.errors import UserError
from combee_stream.http import free_port
from combee_stream.localllm import minilm
from combee_stream.localllm.build import ensure_llama_server
from combee_stream.localllm.models import EMBEDDER, ensure_embedder, ensure_model, model_spec
from combee_stream.logs import get_logger

log = get_logger(__name__)

Say = Callable[[str], None]


class LocalServer(Struct, frozen=True):
    model: str  # also the alias the server answers to
    base_url: str  # ends in /v1
    log_path: str
    parallel: int
    embeddings_url: str = ""  # the embedding model's base URL (ends in /v1); "" when not served
    embeddings_model: str = ""
    embeddings_threshold: float = 0.8


def role_config(server: LocalServer, **overrides: object) -> RoleConfig:
    """A role pointed at ``server`` in the mode it accepts (json_object + schema)."""
    return RoleConfig(
        base_url=server.base_url,
        model=server.model,
        mode="json_object",
        **overrides,  # type: ignore[arg-type]
    )


def local_llm_config(server: LocalServer, llm: LLMConfig | None = None) -> LLMConfig:
    """Every role on ``server``, bounded for a small grammar-constrained model: its strings and
    lists get maximum lengths in the schema (unbounded, small models repeat themselves until
    the cap cuts the JSON), and ``max_tokens`` is left at 0 so each request's cap is derived
    from its bounded schema's worst case: a reply the grammar allows always fits. As many
    requests in flight as it has slots, and timeouts sized for CPU decoding (a few tokens per
    second per slot)."""
    llm = llm or LLMConfig()
    # Worst cases at these bounds (schema_token_bound, a token a character): reflector ~1.3k,
    # curator ~2.4k, combiner ~3.2k, agent ~2.6k tokens, reached only by a model that fills
    # every field; with prompts of 2-5k tokens, four slots fit the 32k shared KV cache. 300
    # characters hold any one rule the Formula tasks need; 6 operations a window is more than
    # a small curator writes well.
    return msgspec.structs.replace(
        llm,
        reflector=role_config(server, max_string_chars=300, max_list_items=6),
        curator=role_config(server, max_string_chars=300, max_list_items=6),
        combiner=role_config(server, max_string_chars=300, max_list_items=8),
        agent=role_config(server, max_string_chars=400, max_list_items=6),
        judge=role_config(server, max_string_chars=300, max_list_items=4),
        embeddings=(
            EmbeddingsConfig(
                enabled=True,
                base_url=server.embeddings_url,
                model=server.embeddings_model,
                threshold=server.embeddings_threshold,
            )
            if server.embeddings_url
            else llm.embeddings
        ),
        concurrency=server.parallel,
        timeout_s=max(llm.timeout_s, 900.0),
        max_attempts=3,
    )


def prepare(cfg: LocalLLMConfig, say: Say) -> tuple[Path, Path, Path | None]:
    """Build the server and assemble the models if needed: (binary, model file, the embedding
    model's folder or None when embeddings are off or their packages are not installed)."""
    state = Path(cfg.state_dir)
    binary = ensure_llama_server(state, say)
    model = ensure_model(model_spec(cfg.model), state, say)
    embedder = None
    if cfg.embeddings:
        if minilm.available():
            embedder = ensure_embedder(state, say)
        else:
            say(
                "semantic dedup off: the local embedding model needs numpy, tokenizers and "
                "safetensors (pip install 'combee-stream[local]')"
            )
    return binary, model, embedder


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so a killed run never leaves a model server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


@contextlib.asynccontextmanager
async def local_model(
    cfg: LocalLLMConfig, *, say: Say | None = None, port: int | None = None
) -> AsyncIterator[LocalServer]:
    say = say or (lambda message: log.info(message))
    binary, model, embedder = await anyio.to_thread.run_sync(prepare, cfg, say)
    port = cfg.port if port is None else port
    state = Path(cfg.state_dir)
    command = [
        str(binary),
        "--model", str(model),
        "--alias", cfg.model,
        "--host", cfg.host,
        "--port", str(port),
        "--parallel", str(cfg.parallel),
        "--ctx-size", str(cfg.ctx_size),
        "--kv-unified",
        "--threads", str(cfg.threads),
        "--threads-batch", str(cfg.threads),
        "--seed", str(cfg.seed),
    ]  # fmt: skip
    root = f"http://{cfg.host}:{port}"
    async with contextlib.AsyncExitStack() as stack:
        say(f"starting llama-server ({cfg.model}, {cfg.parallel} slots) on {root}")
        log_path = state / f"llama-server-{port}.log"
        await stack.enter_async_context(_child("llama-server", command, root, log_path, cfg))
        server = LocalServer(
            model=cfg.model, base_url=f"{root}/v1", log_path=str(log_path), parallel=cfg.parallel
        )
        if embedder is not None:
            # A port of its own per run, unless this is `llm serve` on its configured port.
            eport = cfg.embeddings_port if port == cfg.port else free_port(cfg.host)
            eroot = f"http://{cfg.host}:{eport}"
            ecommand = [
                sys.executable, "-m", "combee_stream.localllm.embedder",
                "--model-dir", str(embedder), "--model", EMBEDDER.name,
                "--host", cfg.host, "--port", str(eport),
            ]  # fmt: skip
            elog = state / f"embedder-{eport}.log"
            await stack.enter_async_context(_child("the embedder", ecommand, eroot, elog, cfg))
            server = msgspec.structs.replace(
                server,
                embeddings_url=f"{eroot}/v1",
                embeddings_model=EMBEDDER.name,
                embeddings_threshold=cfg.embeddings_threshold,
            )
            say(f"embedding model ({EMBEDDER.name}) ready at {server.embeddings_url}")
        say(f"local model ready at {server.base_url}")
        yield server


@contextlib.asynccontextmanager
async def _child(
    name: str, command: list[str], root: str, log_path: Path, cfg: LocalLLMConfig
) -> AsyncIterator[None]:
    """``command`` as a child process until the block ends, ready once ``root/health`` says
    200; it dies with us (PR_SET_PDEATHSIG) and is stopped on exit, whatever happened."""
    with log_path.open("wb") as out:
        # Popen, not anyio.open_process: the child must die with us (preexec_fn).
        process = subprocess.Popen(  # noqa: ASYNC220 - Popen returns at once
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    try:
        await _until_ready(name, process, root, cfg.ready_timeout_s, log_path)
        yield
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(process)


async def _until_ready(
    name: str, process: subprocess.Popen[bytes], root: str, limit_s: float, log_path: Path
) -> None:
    async with httpx2.AsyncClient(timeout=2.0) as http:
        with anyio.move_on_after(limit_s):
            while True:
                if process.poll() is not None:
                    raise UserError(f"{name} exited with {process.returncode}:\n{_tail(log_path)}")
                try:
                    if (await http.get(f"{root}/health")).status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                await anyio.sleep(0.25)
    raise UserError(f"{name} not ready after {limit_s:g} s:\n{_tail(log_path)}")


async def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    with anyio.move_on_after(15):
        while process.poll() is None:  # noqa: ASYNC110 - a child process, no event to await
            await anyio.sleep(0.05)
        return
    process.kill()
    await anyio.to_thread.run_sync(process.wait)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = ["LocalServer", "local_llm_config", "local_model", "prepare", "role_config"]
