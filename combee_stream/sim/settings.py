"""Settings of the simulated LLM server: latency model, fault model, overload, seed.

Everything the simulator measures is simulated: durations come from this model, not from a model.
Tokens are counted as ``ceil(len(text) / 4)`` characters (a common rule of thumb for English
with BPE tokenizers), for prompts and completions alike.
"""

from __future__ import annotations

from msgspec import Struct, field

from combee_stream.tokens import estimate_tokens as count_tokens


class LatencyModel(Struct, forbid_unknown_fields=True, kw_only=True):
    """Simulated service time of one call, in simulated seconds:
    ``(base_s + per_input_token_s * tokens_in + per_output_token_s * tokens_out) * (1 ± jitter)``
    with the jitter factor uniform and deterministic per (seed, request, attempt)."""

    base_s: float = 0.0
    per_input_token_s: float = 0.0
    per_output_token_s: float = 0.0
    jitter: float = 0.0  # relative, uniform in [-jitter, +jitter]

    def __post_init__(self) -> None:
        for name in ("base_s", "per_input_token_s", "per_output_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"latency {name} must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("latency jitter must be in [0, 1]")

    def seconds(self, tokens_in: int, tokens_out: int, unit: float) -> float:
        """Service time for a call; ``unit`` in [0, 1) places it inside the jitter band."""
        mean = (
            self.base_s + self.per_input_token_s * tokens_in + self.per_output_token_s * tokens_out
        )
        return mean * (1.0 + self.jitter * (2.0 * unit - 1.0))


class FaultModel(Struct, forbid_unknown_fields=True, kw_only=True):
    """Probability of each fault kind per attempt (the kinds are exclusive; rates sum to <= 1).

    A request that already failed ``max_faults_per_request`` times always succeeds next, so a
    client that retries the same request eventually gets an answer. ``retry_after_s`` is
    simulated (the Retry-After header says ``retry_after_s / time_scale``); ``timeout_s`` is real
    seconds, not scaled: it must outlast the client's real timeout.
    """

    rate_429: float = 0.0
    retry_after_s: float = 1.0
    rate_500: float = 0.0
    rate_timeout: float = 0.0
    timeout_s: float = 120.0
    rate_malformed: float = 0.0  # 200 with truncated JSON content
    rate_schema_violation: float = 0.0  # 200 with valid JSON that misses required fields
    max_faults_per_request: int = 3

    def __post_init__(self) -> None:
        rates = self.rates()
        for kind, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate {kind} must be in [0, 1]")
        if sum(rates.values()) > 1.0 + 1e-9:
            raise ValueError("fault rates must sum to at most 1")
        if self.retry_after_s < 0 or self.timeout_s < 0:
            raise ValueError("retry_after_s and timeout_s must be >= 0")
        if self.max_faults_per_request < 0:
            raise ValueError("max_faults_per_request must be >= 0")

    def rates(self) -> dict[str, float]:
        """Fault kind -> rate, in the order their probability intervals are laid out."""
        return {
            "429": self.rate_429,
            "500": self.rate_500,
            "timeout": self.rate_timeout,
            "malformed": self.rate_malformed,
            "schema_violation": self.rate_schema_violation,
        }


class RealismModel(Struct, forbid_unknown_fields=True, kw_only=True):
    """What real models do that a perfect script would not (each a probability, drawn
    deterministically per lesson or per trace from the seed). All off by default.

    - ``paraphrase``: a curator rewords a lesson it adds (one word swapped for a synonym), so
      the same lesson can reach the playbook twice under different words;
    - ``miss``: a reflector misses the lesson a trace carries;
    - ``invent``: a reflector adds a vague lesson of its own that no trace carries;
    - ``uncited_tags``: a reflector also tags playbook bullets the agent never cited.
    """

    paraphrase: float = 0.0
    miss: float = 0.0
    invent: float = 0.0
    uncited_tags: float = 0.0

    def __post_init__(self) -> None:
        for name in ("paraphrase", "miss", "invent", "uncited_tags"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"realism {name} must be in [0, 1]")


class SimSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """``overload``: curator capacity C (None = unlimited), see ``roles.curate``.
    ``time_scale``: simulated seconds per real second (10 = latencies run 10x faster)."""

    seed: int = 0
    overload: int | None = None
    latency: LatencyModel = field(default_factory=LatencyModel)
    faults: FaultModel = field(default_factory=FaultModel)
    realism: RealismModel = field(default_factory=RealismModel)
    time_scale: float = 1.0
    # Requests must carry ``Authorization: Bearer <api_key>`` (401 otherwise); None = any.
    api_key: str | None = None
    # The models served (and listed); a request for another gets 404 model_not_found, as from a
    # real endpoint once a model is removed. None: any model is accepted.
    models: tuple[str, ...] | None = None
    # A chat request whose prompt contains this text always gets a schema-violating reply:
    # a trace the model cannot handle, while the others succeed.
    poison: str | None = None

    def __post_init__(self) -> None:
        if self.overload is not None and self.overload < 1:
            raise ValueError("overload capacity must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")


__all__ = ["FaultModel", "LatencyModel", "RealismModel", "SimSettings", "count_tokens"]
