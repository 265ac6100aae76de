"""Where each role's calls go: its base URL and key (the role's settings, else the environment's
``OPENAI_BASE_URL`` and key), and one ``openai.AsyncOpenAI`` per endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import httpx2
import msgspec
import openai

from combee_stream.config import EmbeddingsConfig, LLMConfig, RoleConfig
from combee_stream.errors import UserError
from combee_stream.llm.types import ROLES, Role

OPENAI_DEFAULT_BASE_URL: Final = "https://api.openai.com/v1"
# Local servers (llama.cpp, vLLM, Ollama) accept any key, but the openai client wants one.
PLACEHOLDER_API_KEY: Final = "not-needed"


class MissingEndpointError(UserError):
    """No base URL and no API key for a role: nothing to call."""

    def __init__(self, section: str, api_key_env: str) -> None:
        env_path = "COMBEE__" + section.upper().replace(".", "__") + "__BASE_URL"
        key_hint = (
            "OPENAI_API_KEY"
            if api_key_env == "OPENAI_API_KEY"
            else f"{api_key_env} (named by {section}.api_key_env)"
        )
        super().__init__(
            f"no LLM endpoint for {section}: set {section}.base_url in the config file "
            f"(or the environment variable {env_path}), or OPENAI_BASE_URL for every role, "
            f"to use an OpenAI-compatible server; or set {key_hint} to use the OpenAI API."
        )
        self.section = section


class Endpoint(msgspec.Struct, frozen=True):
    base_url: str
    api_key: str


class Endpoints:
    """The endpoints of one client's roles, and their openai clients (made on first use)."""

    def __init__(
        self,
        config: LLMConfig,
        env: Mapping[str, str],
        http_client: httpx2.AsyncClient | None = None,
    ) -> None:
        self._config = config
        self.env = env
        self._http_client = http_client
        self._clients: dict[Endpoint, openai.AsyncOpenAI] = {}
        self._closed = False

    def role_config(self, role: Role) -> RoleConfig:
        if role not in ROLES:
            raise ValueError(f"unknown LLM role {role!r} (expected one of {', '.join(ROLES)})")
        rc: RoleConfig = getattr(self._config, role)
        return rc

    def endpoint(self, rc: RoleConfig | EmbeddingsConfig, section: str) -> Endpoint:
        base_url = rc.base_url or self.env.get("OPENAI_BASE_URL", "")
        api_key = self.env.get(rc.api_key_env, "")
        if not base_url and not api_key:
            raise MissingEndpointError(section, rc.api_key_env)
        return Endpoint(
            base_url=(base_url or OPENAI_DEFAULT_BASE_URL).rstrip("/"),
            api_key=api_key or PLACEHOLDER_API_KEY,
        )

    def client(self, endpoint: Endpoint) -> openai.AsyncOpenAI:
        if self._closed:
            raise RuntimeError("LLMClient is closed")
        client = self._clients.get(endpoint)
        if client is None:
            client = openai.AsyncOpenAI(
                base_url=endpoint.base_url,
                api_key=endpoint.api_key,
                max_retries=0,  # retries, backoff and Retry-After are handled here
                timeout=self._config.timeout_s,
                http_client=self._http_client,
            )
            self._clients[endpoint] = client
        return client

    async def aclose(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        # A caller-provided http_client belongs to the caller: closing an AsyncOpenAI closes it.
        if self._http_client is None:
            for client in clients:
                await client.close()


__all__ = [
    "OPENAI_DEFAULT_BASE_URL",
    "PLACEHOLDER_API_KEY",
    "Endpoint",
    "Endpoints",
    "MissingEndpointError",
]
