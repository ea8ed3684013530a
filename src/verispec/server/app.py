"""The OpenAI-compatible HTTP server (FastAPI): routes, prompts, streaming, errors.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health   GET /metrics (Prometheus text)   GET /stats (JSON)

A handler validates the body (protocol.py), renders the prompt (chat template once, no
second BOS), turns it into one engine request per choice, submits them all or none, and
then either streams Server-Sent Events (`data: [DONE]` at the end) or waits for the whole
answer. When the client goes away the rows are cancelled, which frees their memory at the
engine's next step. /v1 routes need `Authorization: Bearer <key>` when the server has one.

Checked by tests/test_server.py with the official `openai` client against a live server
on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from verispec.engine.engine import Engine
from verispec.engine.request import FINISH_ABORT, FINISH_ERROR, RequestRejected
from verispec.grammar.cache import DEFAULT_CACHE_BYTES
from verispec.models.tokenizer import TokenText, encode_chat, encode_prompt
from verispec.server import metrics
from verispec.server.errors import DEFAULT_MAX_BODY_BYTES, BodyLimit, authorized, error_body, error_response
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, build_requests, parse
from verispec.server.responses import ChatFormat, Choice, CompletionFormat, now, usage
from verispec.server.streaming import DONE, EngineStream, sse
from verispec.server.structured import StructuredOutput, constraint, tools_system_note

log = logging.getLogger("verispec.server")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/stats")
DISCONNECT_POLL_S = 0.25


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    generation_defaults: dict = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names accepted in the request's `model`
    grammar_cache_bytes: int = DEFAULT_CACHE_BYTES  # structured output's compile cache


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def create_app(engine: Engine, config: ServerConfig, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With `manage_engine` the app starts the engine's thread on startup
    and shuts it down on exit."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if manage_engine:
            engine.start()
        structured.warm()
        yield
        if manage_engine:
            engine.shutdown()

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None)
    http_counts: Counter = Counter()
    token_text = TokenText(engine.tokenizer)
    structured = StructuredOutput(engine.tokenizer, engine.vocab_size, engine.stop_ids, config.grammar_cache_bytes)
    started = now()

    # -- errors ---------------------------------------------------------------------

    @app.exception_handler(RequestRejected)
    async def _rejected(_request, e: RequestRejected):
        return error_response(e.status, str(e), e.param)

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return error_response(e.status, str(e), e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.exception_handler(Exception)
    async def _unexpected(_request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    # -- helpers --------------------------------------------------------------------

    def require_key(request: Request) -> None:
        if not authorized(request.headers.get("authorization"), config.api_key):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def require_model(name: str) -> None:
        if name not in (config.model_name, *config.aliases):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")

    async def respond(request: Request, req: SamplingFields, fmt: ChatFormat, prompts: list[list[int]], max_tokens,
                      grammar=None):
        logprobs = fmt_logprobs(req)
        requests = build_requests(req, prompts, max_tokens, logprobs, config.generation_defaults, engine.max_new_tokens,
                                  grammar)
        stream = EngineStream(engine, requests)
        stream.submit()
        prompt_tokens = sum(len(p) for p in prompts)
        if req.stream:
            return StreamingResponse(stream_events(stream, fmt, len(requests), prompt_tokens, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            choices = await collect(request, stream, len(requests))
        finally:
            stream.close()
        failed = next((c for c in choices if c.finish_reason in (FINISH_ERROR, FINISH_ABORT)), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error or failed.finish_reason}")
        return JSONResponse(fmt.final(choices, usage(prompt_tokens, choices)))

    async def collect(request: Request, stream: EngineStream, n: int) -> list[Choice]:
        choices = [Choice() for _ in range(n)]
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        while stream.open:
            # deltas may arrive faster than the poll interval: look at the clock, not at timeouts
            if time.monotonic() >= next_poll:
                if await request.is_disconnected():
                    raise ApiError(499, "client disconnected")
                next_poll = time.monotonic() + DISCONNECT_POLL_S
            try:
                index, out = await stream.next(DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            choice = choices[index]
            choice.add(out.text, out.tokens)
            if out.finished:
                choice.finish(out)
        return choices

    async def stream_events(stream: EngineStream, fmt: ChatFormat, n: int, prompt_tokens: int, include_usage: bool):
        choices = [Choice() for _ in range(n)]

        def chunk(payload: dict) -> str:
            return sse({**payload, "usage": None} if include_usage else payload)

        try:
            for payload in fmt.opening(n):
                yield chunk(payload)
            async for index, out in stream.events():
                if out.finish_reason in (FINISH_ERROR, FINISH_ABORT):
                    yield sse(error_body(500, f"generation failed: {out.error or out.finish_reason}"))
                    break
                choice = choices[index]
                if out.text or out.tokens:
                    offset = choice.add(out.text, out.tokens)
                    payload = fmt.delta(index, out.text, out.tokens, offset)
                    if payload is not None:
                        yield chunk(payload)
                if out.finished:
                    choice.finish(out)
                    for payload in fmt.finish_chunks(index, choice):
                        yield chunk(payload)
            else:
                if include_usage:
                    yield sse(fmt.usage_chunk(usage(prompt_tokens, choices)))
            yield DONE
        finally:
            stream.close()  # client gone or done: cancel what still runs, free its memory

    def fmt_logprobs(req: SamplingFields) -> int | None:
        if isinstance(req, ChatCompletionRequest):
            return (req.top_logprobs or 0) if req.logprobs else None
        return req.logprobs

    # -- routes ---------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        require_key(request)
        req = parse(ChatCompletionRequest, await request.body())
        require_model(req.model)
        wanted = constraint(req, req.tools, req.tool_choice, req.parallel_tool_calls)
        grammar = await structured.compile_async(wanted) if wanted else None
        prompt = chat_prompt(engine.tokenizer, req, with_tools=wanted is not None and wanted.tools is not None)
        fmt = ChatFormat(config.model_name, token_text, req.logprobs, wanted.tools if wanted else None)
        return await respond(request, req, fmt, [prompt], req.max_completion_tokens or req.max_tokens, grammar)

    @app.post("/v1/completions")
    async def completions(request: Request):
        require_key(request)
        req = parse(CompletionRequest, await request.body())
        require_model(req.model)
        wanted = constraint(req)
        grammar = await structured.compile_async(wanted) if wanted else None
        prompts = completion_prompts(engine.tokenizer, req)
        fmt = CompletionFormat(config.model_name, token_text, req.logprobs is not None)
        return await respond(request, req, fmt, prompts, req.max_tokens, grammar)

    @app.get("/v1/models")
    async def models(request: Request):
        require_key(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": started,
                                            "owned_by": "verispec", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "the engine loop has stopped")
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return {"model": config.model_name, **engine.stats(), "grammar_cache": structured.stats()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine, http_counts, structured.stats()), media_type=metrics.CONTENT_TYPE)

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, counts=http_counts)
    return app


class CountRequests:
    """ASGI middleware: HTTP requests by route and status, for /metrics."""

    def __init__(self, app, counts: Counter):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def tracking_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.counts[(route, str(status))] += 1


# -- prompts ------------------------------------------------------------------------------


def chat_prompt(tokenizer, req: ChatCompletionRequest, with_tools: bool = False) -> list[int]:
    """The chat template, rendered once with the generation prompt (it carries BOS).
    Tools go to templates that take them; other templates get them as a system note."""
    messages = [chat_message(m) for m in req.messages]
    tools = None
    if with_tools:
        if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
            tools = [t.model_dump() for t in req.tools]
        else:
            note = tools_system_note(req.tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
            else:
                messages.insert(0, {"role": "system", "content": note})
    try:
        return encode_chat(tokenizer, messages, tools)
    except Exception as e:  # noqa: BLE001 - a template's own complaint (e.g. role order) is the user's to fix
        raise RequestRejected(f"the chat template refused these messages: {e}", "messages") from None


def chat_message(m) -> dict:
    """A message as templates read it; earlier tool calls stay visible to templates that
    know nothing of them, as their JSON."""
    message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = m.tool_calls
        if not message["content"]:
            message["content"] = json.dumps([c.get("function", c) for c in m.tool_calls], ensure_ascii=False)
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def completion_prompts(tokenizer, req: CompletionRequest) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if not prompt:
        raise RequestRejected("prompt must not be an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [encode_prompt(tokenizer, p) for p in prompt]
    return [list(p) for p in prompt]
