"""Serve an ASGI app with uvicorn inside the caller's task group (simulator, metrics), and the
health app (``/metrics``, ``/healthz``, ``/readyz``) the engine and the ingest stage serve alike."""

from __future__ import annotations

import contextlib
import socket
from collections import Counter as Tally
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, MutableMapping
from typing import Any

import anyio
import msgspec
import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _Server(uvicorn.Server):
    """uvicorn's server, taking over SIGINT/SIGTERM only when asked (a CLI, not a library)."""

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


class HttpServer:
    """A running server; ``root_url`` is ``http://host:port``."""

    def __init__(self, server: _Server, host: str, port: int) -> None:
        self.host = host
        self.port = port
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.root_url = f"http://{netloc}"
        self._server = server
        self._stopped = anyio.Event()

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


def bind(host: str, port: int) -> socket.socket:
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


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now, for child processes to bind (they may be taken
    meanwhile: loopback only). All held at once while chosen: asked for one at a time, the
    kernel can hand out the same port twice (a test broker given one port for both its
    listeners failed to format its storage, CI 2026-12-07)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        # No SO_REUSEADDR (unlike bind): two such sockets could share a port.
        socks = [
            stack.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(count)
        ]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child process to bind (it may be taken meanwhile: loopback only)."""
    return free_ports(1, host)[0]


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    capture_signals: bool = False,
    grace_s: int = 1,
) -> AsyncIterator[HttpServer]:
    """Serve ``app`` on ``host:port`` (0 = any free port) for the duration of the block.
    asyncio backend only (uvicorn)."""
    sock = bind(host, port)
    with contextlib.closing(sock):
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=grace_s,
        )
        server = HttpServer(
            _Server(config, capture_signals=capture_signals), host, sock.getsockname()[1]
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(server._serve, sock)
            # uvicorn offers no startup event; poll its flag (a few ms at most).
            while not server._server.started:
                if server._stopped.is_set():
                    # An OSError, like a failed bind, so callers handle both in one place.
                    raise OSError(f"the HTTP server on {host}:{port} failed to start")
                await anyio.sleep(0.005)
            try:
                yield server
            finally:
                server.stop()


class Health:
    """What ``/healthz`` and ``/readyz`` report. Ready = partitions assigned and restored, and
    no write to or read from Kafka currently failing (``failing`` counts operations in retry)."""

    def __init__(self) -> None:
        self.live = True
        self.assigned = False
        self.failing: Tally[str] = Tally()

    @property
    def ready(self) -> bool:
        return self.live and self.assigned and not +self.failing


def health_app(
    registry: CollectorRegistry, health: Health
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``/metrics`` of ``registry``, and ``/healthz`` / ``/readyz`` from ``health``: what the
    engine and the ingest stage serve alike."""
    metrics_app = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path == "/metrics":
            await metrics_app(scope, receive, send)
            return
        if path == "/healthz":
            ok = health.live
        elif path == "/readyz":
            ok = health.ready
        else:
            await _plain(send, 404, b"not found\n")
            return
        await _plain(send, 200 if ok else 503, b"ok\n" if ok else b"not ready\n")

    return app


async def _plain(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """One JSON response of an ASGI app."""
    body = msgspec.json.encode(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive) -> bytes:
    """An ASGI request's whole body (what arrived, if the client went away)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


__all__ = [
    "Health",
    "HttpServer",
    "Receive",
    "Scope",
    "Send",
    "bind",
    "free_port",
    "free_ports",
    "health_app",
    "read_body",
    "send_json",
    "serve_asgi",
]
