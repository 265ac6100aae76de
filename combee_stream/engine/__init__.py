"""The streaming service: Kafka in, the key pipelines, prompt versions out (see engine.py)."""

from combee_stream.engine.engine import Engine

__all__ = ["Engine"]
