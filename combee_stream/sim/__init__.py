"""Deterministic OpenAI-compatible LLM simulator for tests and benchmarks (everything measured
with it is simulated), with synthetic traces and lesson scoring."""

from combee_stream.sim.app import SimApp
from combee_stream.sim.score import Score, score
from combee_stream.sim.server import (
    IN_PROCESS_BASE_URL,
    BlockingSimServer,
    SimServer,
    sim_app,
    sim_http_client,
    sim_server,
    sim_server_blocking,
    simulated_llm,
)
from combee_stream.sim.settings import FaultModel, LatencyModel, SimSettings, count_tokens
from combee_stream.sim.traces import generate_traces

__all__ = [
    "IN_PROCESS_BASE_URL",
    "BlockingSimServer",
    "FaultModel",
    "LatencyModel",
    "Score",
    "SimApp",
    "SimServer",
    "SimSettings",
    "count_tokens",
    "generate_traces",
    "score",
    "sim_app",
    "sim_http_client",
    "sim_server",
    "sim_server_blocking",
    "simulated_llm",
]
