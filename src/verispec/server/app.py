"""The OpenAI-compatible HTTP server (FastAPI): routes, streaming, errors.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /v1/messages (Anthropic's Messages API: anthropic_messages.py)
    POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's Responses API: openai_responses.py)
    GET /health   GET /metrics (Prometheus text)   GET /stats (JSON)   GET /openapi.json
    GET / (a browser page: chat with live speculation stats, static/index.html)

A handler checks the key and the body (a JSON `Content-Type`, then protocol.py's
models), compiles the request's constraint (structured.py) and renders its prompt
(prompts.py), both off the event loop, turns it into one engine request per choice,
submits them all or none, and then either streams Server-Sent Events (`data: [DONE]`
at the end) or waits for the whole answer. When the client goes away the rows are
cancelled, which frees their memory at the engine's next step. /v1 routes need
`Authorization: Bearer <key>` when the server has one.

Handlers live at module level and read what they share from `request.app.state.verispec`
(a `ServerState`); a route is one `ROUTE_TABLE` entry, and the table is what /metrics'
route labels and /openapi.json's request bodies are derived from.

Checked by tests/test_server.py with the official `openai` client against a live server
on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from verispec.engine.engine import Engine
from verispec.engine.request import FINISH_ABORT, FINISH_ERROR, RequestRejected
from verispec.grammar.cache import DEFAULT_CACHE_BYTES
from verispec.models.tokenizer import TokenText
from verispec.server import metrics
from verispec.server.errors import (
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    BodyLimit,
    authorized,
    error_response,
    require_json,
)
from verispec.server.anthropic_messages import MessagesFormat, MessagesRequest, anthropic_error_body, parse_messages, to_chat
from verispec.server.openai_responses import ResponsesFormat, ResponsesRequest, ResponseStore, parse_responses, to_chat as responses_to_chat
from verispec.server.prompts import PromptBuilder
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, build_requests, parse
from verispec.server.responses import ChatFormat, Choice, CompletionFormat, WireFormat, now, usage
from verispec.server.streaming import EngineStream
from verispec.server.structured import StructuredOutput, constraint

log = logging.getLogger("verispec.server")

DISCONNECT_POLL_S = 0.25
DEFAULT_MAX_TOKENS = 2048  # what a request that sets no max_tokens may generate (README, "Serving")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    generation_defaults: dict = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names accepted in the request's `model`
    grammar_cache_bytes: int = DEFAULT_CACHE_BYTES  # structured output's compile cache
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (None means no key)")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")


@dataclass
class ServerState:
    """What every handler shares (app.state.verispec)."""

    engine: Engine
    config: ServerConfig
    structured: StructuredOutput
    prompts: PromptBuilder
    token_text: TokenText
    http_counts: Counter = field(default_factory=Counter)
    started: int = field(default_factory=now)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' past responses

    def default_max_tokens(self, prompt_len: int) -> int:
        """A request without max_tokens: the server's default bound, within what is left
        of the context and what the KV budget can hold."""
        return min(self.config.default_max_tokens, self.engine.max_new_tokens(prompt_len))


def state_of(request: Request) -> ServerState:
    return request.app.state.verispec


# -- helpers ----------------------------------------------------------------------------------


def require_key(request: Request) -> None:
    """The server's key as a bearer token, or as `x-api-key` (Anthropic's clients send that)."""
    key = state_of(request).config.api_key
    if not (authorized(request.headers.get("authorization"), key)
            or authorized(f"Bearer {request.headers.get('x-api-key', '')}", key)):
        raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")


def require_model(state: ServerState, name: str) -> None:
    if name not in (state.config.model_name, *state.config.aliases):
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {state.config.model_name!r}",
                       "model", "model_not_found")


async def read_body(request: Request, model: type[SamplingFields], parser=parse):
    """The key, the content type, the body (`parser(model, bytes)`) and its model, checked."""
    require_key(request)
    require_json(request.headers.get("content-type"))
    req = parser(model, await request.body())
    require_model(state_of(request), req.model)
    return req


def fmt_logprobs(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def generation_failed(state: ServerState, choice_or_out) -> ApiError:
    """A row that ended in error or abort: 503 while the server shuts down, else 500."""
    if not state.engine.alive:
        return ApiError(503, "the server is shutting down; retry on another instance")
    return ApiError(500, f"generation failed: {choice_or_out.error or choice_or_out.finish_reason}")


async def respond(request: Request, req: SamplingFields, fmt: WireFormat, prompts: list[list[int]], max_tokens,
                  grammar=None, prompt_param: str = "prompt"):
    state = state_of(request)
    requests = build_requests(req, prompts, max_tokens, fmt_logprobs(req), state.config.generation_defaults,
                              state.default_max_tokens, grammar, prompt_param)
    stream = EngineStream(state.engine, requests)
    try:
        stream.submit()
    except RequestRejected as e:
        if e.param == "prompt":  # the engine speaks of prompts; chat clients sent messages
            e.param = prompt_param
        raise
    prompt_tokens = fmt.prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        return StreamingResponse(stream_events(state, stream, fmt, len(requests), prompt_tokens),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        choices = await collect(request, stream, fmt, len(requests))
    finally:
        stream.close()
    failed = next((c for c in choices if c.finish_reason in (FINISH_ERROR, FINISH_ABORT)), None)
    if failed is not None:
        raise generation_failed(state, failed)
    return JSONResponse(fmt.final(choices, usage(prompt_tokens, choices)))


def add_delta(stream: EngineStream, fmt: WireFormat, choice: Choice, index: int, out) -> int:
    """Take one delta into its choice; return where its text starts. A tool answer that
    repeats a call is ended here: its row is cancelled, the repeat dropped."""
    offset = choice.add(out.text, out.tokens)
    if out.finished:
        choice.finish(out)
    elif fmt.repeats_a_call(choice):
        stream.cancel(index)
        choice.finish_early()
    return offset


async def collect(request: Request, stream: EngineStream, fmt: WireFormat, n: int) -> list[Choice]:
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
        add_delta(stream, fmt, choices[index], index, out)
    return choices


async def stream_events(state: ServerState, stream: EngineStream, fmt: WireFormat, n: int, prompt_tokens: int):
    """The SSE text of a streamed answer, in the API's own events (fmt)."""
    choices = [Choice() for _ in range(n)]
    try:
        for text in fmt.stream_start(n):
            yield text
        async for index, out in stream.events():
            if out.finish_reason in (FINISH_ERROR, FINISH_ABORT):
                e = generation_failed(state, out)
                for text in fmt.stream_error(e.status, str(e)):
                    yield text
                break
            choice = choices[index]
            offset = add_delta(stream, fmt, choice, index, out)
            if out.text or out.tokens:
                for text in fmt.stream_delta(index, out.text, out.tokens, offset):
                    yield text
            if choice.finish_reason is not None:
                for text in fmt.stream_finish(index, choice):
                    yield text
        else:
            for text in fmt.stream_end(usage(prompt_tokens, choices)):
                yield text
        for text in fmt.stream_tail():
            yield text
    finally:
        stream.close()  # client gone or done: cancel what still runs, free its memory


# -- routes -----------------------------------------------------------------------------------


async def answer_chat(request: Request, req: ChatCompletionRequest, make_format):
    """A chat request (from any API) answered in the format `make_format(tools)` gives."""
    state = state_of(request)
    wanted = constraint(req, req.tools, req.tool_choice, req.parallel_tool_calls, state.prompts.tool_syntax)
    grammar = await state.structured.compile_async(wanted) if wanted else None
    tools = wanted.tools if wanted else None
    prompt = await state.prompts.chat(req, with_tools=tools is not None, auto=tools is not None and tools.auto)
    fmt = make_format(wanted.tools if wanted else None)
    return await respond(request, req, fmt, [prompt], req.max_completion_tokens or req.max_tokens, grammar, "messages")


async def chat_completions(request: Request):
    state = state_of(request)
    req = await read_body(request, ChatCompletionRequest)
    return await answer_chat(request, req, lambda tools: ChatFormat(state.config.model_name, state.token_text,
                                                                    req.logprobs, tools, req.include_usage))


async def messages(request: Request):
    """Anthropic's Messages API, answered by the chat path (anthropic_messages.py)."""
    state = state_of(request)
    body = await read_body(request, MessagesRequest, lambda _model, raw: parse_messages(raw))
    return await answer_chat(request, to_chat(body), lambda tools: MessagesFormat(state.config.model_name, tools))


async def responses_create(request: Request):
    """OpenAI's Responses API, answered by the chat path (openai_responses.py)."""
    state = state_of(request)
    body = await read_body(request, ResponsesRequest, lambda _model, raw: parse_responses(raw))
    history: list[dict] = []
    if body.previous_response_id is not None:
        found = state.responses.get(body.previous_response_id)
        if found is None:
            raise ApiError(404, f"previous response {body.previous_response_id!r} is not stored here (never made, "
                           "made with store: false, deleted, or evicted from the bounded store)",
                           "previous_response_id", "previous_response_not_found")
        history = found[1]
    req, conversation = responses_to_chat(body, history)
    return await answer_chat(request, req, lambda tools: ResponsesFormat(state.config.model_name, tools, body,
                                                                        conversation, state.responses))


def _stored(request: Request) -> tuple[ServerState, str, dict]:
    require_key(request)
    state = state_of(request)
    response_id = request.path_params["response_id"]
    found = state.responses.get(response_id)
    if found is None:
        raise ApiError(404, f"response {response_id!r} is not stored here", "response_id", "response_not_found")
    return state, response_id, found[0]


async def responses_get(request: Request):
    return _stored(request)[2]


async def responses_delete(request: Request):
    state, response_id, _ = _stored(request)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def completions(request: Request):
    state = state_of(request)
    req = await read_body(request, CompletionRequest)
    wanted = constraint(req)
    grammar = await state.structured.compile_async(wanted) if wanted else None
    prompts = await state.prompts.completion(req)
    fmt = CompletionFormat(state.config.model_name, state.token_text, req.logprobs is not None,
                           include_usage=req.include_usage)
    return await respond(request, req, fmt, prompts, req.max_tokens, grammar, "prompt")


async def models(request: Request):
    require_key(request)
    state = state_of(request)
    return {"object": "list", "data": [{"id": state.config.model_name, "object": "model", "created": state.started,
                                        "owned_by": "verispec", "max_model_len": state.engine.max_model_len}]}


PAGE = Path(__file__).with_name("static") / "index.html"


async def page(request: Request):
    """The browser page (static/index.html): no key needed to load it; its API calls send
    the key the user types."""
    return HTMLResponse(PAGE.read_text(), headers={"Cache-Control": "no-cache"})


async def health(request: Request):
    if not state_of(request).engine.alive:
        return error_response(503, "the engine loop has stopped")
    return {"status": "ok"}


async def stats(request: Request):
    state = state_of(request)
    return {"model": state.config.model_name, **state.engine.stats(), "grammar_cache": state.structured.stats(),
            "responses_store": {"stored": len(state.responses), "bytes": state.responses.bytes,
                                "max_stored": state.responses.max_items, "max_bytes": state.responses.max_bytes}}


async def prometheus(request: Request):
    state = state_of(request)
    return PlainTextResponse(metrics.render(state.engine, state.http_counts, state.structured.stats()),
                             media_type=metrics.CONTENT_TYPE)


# path, method, handler, request body model (for /openapi.json), summary
ROUTE_TABLE = (
    ("/v1/chat/completions", "POST", chat_completions, ChatCompletionRequest, "Create a chat completion"),
    ("/v1/completions", "POST", completions, CompletionRequest, "Create a text completion"),
    ("/v1/messages", "POST", messages, MessagesRequest, "Create a message (Anthropic's Messages API)"),
    ("/v1/responses", "POST", responses_create, ResponsesRequest, "Create a response (OpenAI's Responses API)"),
    ("/v1/responses/{response_id}", "GET", responses_get, None, "A stored response"),
    ("/v1/responses/{response_id}", "DELETE", responses_delete, None, "Delete a stored response"),
    ("/v1/models", "GET", models, None, "List the served model"),
    ("/", "GET", page, None, "The browser page: a streaming chat with live speculation and server stats"),
    ("/health", "GET", health, None, "Liveness of the engine loop"),
    ("/stats", "GET", stats, None, "Engine, speculation and grammar-cache state as JSON"),
    ("/metrics", "GET", prometheus, None, "Prometheus metrics"),
)
ROUTES = tuple(path for path, *_ in ROUTE_TABLE) + ("/openapi.json",)


# -- the app ----------------------------------------------------------------------------------


def api_error_response(request: Request, status: int, message: str, param: str | None = None,
                       code: str | None = None) -> JSONResponse:
    """An error in the body shape of the route's API: Anthropic's on /v1/messages, else OpenAI's."""
    if request.url.path == "/v1/messages":
        # Anthropic's body has no `param`: the message names the field
        named = f"{param}: {message}" if param and not message.startswith(param) else message
        return JSONResponse(anthropic_error_body(status, named), status_code=status)
    return error_response(status, message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestRejected)
    async def _rejected(request, e: RequestRejected):
        return api_error_response(request, e.status, str(e), e.param)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return api_error_response(request, e.status, str(e), e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return api_error_response(request, e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return api_error_response(request, 400, str(e))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        log.exception("unhandled error")
        return api_error_response(request, 500, f"internal error: {type(e).__name__}")


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema, plus the request bodies our handlers parse themselves (they read
    the raw body to give OpenAI-style errors, so FastAPI cannot see their models)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible API of verispec")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, method, _handler, body, _summary in ROUTE_TABLE:
        if body is None:
            continue
        model = body.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        components.update(model.pop("$defs", {}))
        components[body.__name__] = model
        operation = schema["paths"][path][method.lower()]
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        operation.setdefault("responses", {})["400"] = {"description": "invalid request (OpenAI error body)"}
    app.openapi_schema = schema
    return schema


def create_app(engine: Engine, config: ServerConfig, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With `manage_engine` the app starts the engine's thread on startup
    and shuts it down on exit."""
    structured = StructuredOutput(engine.tokenizer, engine.vocab_size, engine.stop_ids, config.grammar_cache_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if manage_engine:
            engine.start()
        structured.warm()
        yield
        if manage_engine:
            engine.shutdown()

    from verispec import __version__

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    state = ServerState(engine, config, structured, PromptBuilder(engine.tokenizer, engine.max_model_len),
                        TokenText(engine.tokenizer))
    app.state.verispec = state
    install_error_handlers(app)
    for path, method, handler, _body, summary in ROUTE_TABLE:
        app.add_api_route(path, handler, methods=[method], summary=summary)
    app.openapi = lambda: openapi_schema(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, counts=state.http_counts)
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
            path = scope["path"]
            route = path if path in ROUTES else "/v1/responses/{response_id}" \
                if path.startswith("/v1/responses/") else "other"
            self.counts[(route, str(status))] += 1
