"""The wiring: a learner, its publish gate and the drivers, built from a config.

The layers below know nothing of each other's choices: the learning core takes its gate, its
prompts, its size bound and its LLM as given, the drivers (the engine, offline ``learn``) take a
:data:`~combee_stream.core.learner.LearnerFactory`, and the replay gate lives with the
evaluation code it uses. This module is where a config becomes those parts, the one place that
imports them all; the CLI and the public API (:class:`Engine`, :func:`run_learn`) go through
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TextIO

from combee_stream.config import Config, required_secret
from combee_stream.core.gate import AcceptAll, GateChain, PublishGate
from combee_stream.core.holdout import HoldoutPolicy
from combee_stream.core.learner import Learner, required_roles
from combee_stream.core.prompts import PROMPT_ROLES, PromptRole, Prompts, Template, parse_template
from combee_stream.engine import engine
from combee_stream.errors import UserError
from combee_stream.evaluation.examples import example_check
from combee_stream.evaluation.lessons import LessonGate
from combee_stream.evaluation.replay import ReplayGate
from combee_stream.kafka.sizes import update_bytes
from combee_stream.llm import LLMClient
from combee_stream.offline import run as offline
from combee_stream.offline.run import LearnReport


def load_prompts(prompts_dir: str | Path = "") -> Prompts:
    """The packaged templates, with any of ``prompts_dir/{role}.md`` taking their place."""
    folder = Path(prompts_dir) if prompts_dir else None
    if folder is not None and not folder.is_dir():
        raise UserError(f"prompts_dir {folder} is not a folder")
    packaged = resources.files("combee_stream.core").joinpath("prompts")
    loaded: dict[PromptRole, Template] = {}
    for role in PROMPT_ROLES:
        override = folder / f"{role}.md" if folder is not None else None
        if override is not None and override.is_file():
            loaded[role] = parse_template(role, override.read_text(), str(override))
        else:
            resource = packaged.joinpath(f"{role}.md")
            loaded[role] = parse_template(role, resource.read_text(), f"(packaged) {role}.md")
    return Prompts(
        reflector=loaded["reflector"],
        curator=loaded["curator"],
        combiner=loaded["combiner"],
        consolidator=loaded["consolidator"],
        exemplifier=loaded["exemplifier"],
    )


def build_gate(config: Config, llm: LLMClient) -> PublishGate:
    """The gate ``config.gate`` asks for: the lesson check, then the replay gate, each when on
    (AcceptAll when neither is)."""
    gates: list[PublishGate] = []
    if config.gate.check_lessons:
        gates.append(LessonGate.from_config(config.gate, llm))
    if config.gate.replay:
        gates.append(ReplayGate.from_config(config.gate, llm))
    if not gates:
        return AcceptAll()
    return gates[0] if len(gates) == 1 else GateChain(gates)


def build_learner(
    config: Config,
    llm: LLMClient,
    *,
    strategy_name: str | None = None,
    gate: PublishGate | None = None,
    env: Mapping[str, str] | None = None,
) -> Learner:
    """A learner with every option of ``config`` wired: strategy, scan parameters, the prompts
    (:func:`load_prompts` of ``learning.prompts_dir``), semantic dedup through ``llm``'s
    embeddings endpoint when ``llm.embeddings.enabled``, the size bound of a version
    (``kafka.max_message_bytes``, measured by :func:`~combee_stream.kafka.sizes.update_bytes`),
    worked examples checked as the gate's agent would be scored
    (:func:`~combee_stream.evaluation.examples.example_check`), and the gate (``gate``, else
    the one ``config.gate`` asks for, with its held-out policy, keyed by the secret
    ``gate.holdout_secret_env`` names in ``env``, default the process environment). Fails
    fast (``MissingEndpointError``) when a role it will call has no endpoint, ``ConfigError``
    when the replay gate has no secret."""
    llm.require(*required_roles(config, strategy_name))  # type: ignore[arg-type]
    holdout = None
    if config.gate.replay:
        key = required_secret(config.gate.holdout_secret_env, "gate.replay", env)
        holdout = HoldoutPolicy(config.gate, key)
    embeddings = config.llm.embeddings
    gate = gate or build_gate(config, llm)
    return Learner(
        llm,
        config.learning,
        prompts=load_prompts(config.learning.prompts_dir),
        embed=llm.embed if embeddings.enabled else None,
        dedup_threshold=embeddings.threshold,
        strategy_name=strategy_name,
        gate=gate,
        holdout=holdout,
        max_update_bytes=config.kafka.max_message_bytes,
        update_size=update_bytes,
        string_bounds={
            r: getattr(config.llm, r).max_string_chars for r in ("reflector", "curator", "combiner")
        },
        check_example=example_check(config.gate) if config.learning.worked_examples else None,
    )


class Engine(engine.Engine):
    """``await Engine(config).run()`` until ``stop()`` (or SIGTERM with ``handle_signals``): the
    streaming engine (:class:`combee_stream.engine.engine.Engine`) with the learner
    :func:`build_learner` makes of ``config``.

    ``gate``: a publish gate of your own instead of the one ``config.gate`` asks for. Raises
    :class:`~combee_stream.errors.EngineHalted` when it stopped itself (the broker unreachable
    past ``engine.broker_deadline_s``), and ``MissingEndpointError`` at construction when an LLM
    role it needs has no endpoint."""

    def __init__(
        self,
        config: Config,
        *,
        llm: LLMClient | None = None,
        gate: PublishGate | None = None,
        env: Mapping[str, str] | None = None,
        handle_signals: bool = False,
    ) -> None:
        def learner(cfg: Config, client: LLMClient) -> Learner:
            return build_learner(cfg, client, gate=gate, env=env)

        super().__init__(config, learner, llm=llm, env=env, handle_signals=handle_signals)


async def run_learn(
    config: Config,
    traces_path: Path,
    out_dir: Path,
    *,
    strategy: str | None = None,
    batch_size: str | None = None,
    resume: bool = False,
    seed: int | None = None,
    gate: PublishGate | None = None,
    env: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> LearnReport:
    """The whole ``learn`` command, callable from code (benchmarks, tests): offline learning
    (:func:`combee_stream.offline.run.run_learn`) with the learner :func:`build_learner`
    makes. ``gate``: a publish gate of your own instead of the one ``config.gate`` asks for."""

    def learner(cfg: Config, client: LLMClient) -> Learner:
        return build_learner(cfg, client, gate=gate, env=env)

    return await offline.run_learn(
        config,
        traces_path,
        out_dir,
        learner,
        strategy=strategy,
        batch_size=batch_size,
        resume=resume,
        seed=seed,
        env=env,
        stderr=stderr,
    )


__all__ = ["Engine", "build_gate", "build_learner", "load_prompts", "run_learn"]
