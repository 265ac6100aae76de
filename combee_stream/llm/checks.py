"""Start checks: before any real work, every endpoint a client will call answers, accepts its
key and serves its model; else one line naming the setting to fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import anyio
import httpx2
import openai

from combee_stream.config import EmbeddingsConfig, LLMConfig, RoleConfig
from combee_stream.errors import UserError
from combee_stream.llm.endpoints import Endpoint, Endpoints
from combee_stream.llm.transport import PROBE_TEXT
from combee_stream.llm.types import EMBEDDINGS, Role


def require(
    endpoints: Endpoints, config: LLMConfig, roles: Sequence[Role | Literal["embeddings"]]
) -> None:
    """Fail fast (MissingEndpointError) if any of ``roles`` has no endpoint."""
    for role in roles:
        if role == EMBEDDINGS:
            endpoints.endpoint(config.embeddings, "llm.embeddings")
        else:
            endpoints.endpoint(endpoints.role_config(role), f"llm.{role}")


async def check(
    endpoints: Endpoints, config: LLMConfig, roles: Sequence[Role | Literal["embeddings"]]
) -> None:
    """Before any real work: every endpoint of ``roles`` answers, accepts its key and
    serves its model. Raises UserError with one line naming the setting to fix (a mistyped
    base_url or an unset key variable would otherwise fail every trace, one by one)."""
    require(endpoints, config, roles)
    listed: dict[Endpoint, set[str] | None] = {}
    for role in dict.fromkeys(roles):
        rc: RoleConfig | EmbeddingsConfig = (
            config.embeddings if role == EMBEDDINGS else endpoints.role_config(role)
        )
        section = f"llm.{role}"
        endpoint = endpoints.endpoint(rc, section)
        if endpoint not in listed:
            listed[endpoint] = await _served_models(
                endpoints, endpoint, section, rc, config.timeout_s
            )
        served = listed[endpoint]
        if served is not None and rc.model not in served:
            raise UserError(
                f"model {rc.model!r} is not served at {endpoint.base_url} (it serves: "
                f"{', '.join(sorted(served)) or 'nothing'}): set {section}.model"
            )


async def _served_models(
    endpoints: Endpoints,
    endpoint: Endpoint,
    section: str,
    rc: RoleConfig | EmbeddingsConfig,
    timeout_s: float,
) -> set[str] | None:
    """The model ids the endpoint lists; None when it does not list models but answers a
    request of the role's kind (some servers have no /models; llama.cpp's older builds,
    say). A host that answers neither (a base_url without its /v1: 404; a web page) is a
    UserError naming the setting, not a failure of every trace later."""
    client = endpoints.client(endpoint)
    try:
        with anyio.fail_after(min(30.0, timeout_s)):
            raw = await client.models.with_raw_response.list()
    except (TimeoutError, openai.APIConnectionError) as exc:
        raise _unreachable(endpoint, section, exc) from None
    except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
        raise _refused(endpoints, endpoint, section, rc, exc.status_code) from None
    except openai.APIStatusError:
        pass  # no model listing here: the request below tells whether the API is
    else:
        served = _model_ids(raw.http_response)
        if served is not None:
            return served
    await _check_answers(endpoints, endpoint, section, rc, timeout_s)
    return None


async def _check_answers(
    endpoints: Endpoints,
    endpoint: Endpoint,
    section: str,
    rc: RoleConfig | EmbeddingsConfig,
    timeout_s: float,
) -> None:
    """A 1-token request of the role's own kind answers as an OpenAI-compatible API."""
    client = endpoints.client(endpoint)
    embeddings = isinstance(rc, EmbeddingsConfig)
    path = "/embeddings" if embeddings else "/chat/completions"
    try:
        with anyio.fail_after(min(30.0, timeout_s)):
            if embeddings:
                raw: Any = await client.embeddings.with_raw_response.create(
                    model=rc.model, input=[PROBE_TEXT]
                )
            else:
                raw = await client.chat.completions.with_raw_response.create(
                    model=rc.model,
                    messages=[{"role": "user", "content": PROBE_TEXT}],
                    max_tokens=1,
                )
    except (TimeoutError, openai.APIConnectionError) as exc:
        raise _unreachable(endpoint, section, exc) from None
    except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
        raise _refused(endpoints, endpoint, section, rc, exc.status_code) from None
    except openai.APIStatusError as exc:
        if exc.status_code == 404:
            raise UserError(
                f"the LLM endpoint at {endpoint.base_url} answers HTTP 404 for /models and "
                f"for {path} (model {rc.model!r}): check {section}.base_url (an "
                f"OpenAI-compatible API's usually ends in /v1) and {section}.model"
            ) from None
        return  # an answer about the request (a 400 for max_tokens=1, say): the API is there
    if _json_body(raw.http_response) is None:
        raise UserError(
            f"the LLM endpoint at {endpoint.base_url} does not answer as an "
            f"OpenAI-compatible API (no JSON from /models or {path}): check {section}.base_url"
        )


def _unreachable(endpoint: Endpoint, section: str, exc: BaseException) -> UserError:
    return UserError(
        f"cannot reach the LLM endpoint at {endpoint.base_url} ({type(exc).__name__}): "
        f"check {section}.base_url"
    )


def _refused(
    endpoints: Endpoints,
    endpoint: Endpoint,
    section: str,
    rc: RoleConfig | EmbeddingsConfig,
    status: int,
) -> UserError:
    key_env = rc.api_key_env
    unset = "" if endpoints.env.get(key_env) else " (it is not set)"
    return UserError(
        f"the LLM endpoint at {endpoint.base_url} refused the API key (HTTP {status}): "
        f"check the variable {key_env}{unset}, named by {section}.api_key_env"
    )


def _json_body(response: httpx2.Response) -> object | None:
    try:
        body: object = response.json()
    except ValueError:
        return None
    return body


def _model_ids(response: httpx2.Response) -> set[str] | None:
    """The ids of an OpenAI model list; None when the answer is not one (a web page)."""
    body = _json_body(response)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


__all__ = ["check", "require"]
