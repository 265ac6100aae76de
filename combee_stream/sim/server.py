"""Ways to run the simulator: over real HTTP with uvicorn (``sim_server``, or
``sim_server_blocking`` from synchronous code), or in process (``sim_http_client``)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import anyio
import httpx2
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal

from combee_stream.sim.app import SimApp
from combee_stream.sim.settings import SimSettings

IN_PROCESS_BASE_URL = "http://sim.local/v1"
_SHUTDOWN_GRACE_S = 1  # held connections (timeout faults) are cut after this long


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


class _Server(uvicorn.Server):
    """uvicorn's server, taking over SIGINT/SIGTERM only when asked (the CLI, not tests)."""

    def __init__(self, config: uvicorn.Config, *, capture_signals: bool) -> None:
        super().__init__(config)
        self._capture = capture_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if self._capture:
            with super().capture_signals():
                yield
        else:
            yield


class SimServer:
    """A running simulator. ``base_url`` ends in ``/v1`` (what OpenAI clients expect)."""

    def __init__(self, app: SimApp, server: _Server, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.root_url = f"http://{netloc}"
        self.base_url = f"{self.root_url}/v1"
        self._server = server
        self._stopped = anyio.Event()

    def stats(self) -> dict[str, Any]:
        return self.app.stats()

    def reset(self) -> None:
        self.app.reset()

    def stop(self) -> None:
        self._server.should_exit = True

    async def wait_stopped(self) -> None:
        """Until the server stops (``stop()``, or Ctrl-C when it captures signals)."""
        await self._stopped.wait()

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self._server.serve(sockets=[sock])
        finally:
            self._stopped.set()


def _bind(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so that port 0 gives a known free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the
    # listening socket names it, and without it keep-alive replies stall ~40 ms (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


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
    sock = _bind(host, port)
    with contextlib.closing(sock):
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        )
        server = SimServer(
            app, _Server(config, capture_signals=capture_signals), host, sock.getsockname()[1]
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(server._serve, sock)
            # uvicorn offers no startup event; poll its flag (a few ms at most).
            while not server._server.started:
                if server._stopped.is_set():
                    raise RuntimeError("the simulator's HTTP server failed to start")
                await anyio.sleep(0.005)
            try:
                yield server
            finally:
                server.stop()


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
