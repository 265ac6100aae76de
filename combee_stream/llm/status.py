"""What an endpoint's failure means for a call: the status table, and the two kinds of failure the
transport tells apart (worth retrying, or final for this call)."""

from __future__ import annotations

import email.utils
import time
from typing import Literal

import httpx2

StatusKind = Literal["outage", "retry", "fail"]


def status_kind(status: int, code: str | None) -> StatusKind:
    """What an HTTP error answer means for a call (OpenAI's statuses and error codes, which
    compatible servers follow):

    ======================  ======================================  =========================
    status (code)           means                                   kind
    ======================  ======================================  =========================
    401, 403                the key was revoked or is not allowed   outage
    404                     the model was removed, or a wrong path  outage
    429 insufficient_quota  the quota or the billing is exhausted   outage
    429 (other codes)       a rate limit (Retry-After is honoured)  retry
    408, 409                a timeout or a conflict on the server   retry
    5xx                     the server is failing                   outage
    other 4xx               the request itself (400 context too     fail (this call only)
                            long, 413, 422)
    ======================  ======================================  =========================

    An outage fails every trace alike: the breaker opens, callers wait (their attempts
    unspent), the engine pauses intake and probes until it is fixed. Failing this call only
    parks the trace (after its attempts) while the others go on."""
    if status in (401, 403, 404) or status >= 500:
        return "outage"
    if status == 429:
        return "outage" if code == "insufficient_quota" else "retry"
    if status in (408, 409):
        return "retry"
    return "fail"


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's hint in seconds, if any;
    ``outage``: the endpoint did not answer, or answered what every call would get (see
    ``status_kind``): the circuit breaker counts it."""

    def __init__(self, reason: str, retry_after: float | None = None, outage: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.outage = outage


class _Fatal(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def retry_after(response: httpx2.Response) -> float | None:
    """Seconds from ``retry-after-ms`` / ``retry-after`` (delta seconds or an HTTP date)."""
    headers = response.headers
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = ["StatusKind", "retry_after", "short", "status_kind"]
