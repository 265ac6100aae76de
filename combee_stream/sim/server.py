"""Ways to run the simulator: over real HTTP with uvicorn (``sim_server``, or
``sim_server_blocking`` from synchronous code), or in process (``sim_http_client``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal

from combee_stream.config import LLMConfig, RoleConfig
from combee_stream.http import HttpServer, serve_asgi
from combee_stream.sim.app import CHAT_MODEL, EMBEDDING_MODEL, SimApp
from combee_stream.sim.settings import SimSettings

IN_PROCESS_BASE_URL = "http://sim.local/v1"
_SHUTDOWN_GRACE_S = 1  # held connections (timeout faults) are cut after this long


def simulated_llm(base_url: str, llm: LLMConfig | None = None, **overrides: Any) -> LLMConfig:
    """``llm`` (default: the defaults) with every role and the embeddings endpoint on the
    simulator at ``base_url`` (``llm.embeddings.enabled`` is left as it is), plus ``overrides``
    of LLMConfig fields. The one place that wires the roles to a simulator."""
    llm = llm or LLMConfig()
    role = RoleConfig(base_url=base_url, model=CHAT_MODEL)
    embeddings = msgspec.structs.replace(llm.embeddings, base_url=base_url, model=EMBEDDING_MODEL)
    return msgspec.structs.replace(
        llm,
        reflector=role,
        curator=role,
        combiner=role,
        agent=role,
        judge=role,
        embeddings=embeddings,
        **overrides,
    )


def sim_app(settings: SimSettings | None = None) -> SimApp:
    """The simulator's ASGI app, with its own fresh state."""
    return SimApp(settings or SimSettings())


def sim_http_client(
    settings: SimSettings | SimApp | None = None, *, timeout: float = 60.0
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` that calls the simulator in process, for
    ``openai.AsyncOpenAI(base_url=IN_PROCESS_BASE_URL, http_client=...)``. Pass a ``SimApp`` to
    keep a handle on its stats."""
    app = settings if isinstance(settings, SimApp) else sim_app(settings)
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url=IN_PROCESS_BASE_URL, timeout=timeout
    )


class SimServer:
    """A running simulator. ``base_url`` ends in ``/v1`` (what OpenAI clients expect)."""

    def __init__(self, app: SimApp, http: HttpServer) -> None:
        self.app = app
        self.host = http.host
        self.port = http.port
        self.root_url = http.root_url
        self.base_url = f"{self.root_url}/v1"
        self._http = http

    def stats(self) -> dict[str, Any]:
        return self.app.stats()

    def reset(self) -> None:
        self.app.reset()

    def stop(self) -> None:
        self._http.stop()

    async def wait_stopped(self) -> None:
        """Until the server stops (``stop()``, or Ctrl-C when it captures signals)."""
        await self._http.wait_stopped()


@contextlib.asynccontextmanager
async def sim_server(
    settings: SimSettings | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    capture_signals: bool = False,
) -> AsyncIterator[SimServer]:
    """Serve the simulator over HTTP on ``host:port`` (0 = any free port) for the duration of
    the block; uvicorn runs in a task group and is shut down on exit. asyncio backend only."""
    app = sim_app(settings)
    async with serve_asgi(
        app, host, port, capture_signals=capture_signals, grace_s=_SHUTDOWN_GRACE_S
    ) as http:
        yield SimServer(app, http)


class BlockingSimServer:
    """Handle on a simulator served from a background thread (see ``sim_server_blocking``)."""

    def __init__(self, server: SimServer, portal: BlockingPortal) -> None:
        self.base_url = server.base_url
        self.root_url = server.root_url
        self.port = server.port
        self._server = server
        self._portal = portal

    def stats(self) -> dict[str, Any]:
        return self._portal.call(self._server.stats)  # read on the server's own loop

    def reset(self) -> None:
        self._portal.call(self._server.reset)


@contextlib.contextmanager
def sim_server_blocking(
    settings: SimSettings | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> Iterator[BlockingSimServer]:
    """``sim_server`` for synchronous callers: runs the server's event loop in a thread."""
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(sim_server(settings, host=host, port=port)) as server,
    ):
        yield BlockingSimServer(server, portal)


__all__ = [
    "IN_PROCESS_BASE_URL",
    "BlockingSimServer",
    "SimServer",
    "sim_app",
    "sim_http_client",
    "sim_server",
    "sim_server_blocking",
    "simulated_llm",
]
