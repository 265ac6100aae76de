"""Connection settings shared by every aiokafka client the package creates, and the producer
factory (idempotent, and leaving no failed future unretrieved)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from combee_stream.config import KafkaConfig, secret
from combee_stream.errors import UserError
from combee_stream.logs import get_logger

log = get_logger(__name__)


def client_kwargs(cfg: KafkaConfig, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Bootstrap, client id and security for aiokafka clients; credentials only from env."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": cfg.bootstrap_servers,
        "client_id": cfg.client_id,
        "security_protocol": cfg.security_protocol,
    }
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        kwargs["ssl_context"] = create_ssl_context()
    if cfg.sasl_mechanism:
        username = secret(cfg.sasl_username_env, env)
        password = secret(cfg.sasl_password_env, env)
        if not (username and password):
            raise UserError(
                f"kafka.sasl_mechanism={cfg.sasl_mechanism} needs credentials in the environment: "
                f"set {cfg.sasl_username_env} and {cfg.sasl_password_env}"
            )
        kwargs.update(
            sasl_mechanism=cfg.sasl_mechanism,
            sasl_plain_username=username,
            sasl_plain_password=password,
        )
    return kwargs


async def partitions_of(consumer: Any, topic: str) -> set[int]:
    """Partition ids of ``topic`` from fresh metadata (empty when it does not exist).

    ``AIOKafkaConsumer.partitions_for_topic`` reads the consumer's cached metadata, which does
    not know topics created after the consumer started, and ``topics()`` fetches fresh metadata
    without updating that cache; so read the fresh cluster view directly.
    """
    cluster = await consumer._client.fetch_all_metadata()
    return set(cluster.partitions_for_topic(topic) or ())


def make_producer(
    cfg: KafkaConfig, env: Mapping[str, str] | None = None, **overrides: Any
) -> AIOKafkaProducer:
    """An idempotent producer (acks=all): retries never duplicate or reorder a partition. One
    send fails after ``kafka.request_timeout_ms`` when the broker cannot be reached."""
    kwargs = {
        **client_kwargs(cfg, env),
        "enable_idempotence": True,
        "acks": "all",
        "request_timeout_ms": cfg.request_timeout_ms,
        # A prompt version may be as large as the prompts topic takes (plus batch framing).
        "max_request_size": max(1_048_576, cfg.max_message_bytes + 65_536),
    }
    kwargs.update(overrides)
    return _Producer(**kwargs)


class _Producer(AIOKafkaProducer):  # type: ignore[misc]
    """aiokafka's producer, leaving no future's exception unretrieved when it fails for good.

    Fenced (or failed otherwise for good), aiokafka 0.14 sets the error on futures nobody
    awaits: the delivery future of each record sent and not awaited (a transaction waits for
    its commit, not for each send), the drain waiter of each batch not yet sent, and the
    transaction's waiter, which its context manager skips on a fatal error. asyncio logs each
    one it collects as "Future exception was never retrieved" with a traceback (8 for a fenced
    zombie engine). The delivery futures are retrieved as they complete (awaiting one still
    raises); the rest when the producer stops."""

    async def send(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = await super().send(*args, **kwargs)
        future.add_done_callback(_retrieve)
        return future

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            _retrieve_leftovers(self)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if future.done() and not future.cancelled():
        future.exception()


def _retrieve_leftovers(producer: AIOKafkaProducer) -> None:
    """The futures of a stopped producer that may hold an error nobody will ask for."""
    accumulator = getattr(producer, "_message_accumulator", None)
    batches = [b for queue in getattr(accumulator, "_batches", {}).values() for b in queue]
    for batch in [*batches, *getattr(accumulator, "_pending_batches", ())]:
        _retrieve(batch.future)
        _retrieve(batch._drain_waiter)
        for future, _ in batch._msg_futures:
            _retrieve(future)
    txn = getattr(producer, "_txn_manager", None)
    for name in ("_transaction_waiter", "_pid_waiter"):
        waiter = getattr(txn, name, None)
        if isinstance(waiter, asyncio.Future):
            _retrieve(waiter)


def _reachable(bootstrap: str, timeout_s: float = 3.0) -> bool:
    """Whether any bootstrap address accepts a TCP connection."""
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


async def start_client(client: Any, cfg: KafkaConfig) -> None:
    """Start an aiokafka client, or stop it and raise one clear UserError naming the setting
    to check (not a traceback and a warning about an unclosed client)."""
    try:
        await client.start()
    except BaseException as exc:
        # Stopped whatever ended the start (a cancelled start too: a shutdown, a sibling task's
        # failure), so no half-started client is left open.
        with anyio.move_on_after(10, shield=True):
            await stop_quietly(client)
        if not isinstance(exc, KafkaError | OSError):
            raise
        bootstrap = cfg.bootstrap_servers
        if await anyio.to_thread.run_sync(_reachable, bootstrap):
            raise UserError(
                f"the broker at kafka.bootstrap_servers = {bootstrap} is reachable but the "
                f"Kafka handshake failed ({type(exc).__name__}): check kafka.security_protocol "
                f"(now {cfg.security_protocol}), kafka.sasl_mechanism (now "
                f"{cfg.sasl_mechanism}) and the credentials in {cfg.sasl_username_env} / "
                f"{cfg.sasl_password_env}"
            ) from None
        raise UserError(
            f"no Kafka broker answers at kafka.bootstrap_servers = {bootstrap}: is it running "
            "(`combee-stream kafka status`), and is the address right?"
        ) from None


async def stop_quietly(client: Any) -> None:
    """Stop an aiokafka client on the way out: a failure is logged, never masks the real error."""
    try:
        await client.stop()
    except Exception as exc:
        log.debug("close failed", client=type(client).__name__, error=str(exc))


__all__ = ["client_kwargs", "make_producer", "partitions_of", "start_client", "stop_quietly"]
