"""The agent side of the loop: get the current prompt, run, send the trace.

```python
from combee_stream.agent import PromptClient, RunRecorder
async with PromptClient(config.kafka, "support-bot", snapshot="prompt.json") as prompts, \\
        TraceProducer(config.kafka) as traces:
    prompt = prompts.current()                       # text, version, bullet ids, source
    run = RunRecorder(prompt, task)
    ... your agent, with prompt.text as its system prompt; run.thought(...), run.cite(...)
    await run.send(traces, output=answer, feedback=Feedback(passed=ok))
```

:class:`Answerer` is the example agent (reason, cite bullets, calculator) that ``eval``, the
quality benchmark and the demo run; ``examples/agent.py`` shows it in ten lines.
"""

from combee_stream.agent.answerer import Answer, Answerer
from combee_stream.agent.prompts import Prompt, PromptClient
from combee_stream.agent.recorder import RunRecorder

__all__ = ["Answer", "Answerer", "Prompt", "PromptClient", "RunRecorder"]
