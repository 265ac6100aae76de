"""One exception tree: everything combee-stream raises on purpose derives from :class:`CombeeError`.

```
CombeeError
├── UserError                  something the user can fix; the CLI prints it, exit code 2
│   ├── ConfigError            a config file or COMBEE__* override is invalid
│   ├── MissingEndpointError   an LLM role has no endpoint (llm.endpoints)
│   ├── BrokerError            the local broker could not be assembled or started (kafka.broker)
│   ├── TopicMismatchError     a topic exists with settings the engine cannot run on (kafka.topics)
│   ├── StateLostError         the prompts topic is gone under committed progress, at start
│   │                          (kafka.topics)
│   └── TopicMissingError      a topic a reader needs does not exist, or was deleted while it
│                              read (kafka.reader: subscribers, PromptClient, `subscribe`)
├── DecodeError                a record failed to decode or validate (also a ValueError)
│   └── SchemaVersionError     a record names a schema version this build does not know
├── LLMCallError               an LLM call failed for good (llm.transport)
├── WindowError                a window could not be reduced (core.results)
├── UpdateTooLarge             the broker refused a version as too large (core.versions)
├── CalculatorError            the example agent's calculator refused an expression (evaluation)
└── EngineHalted               the engine stopped itself; the CLI prints it, exit code 1
    ├── BrokerUnavailableError the broker could not be written or read past the deadline
    ├── UndecodableStateError  a prompts-topic record cannot be decoded at restore (kafka.reader)
    └── TopicLostError         a topic of the engine's was deleted while it ran: its state lost
                               (kafka.topics)
```

The subclasses live beside the code that raises them; this module holds the root and the classes
several subpackages share, and the package exports every class of the tree
(``combee_stream.__all__``, checked by ``tests/test_api.py``).

Errors that stay inside the package (retry signals of the LLM client, say) do not derive from it.
"""

from __future__ import annotations


class CombeeError(Exception):
    """The root of every error combee-stream raises on purpose."""


class UserError(CombeeError):
    """Something the user can fix (bad input, missing setting, broker down at a command)."""


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid."""


class DecodeError(CombeeError, ValueError):
    """A record failed to decode or validate. ``reason`` is a one-line, field-naming message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SchemaVersionError(DecodeError):
    """A record names a schema version this build does not know."""


class EngineHalted(CombeeError):
    """The engine stopped itself rather than carry on wrongly (it committed nothing unsafe)."""


class BrokerUnavailableError(EngineHalted):
    """Kafka could not be written (or read, to restore) for longer than the configured deadline."""


__all__ = [
    "BrokerUnavailableError",
    "CombeeError",
    "ConfigError",
    "DecodeError",
    "EngineHalted",
    "SchemaVersionError",
    "UserError",
]
