"""``combee-stream demo``: the whole loop on this machine, with a REAL model and no API key.

1. the local Kafka broker and fresh topics (every run learns from scratch);
2. an LLM: the config's agent endpoint if one is set, else a local model served here by
   llama.cpp (``llm serve``; the first run builds it: say so, show progress);
3. the engine, with the batch-size controller (and, in ``--sim``, the replay gate: ``DEMO_GATE``);
4. the example agent at work on generated finance problems: every task is answered with the
   current prompt of key ``finance`` and sent back as a trace with the environment's feedback;
5. live in the terminal (rich): accuracy of the agent per prompt version, the batch size the
   controller chose, the playbook growing;
6. at the end, before/after on held-out tasks: the base prompt against the newest one, paired.

``demo --sim`` is the quick demo against the project's simulated LLM (no model to build).

``live`` is the real-model demo, ``sim`` the simulated one, ``common`` what both use (the
broker with topics of the run's own, the engine's log file, the gate's note on a version),
``cli`` the command.
"""

from combee_stream.demo.cli import register

__all__ = ["register"]
