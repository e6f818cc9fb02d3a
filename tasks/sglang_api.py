"""Talking to an SGLang server over HTTP: the client options every request
of ours carries (the server's API key, one TLS context) and its health
check. Below both the launcher (tasks/server) and the clients that capture,
generate and check (tasks/capture, tasks/data, tasks/evaluation), which need a
server's address and key, never how it was started."""
from __future__ import annotations

import functools
import ssl

import httpx

from tasks.failures import EndsRun, Permanent


class ServerError(RuntimeError):
    """The server failed to start, died, or does not capture correctly."""


class ServerGone(EndsRun, ServerError):
    """The run's server stays down: relaunched max_restarts times and dead
    again, or attached and not answering after its wait."""


class ServerStopped(Permanent, ServerError):
    """The run stopped its own server (it was told to stop: Ctrl-C, SIGTERM,
    a cancel): nothing more is sent, nothing is relaunched or retried, and
    the requests it cut short count as no sample's fault."""


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """Built once: httpx builds a new one (loading every CA certificate) per
    client otherwise, which cost 10% of the pipeline's client time."""
    return ssl.create_default_context()


def auth_headers(api_key: str | None) -> dict:
    """What every request to a server started with `--api-key` must carry."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client_options(api_key: str | None, transport=None) -> dict:
    """httpx client arguments for talking to a server: its API key on every
    request, and our one TLS context, or `transport` in place of the network
    (tests, benchmarks)."""
    network = {"transport": transport} if transport is not None else {"verify": ssl_context()}
    return {"headers": auth_headers(api_key), **network}


def server_down(error: Exception) -> bool:
    """A request's error that means the server may be down (not an answer)."""
    return isinstance(error, httpx.TransportError)


def was_in_flight(error: Exception) -> bool:
    """The request reached the server before it went down (a refused
    connection never did): a suspect if the server crashed."""
    return server_down(error) and not isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))


def server_healthy(url: str, *, api_key: str | None = None, timeout_s: float = 30.0) -> bool:
    """Whether the server answers /health. SGLang serves /health without the
    key, but every request we make carries it: one rule, nothing to keep
    track of per endpoint."""
    try:
        with httpx.Client(timeout=timeout_s, **client_options(api_key)) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def server_says(url: str, endpoint: str, key: str, what: str, *, api_key: str | None = None):
    """The `key` field of a server's GET `endpoint` (/model_info,
    /server_info), or ServerError saying the server did not tell `what`."""
    try:
        return server_json(url, endpoint, what, api_key=api_key)[key]
    except KeyError as e:
        raise ServerError(f"{url}{endpoint} did not say {what} ({e!r}): is it an SGLang server?") from None


def server_json(url: str, endpoint: str, what: str, *, api_key: str | None = None) -> dict:
    """A server's GET `endpoint` (/model_info, /server_info) as a dict, or
    ServerError saying the server did not tell `what`."""
    try:
        with httpx.Client(timeout=30.0, **client_options(api_key)) as client:
            response = client.get(f"{url}{endpoint}")
        if response.status_code in (401, 403):
            raise ServerError(f"{url}{endpoint} refused the request ({response.status_code}): the server wants "
                              f"{'another' if api_key else 'an'} API key, the --api-key it was started with")
        body = response.json()
        if not isinstance(body, dict):
            raise TypeError(f"a {type(body).__name__}, not an object")
        return body
    except (httpx.HTTPError, ValueError, TypeError) as e:
        raise ServerError(f"{url}{endpoint} did not say {what} ({e!r}): is it an SGLang server?") from None
