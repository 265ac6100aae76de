"""Configuration: one typed place, env overrides, errors that name the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from combee_stream.config import ConfigError, load_config, required_secret

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_config_loads() -> None:
    for path in sorted((REPO / "configs").glob("*.toml")):
        load_config(path, env={})


def test_env_overrides_every_level_with_typed_values() -> None:
    cfg = load_config(
        REPO / "configs" / "local.toml",
        env={
            "COMBEE__KAFKA__PARTITIONS": "6",
            "COMBEE__LLM__CURATOR__TEMPERATURE": "0.5",
            "COMBEE__LEARNING__BATCH_SIZE": "40",
            "COMBEE__KAFKA__PROMPTS_TOPIC_CONFIGS": '{ "segment.ms" = "100" }',
            "UNRELATED": "x",
        },
    )
    assert cfg.kafka.partitions == 6
    assert cfg.llm.curator.temperature == 0.5
    assert cfg.learning.batch_size == 40
    assert cfg.kafka.prompts_topic_configs == {"segment.ms": "100"}


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[kafka]\npartitions = 'three'\n", "kafka.partitions: Expected `int`"),
        ("[kafka]\npartitons = 3\n", "kafka: Object contains unknown field `partitons`"),
        ("[learning]\nstrategy = 'fastest'\n", "learning.strategy"),
        ("[broker]\nport = 70000\n", "broker.port"),
        ("[learning]\nmin_batch_size = 50\nmax_batch_size = 10\n", "min_batch_size must be"),
        ("[kafka\n", "not valid TOML"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path: Path, toml: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}: ")
    assert needle in str(info.value)


def test_bad_env_override_names_the_variable_path() -> None:
    with pytest.raises(
        ConfigError, match=r"^environment COMBEE__KAFKA__PARTITIONS: kafka\.partitions"
    ):
        load_config(None, env={"COMBEE__KAFKA__PARTITIONS": "0"})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml", env={})


def test_secrets_are_not_config_fields() -> None:
    cfg = load_config(None, env={})
    # roles name the environment variable holding their key; no field holds a key itself
    assert cfg.llm.curator.api_key_env == "OPENAI_API_KEY"
    assert not hasattr(cfg.llm.curator, "api_key")


def test_the_gate_and_canary_secrets_come_from_the_environment() -> None:
    """The held-out choice and the canary split are keyed by secrets only the environment
    holds; a missing or short one stops the start with the variable named."""
    cfg = load_config(None, env={})
    assert (cfg.gate.holdout_secret_env, cfg.gate.canary_secret_env) == (
        "COMBEE_HOLDOUT_SECRET",
        "COMBEE_CANARY_SECRET",
    )
    with pytest.raises(
        ConfigError, match=r"^gate\.replay needs .* COMBEE_HOLDOUT_SECRET, which is not set"
    ):
        required_secret("COMBEE_HOLDOUT_SECRET", "gate.replay", env={})
    with pytest.raises(ConfigError, match="fewer than 16 characters"):
        required_secret("COMBEE_HOLDOUT_SECRET", "gate.replay", env={"COMBEE_HOLDOUT_SECRET": "x"})
    good = {"COMBEE_HOLDOUT_SECRET": "0123456789abcdef"}
    assert required_secret("COMBEE_HOLDOUT_SECRET", "gate.replay", env=good) == "0123456789abcdef"
