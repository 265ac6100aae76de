"""Benchmarks (``combee-stream bench SUITE``): Combee against its baselines, and the engine
against its limits. Every number comes from the project's simulated LLM (combee_stream.sim),
never from a real model; each report says so and prints the latency model it used.

Suites: ``scaling`` (strategies x batch sizes), ``saturation`` (throughput against the LLM
endpoint's capacity), ``overhead`` (engine vs a bare consumer loop, memory under a backlog) and
``latency`` (trace-to-publish latency, pipelined vs synchronous windows).
"""

__all__: list[str] = []
