"""OpenAI request bodies as pydantic models, and their translation into engine requests.

Validation is strict (JSON types as OpenAI documents them: "1" is not a number, true is
not an integer) and every failure becomes a 400 whose `param` names the field, e.g.
`messages[1].role`. Unknown fields are ignored, as OpenAI-compatible servers do, except
documented OpenAI features this server does not implement (legacy functions, audio,
predictions, echo, suffix, best_of): those are refused by name rather than silently
dropped. Structured output fields (response_format, guided_*, tools) are parsed here and
turned into a grammar by server/structured.py.

The fields shared by /v1/chat/completions and /v1/completions live in one base model and
are turned into SamplingParams / GenerationRequest by one function, so request shaping
is written once (`build_requests`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verispec.engine.request import GenerationRequest, RequestRejected
from verispec.engine.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request: each is a row of its own in the batch
MAX_CHOICES = 1024  # guided_choice entries
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512


class StrictBody(BaseModel):
    """A request body (or part of one): JSON types as documented, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictBody):
    include_usage: bool = False


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (multi-turn tool use)
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# -- structured output (response_format, vLLM's guided_*, tools) ------------------------------


class JsonSchemaFormat(StrictBody):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(StrictBody):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class GuidedFields(StrictBody):
    """The structured-output fields both endpoints accept (server/structured.py turns
    them into a grammar)."""

    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None


Probability = Annotated[float, Field(ge=0, le=1)]


class SamplingFields(GuidedFields):
    """Fields both endpoints accept (OpenAI's, plus vLLM's common extensions)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # extensions (vLLM, llama.cpp): -1 or 0 turns top_k off
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    # verispec: false decodes this request without a draft source (same output; for A/B
    # runs, or text a drafter only slows down). Grammar-forced tokens are still verified.
    speculation: bool = True

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, s in enumerate(stops):
            if not s:
                raise RequestRejected("stop strings must not be empty", "stop" if isinstance(self.stop, str) else f"stop[{i}]")
            if len(s) > MAX_STOP_CHARS:
                raise RequestRejected(f"stop strings are limited to {MAX_STOP_CHARS} characters", "stop")
        return tuple(stops)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # refused by name below when set: OpenAI features this server does not have
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


_UNSUPPORTED_CHAT = ("functions", "audio", "prediction")


def check_unsupported(req: SamplingFields) -> None:
    if isinstance(req, ChatCompletionRequest):
        for name in _UNSUPPORTED_CHAT:
            if getattr(req, name) not in (None, []):
                raise RequestRejected(f"{name} is not supported by this server", name)
        if req.function_call not in (None, "none"):
            raise RequestRejected("function_call is not supported by this server (use tools and tool_choice)",
                                  "function_call")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestRejected("top_logprobs requires logprobs to be true", "top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise RequestRejected("echo is not supported by this server", "echo")
        if req.suffix:
            raise RequestRejected("suffix is not supported by this server", "suffix")
        if req.best_of not in (None, req.n):
            raise RequestRejected("best_of is not supported by this server (it must equal n)", "best_of")


def parse_body(model: type[BaseModel], body: bytes):
    """Validate a JSON body against any request model; RequestRejected (400, naming the
    field) on any mistake."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _rejection(e) from None


def parse(model: type[SamplingFields], body: bytes) -> SamplingFields:
    """An OpenAI body, with the features this server does not have refused by name."""
    req = parse_body(model, body)
    check_unsupported(req)
    return req


# pydantic puts a union member's type into an error's location ("stop", "list[str]", 0):
# such labels are not field names and are left out of `param`
def _is_field_part(part) -> bool:
    return isinstance(part, int) or (
        part not in {"str", "int", "float", "bool", "none", "list", "dict"} and "[" not in part and not part[:1].isupper()
    )


def _rejection(error: ValidationError) -> RequestRejected:
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return RequestRejected(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None)
    path = [p for p in first["loc"] if _is_field_part(p)]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path)) or None
    same = [e for e in errors if [p for p in e["loc"] if _is_field_part(p)] == path]
    messages = list(dict.fromkeys(e["msg"] for e in same))
    # a union's alternatives: "Input should be a valid string or a valid array"
    messages = messages[:1] + [m.removeprefix("Input should be ") for m in messages[1:]]
    if first["type"] == "missing":
        return RequestRejected(f"{param} is required", param)
    if first["type"] == "model_type" and not path:
        return RequestRejected("the request body must be a JSON object", None)
    return RequestRejected(f"{param}: {' or '.join(messages)}" if param else "; ".join(messages), param)


# -- engine requests --------------------------------------------------------------------


def sampling_params(req: SamplingFields, logprobs: int | None, defaults: dict, seed: int | None) -> SamplingParams:
    """OpenAI fields -> SamplingParams. Unset fields take the model's generation_config
    defaults (temperature, top_p, top_k, repetition_penalty, as vLLM does), else OpenAI's."""

    def pick(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    top_k = pick("top_k", 0)
    try:
        return SamplingParams(
            temperature=float(pick("temperature", 1.0)),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            top_p=float(pick("top_p", 1.0)),
            min_p=float(pick("min_p", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            logit_bias=req.logit_bias,
            seed=seed,
            logprobs=logprobs,
        )
    except ValueError as e:  # SamplingParams names the field first
        raise RequestRejected(str(e), str(e).split(" ", 1)[0]) from None


def build_requests(
    req: SamplingFields, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, defaults: dict,
    max_new_tokens, grammar=None, prompt_param: str = "prompt",
) -> list[GenerationRequest]:
    """One engine request per (prompt, choice), in OpenAI's choice order (prompt-major).
    `max_new_tokens(prompt_len)` gives the default when the client set no limit (a too
    long prompt is reported against `prompt_param`: messages or prompt); every
    choice of a constrained request shares the compiled `grammar` (each row gets its own
    matcher)."""
    stops = req.stop_strings()
    out = []
    for prompt in prompts:
        limit = max_tokens if max_tokens is not None else max_new_tokens(len(prompt))
        if limit < 1:
            raise RequestRejected(
                f"the prompt ({len(prompt)} tokens) leaves no room for a completion in this model's context", prompt_param
            )
        for choice in range(req.n):
            # choices of one seeded request differ from each other but are reproducible
            seed = None if req.seed is None else req.seed + choice
            params = sampling_params(req, logprobs, defaults, seed)
            out.append(GenerationRequest(list(prompt), limit, params, stops, req.ignore_eos, grammar,
                                         speculation=req.speculation))
    return out
