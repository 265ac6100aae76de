"""combee-stream: learn agent playbooks from traces with Combee, over Kafka or files.

The public API is this module's ``__all__`` (the README's "Public API" section says what each
name is for); everything else is an implementation detail. It is loaded name by name on first
use, so that an agent importing the SDK (``combee_stream.agent``) does not load the LLM layer
and the learning core with it. Errors derive from :class:`CombeeError` (the tree is drawn in
:mod:`combee_stream.errors`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from combee_stream.config import Config, load_config
    from combee_stream.core.gate import AcceptAll, Candidate, GateChain, PublishGate, Verdict
    from combee_stream.core.learner import Learner
    from combee_stream.core.pipeline import (
        KeyPipeline,
        MemorySink,
        Pending,
        PipelineSettings,
        Sink,
        Window,
        closed_inbox,
    )
    from combee_stream.core.results import FailedTrace, WindowError
    from combee_stream.core.versions import KeyChain, UpdateTooLarge
    from combee_stream.errors import (
        BrokerUnavailableError,
        CombeeError,
        ConfigError,
        DecodeError,
        EngineHalted,
        SchemaVersionError,
        UserError,
    )
    from combee_stream.evaluation.calculator import CalculatorError
    from combee_stream.formats import TraceFormat
    from combee_stream.kafka.broker import BrokerError
    from combee_stream.kafka.producer import TraceProducer
    from combee_stream.kafka.reader import TopicMissingError, UndecodableStateError
    from combee_stream.kafka.subscriber import PromptSubscriber
    from combee_stream.kafka.topics import StateLostError, TopicLostError, TopicMismatchError
    from combee_stream.llm import LLMCallError, MissingEndpointError
    from combee_stream.schemas import Feedback, Playbook, PromptUpdate, Step, Trace
    from combee_stream.wiring import Engine, build_gate, build_learner, run_learn

# Where each public name lives (the TYPE_CHECKING imports above, for type checkers).
_HOMES: Final = {
    # running it
    "Config": "combee_stream.config",
    "load_config": "combee_stream.config",
    "Engine": "combee_stream.wiring",
    "run_learn": "combee_stream.wiring",
    "build_learner": "combee_stream.wiring",
    "build_gate": "combee_stream.wiring",
    "TraceProducer": "combee_stream.kafka.producer",
    "PromptSubscriber": "combee_stream.kafka.subscriber",
    # the wire records
    "Trace": "combee_stream.schemas",
    "Feedback": "combee_stream.schemas",
    "Step": "combee_stream.schemas",
    "Playbook": "combee_stream.schemas",
    "PromptUpdate": "combee_stream.schemas",
    # the seams: a gate, a sink (a driver of your own), a trace format, and their values
    "PublishGate": "combee_stream.core.gate",
    "Candidate": "combee_stream.core.gate",
    "Verdict": "combee_stream.core.gate",
    "AcceptAll": "combee_stream.core.gate",
    "GateChain": "combee_stream.core.gate",
    "Sink": "combee_stream.core.pipeline",
    "MemorySink": "combee_stream.core.pipeline",
    "KeyPipeline": "combee_stream.core.pipeline",
    "Pending": "combee_stream.core.pipeline",
    "PipelineSettings": "combee_stream.core.pipeline",
    "Window": "combee_stream.core.pipeline",
    "closed_inbox": "combee_stream.core.pipeline",
    "KeyChain": "combee_stream.core.versions",
    "Learner": "combee_stream.core.learner",
    "FailedTrace": "combee_stream.core.results",
    "TraceFormat": "combee_stream.formats",
    # the exception tree
    "CombeeError": "combee_stream.errors",
    "UserError": "combee_stream.errors",
    "ConfigError": "combee_stream.errors",
    "MissingEndpointError": "combee_stream.llm",
    "BrokerError": "combee_stream.kafka.broker",
    "TopicMismatchError": "combee_stream.kafka.topics",
    "StateLostError": "combee_stream.kafka.topics",
    "TopicLostError": "combee_stream.kafka.topics",
    "TopicMissingError": "combee_stream.kafka.reader",
    "DecodeError": "combee_stream.errors",
    "SchemaVersionError": "combee_stream.errors",
    "LLMCallError": "combee_stream.llm",
    "WindowError": "combee_stream.core.results",
    "UpdateTooLarge": "combee_stream.core.versions",
    "CalculatorError": "combee_stream.evaluation.calculator",
    "EngineHalted": "combee_stream.errors",
    "BrokerUnavailableError": "combee_stream.errors",
    "UndecodableStateError": "combee_stream.kafka.reader",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'combee_stream' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "AcceptAll",
    "BrokerError",
    "BrokerUnavailableError",
    "CalculatorError",
    "Candidate",
    "CombeeError",
    "Config",
    "ConfigError",
    "DecodeError",
    "Engine",
    "EngineHalted",
    "FailedTrace",
    "Feedback",
    "GateChain",
    "KeyChain",
    "KeyPipeline",
    "LLMCallError",
    "Learner",
    "MemorySink",
    "MissingEndpointError",
    "Pending",
    "PipelineSettings",
    "Playbook",
    "PromptSubscriber",
    "PromptUpdate",
    "PublishGate",
    "SchemaVersionError",
    "Sink",
    "StateLostError",
    "Step",
    "TopicLostError",
    "TopicMismatchError",
    "TopicMissingError",
    "Trace",
    "TraceFormat",
    "TraceProducer",
    "UndecodableStateError",
    "UpdateTooLarge",
    "UserError",
    "Verdict",
    "Window",
    "WindowError",
    "build_gate",
    "build_learner",
    "closed_inbox",
    "load_config",
    "run_learn",
]
