"""The ASGI app (Starlette; SSE by sse-starlette; run by uvicorn): OpenAI Chat Completions,
Completions and Responses, Anthropic Messages, models, health and Prometheus metrics, over
one `EngineLoop`.

    app = create_app(loop, ctx, metrics, api_key="...")     # see dsjax.serving.server.serve

Every error is JSON in the API's own shape (OpenAI `{"error": {...}}`, Anthropic
`{"type": "error", "error": {...}}`), never a traceback. A client that disconnects has its
requests cancelled at once (their slots free at the next engine step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsjax.serving.loop import Draining, EngineFailed, EngineLoop, QueueFull
from dsjax.serving.metrics import Metrics
from dsjax.protocol import (CHAT, COMPLETIONS, MESSAGES, RESPONSES, API, APIError, Context, Job, count_tokens,
                                    detokenize, prepare, tokenize, tokenizer_info)

log = logging.getLogger("dsjax.serving")

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(anthropic: bool, e: APIError) -> dict:
    if anthropic:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}
    kind = e.kind if e.kind != "not_found_error" else "invalid_request_error"
    return {"error": {"message": e.message, "type": OPENAI_TYPES.get(e.status, kind) if e.status != 400 else kind,
                      "param": e.param, "code": e.code}}


def error_response(anthropic: bool, e: APIError) -> JSONResponse:
    return JSONResponse(error_body(anthropic, e), status_code=e.status, headers=e.headers)


async def read_json(request: Request, limit: int):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {length} bytes; the limit is {limit}")
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes")
        body.append(chunk)
    try:
        return json.loads(b"".join(body), parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None


def _not_json(name: str):
    """Python's json reads NaN / Infinity / -Infinity; RFC 8259 JSON has no such values, and a
    non-finite number in a sampling field would reach the device as one."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 numbers are finite)")


class Server:
    """The handlers, over one engine loop and one conversion context."""

    def __init__(self, loop: EngineLoop, ctx: Context, metrics: Metrics, api_key: str | None = None):
        self.loop, self.ctx, self.metrics, self.api_key = loop, ctx, metrics, api_key

    # ------------------------------------------------------------------ helpers
    def _authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())

    async def _submit(self, job: Job) -> list:
        constraints = [await self._constraint(choice) for choice in job.choices]
        streams = []
        try:
            for choice, constraint in zip(job.choices, constraints):
                streams.append(self.loop.submit(choice.prompt, choice.params, timeout=self.ctx.limits.request_timeout,
                                                constraint=constraint))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return streams

    async def _constraint(self, choice):
        """The request's grammar (recipe's OutputConstraint: json, regex, tool_call,
        tool_call_required), compiled off the event loop; with thinking on it applies to the
        answer after </think>, which is forced once the reasoning budget is spent."""
        if choice.constraint is None:
            return None
        kind, schema, thinking, parallel, budget = choice.constraint
        if self.ctx.compiler is None:
            raise APIError(400, f"structured output ({kind}) is not available on this server "
                                f"(it is refused with speculative decoding: --num-draft-tokens)")
        try:
            return await asyncio.to_thread(self.ctx.compiler.compile, kind, schema, thinking=thinking,
                                           max_thinking_tokens=budget, parallel_tool_calls=parallel)
        except ValueError as e:
            raise APIError(400, str(e), param="response_format" if kind in ("json", "regex") else "tools") from None

    async def _events(self, job: Job, streams: list):
        """(SSE event name | None, data) of every choice, as the engine produces them; the
        streams are cancelled when this generator is closed early (client gone)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for batch in stream:
                    await merged.put((i, batch))
                await merged.put((i, None))
            except EngineFailed as e:
                await merged.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        open_, started = set(range(len(streams))), set()
        try:
            while open_:
                i, item = await merged.get()
                if i not in open_:
                    continue
                translator, stream = job.choices[i].translator, streams[i]
                if i not in started:  # opened on its first event, which says what the prefix cache held
                    started.add(i)
                    for event in translator.start(item[0].cached_tokens or 0 if isinstance(item, list) else 0):
                        yield event
                if isinstance(item, EngineFailed):
                    raise item
                out = translator.push(item) if item is not None else []
                if item is None or translator.stopped:
                    if stream.finish_reason is None:  # a stop sequence: the engine need not go on
                        stream.cancel()
                    out += translator.finish(stream.finish_reason)
                    open_.discard(i)
                for event in out:
                    yield event
            if job.usage_chunk is not None:
                yield job.usage_chunk()
        finally:
            for t in tasks:
                t.cancel()
            for i in open_:
                streams[i].cancel()
                job.choices[i].translator.close()

    # ------------------------------------------------------------------ generation endpoints
    async def generate(self, request: Request, api: API) -> Response:
        status, streaming = 200, False
        try:
            if not self._authorized(request):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                               kind="authentication_error")
            body = await read_json(request, self.ctx.limits.max_body_bytes)
            job = prepare(api, body, self.ctx)
            try:
                streams = await self._submit(job)
            except QueueFull as e:
                raise APIError(429, f"the server is at capacity ({e}); retry later", headers={"Retry-After": "1"}
                               ) from None
            except Draining as e:
                raise APIError(503, f"{e}; retry on another replica", kind="server_error") from None
            except ValueError as e:  # the engine's own admission checks
                raise APIError(400, str(e)) from None
            if job.stream:
                streaming = True  # counted when the stream ends
                return EventSourceResponse(self._sse(job, streams, api), sep="\n", ping=15)
            response = await self._complete(request, job, streams, api)
            status = response.status_code
            return response
        except APIError as e:
            status = e.status
            return error_response(api.anthropic, e)
        except EngineFailed as e:
            status = 503
            return error_response(api.anthropic, APIError(503, f"the engine is down: {e}", kind="server_error"))
        except Exception:  # a bug of ours: one log record, a JSON 500 to the client
            status = 500
            log.exception("internal error on %s", api.path)
            return error_response(api.anthropic, APIError(500, "internal server error (see the server log)",
                                                          kind="server_error"))
        finally:
            if not streaming:
                self.metrics.requests.labels(api.name, str(status)).inc()

    async def _sse(self, job: Job, streams: list, api: API):
        status = "200"
        try:
            async for name, data in self._events(job, streams):
                yield {"event": name, "data": data} if name else {"data": data}
            if job.done_data is not None:
                yield {"data": job.done_data}
        except EngineFailed as e:
            status = "503"
            yield {"event": "error", "data": json.dumps(error_body(api.anthropic, APIError(503, str(e))))}
        except asyncio.CancelledError:
            status = "499"  # the client went away
            raise
        finally:
            self.metrics.requests.labels(api.name, status).inc()

    async def _complete(self, request: Request, job: Job, streams: list, api: API) -> Response:
        async def collect():
            async for _ in self._events(job, streams):
                pass

        task = asyncio.create_task(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return Response(status_code=499)
        task.result()  # raises what collecting raised
        body = job.response()
        return Response(body if isinstance(body, str) else json.dumps(body), media_type="application/json")

    # ------------------------------------------------------------------ the rest
    async def tokens(self, request: Request) -> Response:
        """/tokenize, /detokenize (POST) and /tokenizer_info (GET), as vLLM shapes them."""
        try:
            if not self._authorized(request):
                raise APIError(401, "invalid or missing API key", kind="authentication_error")
            path = request.url.path
            if path == "/tokenizer_info":
                return JSONResponse(tokenizer_info(self.ctx))
            body = await read_json(request, self.ctx.limits.max_body_bytes)
            return JSONResponse((tokenize if path == "/tokenize" else detokenize)(body, self.ctx))
        except APIError as e:
            return error_response(False, e)

    def _model_card(self, name: str) -> dict:
        """One served model in both APIs' shapes (OpenAI's object / owned_by, Anthropic's type /
        display_name / created_at)."""
        created = self.ctx.created
        return {"id": name, "object": "model", "type": "model", "created": created, "owned_by": "dsjax",
                "display_name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "max_model_len": self.ctx.capacity}

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error_response(False, APIError(401, "invalid or missing API key", kind="authentication_error"))
        data = [self._model_card(name) for name in self.ctx.names]
        return JSONResponse({"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"],
                             "last_id": data[-1]["id"]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (`client.models.retrieve`); the two APIs share the path, so an
        unknown id is answered in the shape of the client that asked (Anthropic's send
        anthropic-version)."""
        anthropic = "anthropic-version" in request.headers
        if not self._authorized(request):
            return error_response(anthropic, APIError(401, "invalid or missing API key", kind="authentication_error"))
        name = request.path_params["model_id"]
        if name not in self.ctx.names:
            return error_response(anthropic, APIError(404, f"model {name!r} is not served here; GET /v1/models lists "
                                                           f"{', '.join(self.ctx.names)}", kind="not_found_error",
                                                      param="model", code="model_not_found"))
        return JSONResponse(self._model_card(name))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's POST /v1/messages/count_tokens: the prompt's length, nothing generated."""
        try:
            if not self._authorized(request):
                raise APIError(401, "invalid or missing API key", kind="authentication_error")
            body = await read_json(request, self.ctx.limits.max_body_bytes)
            return JSONResponse({"input_tokens": count_tokens(body, self.ctx)})
        except APIError as e:
            return error_response(True, e)

    async def health(self, request: Request) -> Response:
        if self.loop.draining:  # a load balancer sends no more
            return JSONResponse({"status": "draining", "running": self.loop.running, "waiting": self.loop.waiting},
                                status_code=503)
        if self.loop.alive:
            return JSONResponse({"status": "ok", "running": self.loop.running, "waiting": self.loop.waiting})
        return JSONResponse({"status": "error", "error": str(self.loop.failure or "engine loop not running")},
                            status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(loop: EngineLoop, ctx: Context, metrics: Metrics, api_key: str | None = None) -> Starlette:
    server = Server(loop, ctx, metrics, api_key)

    def endpoint(api):
        async def handler(request: Request) -> Response:
            return await server.generate(request, api)
        return handler

    async def http_error(request: Request, exc: HTTPException) -> Response:
        anthropic = request.url.path.startswith(MESSAGES.path)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(anthropic, APIError(exc.status_code, message.get(exc.status_code, str(exc.detail))))

    routes = [Route(api.path, endpoint(api), methods=["POST"]) for api in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)]
    routes += [Route("/v1/models", server.models, methods=["GET"]), Route("/health", server.health, methods=["GET"]),
               Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
               Route(MESSAGES.path + "/count_tokens", server.count_tokens, methods=["POST"]),
               Route("/metrics", server.metrics_endpoint, methods=["GET"]),
               Route("/tokenize", server.tokens, methods=["POST"]),
               Route("/detokenize", server.tokens, methods=["POST"]),
               Route("/tokenizer_info", server.tokens, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app
