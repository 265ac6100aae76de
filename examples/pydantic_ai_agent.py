"""An agent built with a real framework (Pydantic AI) whose OpenTelemetry spans are learned from.
Its combee-stream code: ``PromptClient`` reads the current prompt (its system instructions), and
``PromptSpanProcessor`` stamps that prompt's key and version on the spans; ``load_config`` finds
the broker. Everything else is Pydantic AI and the OpenTelemetry SDK, configured by their own
environment variables (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OTEL_EXPORTER_OTLP_ENDPOINT``).

The agent's spans (Pydantic AI writes the GenAI semantic conventions: ``invoke_agent`` and
``chat`` spans with ``gen_ai.input.messages`` / ``gen_ai.output.messages``) go over OTLP/HTTP to
an OpenTelemetry Collector whose Kafka exporter writes them to ``otlp_spans``; ``combee-stream
ingest otel`` turns them into traces keyed by ``combee.prompt.key``, and the engine learns.

    pip install 'combee-stream[otel]' 'pydantic-ai-slim[openai]' \
        opentelemetry-exporter-otlp-proto-http
    combee-stream kafka start && otelcol --config collector.yaml &   # see the README
    combee-stream run --ingest otel &
    OPENAI_BASE_URL=http://127.0.0.1:8080/v1 python examples/pydantic_ai_agent.py [QUESTION ...]

``tests/test_ingest.py`` runs this file against the simulator, through a real Collector.

Run outcomes, when the environment knows them, go back keyed by the trace id
(``TraceProducer.send_feedback``), or as ``gen_ai.evaluation.result`` events.
"""

import sys

import anyio
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pydantic_ai import Agent
from pydantic_ai.models.instrumented import InstrumentationSettings

from combee_stream import load_config
from combee_stream.agent import PromptClient
from combee_stream.otel import PromptSpanProcessor

QUESTIONS = ["How do I reset my password?", "Can I change my plan mid-month?"]


async def main(questions: list[str]) -> None:
    config = load_config("configs/local.toml")  # COMBEE__* variables override it
    async with PromptClient(config.kafka, "support-bot") as prompts:
        provider = TracerProvider(resource=Resource.create({"service.name": "support-bot"}))
        provider.add_span_processor(PromptSpanProcessor.following(prompts))  # key + version
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # to the Collector
        # Chat Completions (the "openai:" prefix now means the Responses API).
        agent = Agent("openai-chat:gpt-4o-mini", name="support-bot")
        agent.instrument = InstrumentationSettings(tracer_provider=provider)
        for question in questions:
            # The newest prompt as the system instructions; the run's spans say which version.
            result = await agent.run(question, instructions=prompts.current().text)
            print(result.output)
        provider.shutdown()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:] or QUESTIONS)
