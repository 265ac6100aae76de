"""An agent that gets better while it works: ten lines of user code around combee-stream.

It answers generated finance problems through any OpenAI-compatible endpoint (the config's
``[llm.agent]`` role, or OPENAI_BASE_URL), always with the newest prompt of key ``finance``, and
sends every run back as a trace with the environment's feedback; ``combee-stream run`` learns
from the traces and publishes new prompt versions, which the next tasks get.

    combee-stream kafka start && combee-stream topics create
    combee-stream llm serve --model qwen2.5-coder-1.5b --port 8080 &   # or your own endpoint
    COMBEE__LLM__AGENT__BASE_URL=http://127.0.0.1:8080/v1 ... combee-stream run &
    python examples/agent.py
"""

import anyio

from combee_stream import TraceProducer, load_config
from combee_stream.agent import PromptClient, RunRecorder
from combee_stream.evaluation import Answerer
from combee_stream.llm import LLMClient
from combee_stream.tasks import generate_tasks, task_feedback


async def main() -> None:
    config = load_config("configs/local.toml")
    async with (
        PromptClient(config.kafka, "finance", snapshot=".state/finance-prompt.json") as prompts,
        TraceProducer(config.kafka) as traces,
        LLMClient(config.llm) as llm,
    ):
        agent = Answerer(llm)  # reasons, cites the playbook's bullets, uses a calculator
        for task in generate_tasks(20, seed=1):
            prompt = prompts.current()  # the newest prompt: text, version, bullet ids
            answer = await agent.answer(prompt.text, task.question)
            run = RunRecorder(prompt, task.question)
            run.record(answer)  # its reasoning, the calculator call, the bullets it cited
            feedback = task_feedback(task, answer.output)  # right or wrong, and the reference
            await run.send(traces, output=answer.output, feedback=feedback)


if __name__ == "__main__":
    anyio.run(main)
