"""A router for prefill/decode disaggregation (``ucm proxy``).

Clients talk to it as to one vLLM OpenAI server (``/v1/completions`` and
``/v1/chat/completions``, streaming or not). For each request it

1. sends the prompt to a prefill engine (round robin over the healthy ones)
   with ``max_tokens=1``, no streaming, and vLLM's P/D field
   ``kv_transfer_params: {"do_remote_decode": true}``; the engine answers
   once the prompt's KV is in the shared store, with ``kv_transfer_params``
   naming those blocks (:mod:`.handover`);
2. sends the original request, with those ``kv_transfer_params``, to a
   decode engine, and passes its answer (status, body, stream) back as is.

The P/D fields are the proxy's alone: of a client's own ``kv_transfer_params``
only UCM's per-request controls (``ucm_skip_load``, ``ucm_skip_save``,
``ucm_max_load_tokens``, Cache Blend's chunk keys) reach the engines; the
rest (``do_remote_decode``, ``ucm_blocks``, ...) is dropped, with a debug
log. A request body nested deeper than :data:`MAX_JSON_DEPTH` is refused
with 400.

The shape is vLLM's own disaggregated-serving proxies'. Errors of an engine
(4xx, 5xx) are passed through with their status. A prefill engine that
cannot be reached (down, killed mid-request, slower than
``prefill_timeout_s``) is not an error: the request goes to a decode engine
without a handover and is computed there (logged, and marked by the
response header ``x-ucm-prefill: skipped``). Background health checks (``/health``)
keep engines that are down out of the rotation. A client that hangs up
mid-answer is not an engine's fault: the proxy closes the engine's connection
(the engine aborts the request) and the engine stays in the rotation.
``GET /metrics`` serves the proxy's own series in Prometheus text format
(:mod:`.proxy_metrics`): the requests by outcome, those in flight, the time of each phase and of the
whole request, and the engines' errors. Built on aiohttp (server and
client), which vLLM already depends on.
"""

# Why the routing is ours: aiohttp, the framework this already uses, does
# everything it offers here (the server, the body limit client_max_size, one
# pooled ClientSession, streaming through StreamResponse, json_response). It
# has no reverse-proxy handler (hop-by-hop headers are dropped by hand,
# _SKIP_HEADERS), no upstream pools or health checks, and Request.json() is
# a plain json.loads with no nesting limit (MAX_JSON_DEPTH). Those and the
# P/D routing are the 350 lines from Pool to run.

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from ucm.integration.vllm.proxy_metrics import DecodePhase, ProxyMetrics
from ucm.integration.vllm.request_control import KEYS as REQUEST_CONTROL_KEYS
from ucm.shared.logging import get_logger

logger = get_logger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Options the prefill step must not carry: it makes one token, not a stream.
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
#: What a client may put in ``kv_transfer_params``: UCM's per-request
#: controls and Cache Blend's chunk keys (named here, not imported: the
#: proxy does not load the sparse methods and torch). Everything else there
#: is the P/D handshake between the proxy and the engines, which a client
#: must not forge (e.g. a handover naming blocks no prefill engine saved).
CLIENT_KV_PARAMS = frozenset((*REQUEST_CONTROL_KEYS, "ucm_blend_chunks", "ucm_blend_build"))
#: How deeply a request body may nest (OpenAI requests nest a handful of
#: levels; a JSON schema in ``tools`` a few dozen). Deeper bodies are refused
#: before anything walks them recursively.
MAX_JSON_DEPTH = 128
# Hop-by-hop and length headers aiohttp sets itself on the way back.
_SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class ProxyConfig:
    """What ``ucm proxy`` serves and where it routes."""

    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval_s: float = 5.0
    prefill_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = [u.rstrip("/") for u in getattr(self, name)]
            if not urls:
                raise ValueError(f"{name}: at least one engine URL is needed")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {u!r} is not an http(s):// URL")
            setattr(self, name, urls)
        if self.health_interval_s <= 0 or self.prefill_timeout_s <= 0:
            raise ValueError("health_interval_s and prefill_timeout_s must be positive")


@dataclass
class Pool:
    """Engines of one role, taken in turn; those failing health checks are skipped."""

    role: str
    urls: list[str]
    healthy: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.healthy = dict.fromkeys(self.urls, True)
        self._turn = itertools.count()

    def order(self) -> list[str]:
        """Every engine, the next one in turn first and the healthy ones before the rest."""
        start = next(self._turn) % len(self.urls)
        turn = self.urls[start:] + self.urls[:start]
        return [u for u in turn if self.healthy[u]] + [u for u in turn if not self.healthy[u]]


class _Unreachable(Exception):
    """No engine of a pool answered."""


class PDProxy:
    """The aiohttp application routing each request to a prefill, then a decode engine."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.fallbacks = 0
        self.metrics = ProxyMetrics()
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # -- lifecycle ---------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        self._health = asyncio.create_task(self._health_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        if self._session is not None:
            await self._session.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(
                *(self._check(p, u) for p in (self.prefill, self.decode) for u in p.urls)
            )
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, pool: Pool, url: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok != pool.healthy[url]:
            logger.warning("%s engine %s is %s", pool.role, url, "up" if ok else "down")
        pool.healthy[url] = ok

    # -- routes ------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        status = {
            pool.role: {u: pool.healthy[u] for u in pool.urls}
            for pool in (self.prefill, self.decode)
        }
        ok = all(any(p.healthy.values()) for p in (self.prefill, self.decode))
        return web.json_response(status, status=200 if ok else 503)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        # Set as a header: the content type carries a version and a charset,
        # which aiohttp's content_type argument refuses.
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._forward(self.decode, request, "GET", None)
        except _Unreachable as e:
            return _error(502, str(e))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One completion request, counted and timed whatever becomes of it."""
        start = time.monotonic()
        self.metrics.in_flight.inc()
        decode = DecodePhase()
        status = 500  # an exception escaping the routing counts as an error
        try:
            resp = await self._route(request, decode)
            status = resp.status
            return resp
        finally:
            self.metrics.in_flight.dec()
            self.metrics.request_done(status, decode, time.monotonic() - start)

    async def _route(self, request: web.Request, decode: DecodePhase) -> web.StreamResponse:
        """The prefill, then the decode engine's answer (``decode``: its timing)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        except RecursionError:
            # The parser recurses per level: far too deep to be a request.
            return _error(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if _too_deep(body, MAX_JSON_DEPTH):
            return _error(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        user_params = body.get("kv_transfer_params")
        if user_params is not None and not isinstance(user_params, dict):
            return _error(400, "kv_transfer_params must be an object")
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        body = dict(body)
        controls = _client_controls(user_params, request_id)
        if controls:
            body["kv_transfer_params"] = controls
        else:
            body.pop("kv_transfer_params", None)
        prefill_start = time.monotonic()
        prefill = await self._prefill(request, body, request_id)
        self.metrics.prefill_duration.observe(time.monotonic() - prefill_start)
        if isinstance(prefill, web.Response):
            return prefill  # the prefill engine's error, passed through
        decode_body = dict(body)
        if prefill is not None:
            decode_body["kv_transfer_params"] = {**controls, **prefill}
        extra = {"x-ucm-prefill": "skipped"} if prefill is None else {}
        decode.start = time.monotonic()
        try:
            resp = await self._forward(
                self.decode, request, "POST", decode_body, request_id, extra, decode
            )
        except _Unreachable as e:
            return _error(502, str(e))
        self.metrics.decode_done(decode)
        return resp

    async def _prefill(
        self, request: web.Request, body: dict[str, Any], request_id: str
    ) -> dict[str, Any] | web.Response | None:
        """The prefill engine's ``kv_transfer_params`` (None: no handover, the
        decode engine computes the prompt), or its error response. ``body``
        carries only the client's controls in ``kv_transfer_params``."""
        assert self._session is not None
        pbody = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        pbody["kv_transfer_params"] = {
            **(body.get("kv_transfer_params") or {}),
            "do_remote_decode": True,
            "do_remote_prefill": False,
        }
        pbody["stream"] = False
        pbody["max_tokens"] = 1
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        for url in self.prefill.order():
            try:
                async with self._session.post(
                    url + request.path,
                    json=pbody,
                    headers=_headers(request, request_id),
                    timeout=timeout,
                ) as r:
                    data = await r.read()
                    if r.status != 200:
                        return web.Response(status=r.status, body=data, content_type=r.content_type)
                    answer = json.loads(data)
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    return params if isinstance(params, dict) else None
            except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError) as e:
                self._engine_failed(self.prefill, url)
                logger.warning("prefill engine %s failed (%s); trying another", url, _why(e))
        self.fallbacks += 1
        self.metrics.prefill_fallbacks.inc()
        logger.warning(
            "request %s: no prefill engine answered; the decode engine computes the prompt",
            request_id,
        )
        return None

    async def _forward(
        self,
        pool: Pool,
        request: web.Request,
        method: str,
        body: dict[str, Any] | None,
        request_id: str | None = None,
        extra_headers: dict[str, str] | None = None,
        phase: DecodePhase | None = None,
    ) -> web.StreamResponse:
        """The request on the first engine of ``pool`` that answers; its
        answer (status, headers, body or stream) passed back as it comes,
        its first byte, end and any break-off or hang-up noted in ``phase``."""
        assert self._session is not None
        errors = []
        for url in pool.order():
            try:
                upstream = await self._session.request(
                    method,
                    url + request.path,
                    json=body,
                    headers=_headers(request, request_id),
                )
            except (TimeoutError, aiohttp.ClientError) as e:
                self._engine_failed(pool, url)
                errors.append(f"{url}: {_why(e)}")
                continue
            async with upstream:
                resp = web.StreamResponse(status=upstream.status)
                for k, v in upstream.headers.items():
                    if k.lower() not in _SKIP_HEADERS:
                        resp.headers[k] = v
                resp.headers.update(extra_headers or {})
                if await self._relay(request, resp, upstream, pool, url, phase):
                    await resp.write_eof()
                else:
                    # Closed, not released: the rest of the answer is not
                    # read, and the engine, seeing its reader go, aborts the
                    # request instead of computing it for no one.
                    upstream.close()
                    if phase is not None:
                        phase.client_gone = True
                    logger.info(
                        "request %s: the client hung up mid-answer; dropped %s engine %s's answer",
                        request_id,
                        pool.role,
                        url,
                    )
                if phase is not None:
                    phase.end = time.monotonic()
                return resp
        raise _Unreachable(f"no {pool.role} engine answered ({'; '.join(errors)})")

    def _engine_failed(self, pool: Pool, url: str) -> None:
        """Takes ``pool``'s engine at ``url`` out of the rotation until a
        health check finds it up, and counts the error."""
        pool.healthy[url] = False
        self.metrics.engine_error(pool.role)

    async def _relay(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        pool: Pool,
        url: str,
        phase: DecodePhase | None,
    ) -> bool:
        """Passes the answer of ``pool``'s engine at ``url`` on to the client
        as it comes; False if the client hung up before its end.

        A failed read is the engine's fault: it leaves the rotation until a
        health check finds it up, and the answer ends where it broke off. A
        failed write is the client's going, which says nothing of the engine.
        """
        try:
            await resp.prepare(request)
        except (ConnectionError, aiohttp.ClientError):
            return False
        while True:
            try:
                chunk = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError) as e:
                # Headers are gone already: all that is left is to end the stream.
                logger.warning("%s engine %s failed mid-answer: %s", pool.role, url, _why(e))
                self._engine_failed(pool, url)
                if phase is not None:
                    phase.cut_off = True
                return True
            if not chunk:
                return True
            if phase is not None and phase.first_byte is None:
                phase.first_byte = time.monotonic()
            try:
                await resp.write(chunk)
            except (ConnectionError, aiohttp.ClientError):
                # aiohttp >= 3.10 raises ClientConnectionResetError (a
                # ClientError), older ones ConnectionResetError.
                return False


def _client_controls(params: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
    """The keys of a client's ``kv_transfer_params`` that may reach the
    engines (:data:`CLIENT_KV_PARAMS`); the others are dropped."""
    if not params:
        return {}
    dropped = [k for k in params if k not in CLIENT_KV_PARAMS]
    if dropped:
        # A client chooses these names: quoted, and a few only.
        shown = ", ".join(repr(k)[:64] for k in dropped[:8])
        more = f" and {len(dropped) - 8} more" if len(dropped) > 8 else ""
        logger.debug(
            "request %s: dropped the client's kv_transfer_params %s%s (the P/D fields are "
            "the proxy's own)",
            request_id,
            shown,
            more,
        )
    return {k: v for k, v in params.items() if k in CLIENT_KV_PARAMS}


def _too_deep(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (walked
    without recursion, so any depth the parser accepted is safe here)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return False


def _headers(request: web.Request, request_id: str | None) -> dict[str, str]:
    out = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    if request_id is not None:
        out["X-Request-Id"] = request_id
    return out


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error(status: int, message: str) -> web.Response:
    """An error in the OpenAI API's shape."""
    return web.json_response(
        {"error": {"message": message, "type": "ucm_proxy_error", "code": status}}, status=status
    )


def run(config: ProxyConfig) -> None:
    """Serves until interrupted."""
    proxy = PDProxy(config)
    logger.info(
        "ucm proxy on http://%s:%d: prefill %s, decode %s",
        config.host,
        config.port,
        ", ".join(config.prefill),
        ", ".join(config.decode),
    )
    web.run_app(proxy.app(), host=config.host, port=config.port, print=None)


__all__ = ["CLIENT_KV_PARAMS", "MAX_JSON_DEPTH", "PDProxy", "Pool", "ProxyConfig", "run"]
