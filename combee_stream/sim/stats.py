"""What the simulator counts, per role: requests, completed answers, faults, tokens.

``completed`` counts 200 responses carrying a usable answer (a content fault is a fault, not a
completion), and ``completed_by_request`` counts them per distinct request body (sha256 of the
canonical JSON), so a test can show that no call that finished was paid for twice.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct, field

from combee_stream.sim.faults import FAULT_KINDS, FaultKind


class RoleStats(Struct, kw_only=True):
    requests: int = 0
    completed: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    disconnected: int = 0  # the client went away before the answer (e.g. it timed out)
    tokens_in: int = 0  # billed: every 200 response, faulty content included
    tokens_out: int = 0


class SimStats(Struct, kw_only=True):
    simulated: bool = True
    roles: dict[str, RoleStats] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    bad_requests: int = 0
    completed_by_request: dict[str, int] = field(default_factory=dict)

    def role(self, name: str) -> RoleStats:
        return self.roles.setdefault(name, RoleStats())

    def fault(self, role: str, kind: FaultKind) -> None:
        self.role(role).faults[kind] += 1
        self.faults[kind] += 1

    def billed(self, role: str, tokens_in: int, tokens_out: int) -> None:
        stats = self.role(role)
        stats.tokens_in += tokens_in
        stats.tokens_out += tokens_out

    def completed(self, role: str, request_hash: str) -> None:
        self.role(role).completed += 1
        self.completed_by_request[request_hash] = self.completed_by_request.get(request_hash, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """A detached snapshot (plain builtins)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


__all__ = ["RoleStats", "SimStats"]
