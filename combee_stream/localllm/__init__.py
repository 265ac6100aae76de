"""A real local model on this machine: llama.cpp's ``llama-server`` built from the sources in
a PyPI sdist, serving a small model assembled from registry wheels (``combee-stream llm
serve``). For demos, quality benchmarks and smoke tests; any OpenAI-compatible endpoint works
in its place."""

from combee_stream.localllm.models import MODELS, ModelSpec
from combee_stream.localllm.server import LocalServer, local_model, role_config

__all__ = ["MODELS", "LocalServer", "ModelSpec", "local_model", "role_config"]
