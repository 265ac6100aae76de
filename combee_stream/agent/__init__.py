"""The agent SDK: get the current prompt, record the run, send the trace.

```python
from combee_stream.agent import PromptClient, RunRecorder, TraceProducer
async with PromptClient(config.kafka, "support-bot", snapshot="prompt.json") as prompts, \\
        TraceProducer(config.kafka) as traces:
    prompt = prompts.current()                       # text, version, bullet ids, source
    run = RunRecorder(prompt, task)
    ... your agent, with prompt.text as its system prompt; run.thought(...), run.cite(...)
    await run.send(traces, output=answer, feedback=Feedback(passed=ok))
```

It needs Kafka and nothing of the learning side: importing it loads neither the LLM layer nor
the learning core (``tests/test_api.py`` checks it). The example agent that ``eval``, the
quality benchmark and the demo run is :class:`combee_stream.evaluation.Answerer`;
``examples/agent.py`` shows both in ten lines.
"""

from combee_stream.agent.prompts import Prompt, PromptClient
from combee_stream.agent.recorder import Answered, RunRecorder
from combee_stream.kafka.producer import TraceProducer

__all__ = ["Answered", "Prompt", "PromptClient", "RunRecorder", "TraceProducer"]
