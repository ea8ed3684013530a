"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) on top of
the chat path.

A Responses body is validated here (strict JSON types, a 400 naming the field),
translated into the equivalent `ChatCompletionRequest` (prompts, grammars, tools and
speculation are the chat route's, written once) and answered in the Responses shapes by
`ResponsesFormat`:

* request: `model`, `input` (a string, or items: messages with `input_text` /
  `output_text` parts, `function_call` and `function_call_output`), `instructions`,
  `max_output_tokens`, `temperature`, `top_p`, `stream`, `tools` (function tools),
  `tool_choice` (`none`, `required`, `{"type": "function", "name"}`), `parallel_tool_calls`,
  `text.format` (`text`, `json_object`, `json_schema`), `previous_response_id`, `store`,
  `metadata`, `user`; verispec's `speculation` flag. Refused with a 400 by name: images and
  files, non-function tools, `background`, `conversation`, `prompt`, `reasoning`,
  `top_logprobs`, `include`.
* `previous_response_id` continues a stored response: its conversation (input and output,
  not its `instructions`, as OpenAI does) comes before the new input. Responses are
  stored (unless `store: false`) in a bounded LRU store, `ResponseStore`: at most
  MAX_STORED responses and MAX_STORED_BYTES of their JSON; an evicted or unknown id is a
  404 naming `previous_response_id`.
* response: `{"id": "resp_...", "object": "response", "status": completed | incomplete,
  "output": [message or function_call items], "usage": {input_tokens, output_tokens,
  total_tokens, details, speculation}, ...}`.
* streaming: `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta` / `.done`,
  `response.content_part.done`, `response.function_call_arguments.delta` / `.done`,
  `response.output_item.done`, then `response.completed` (or `response.incomplete`), each
  with its `sequence_number`; an engine failure mid-stream is `response.failed`.

Checked by tests/test_api_responses.py with the official `openai` client's `responses`
methods against a live server: text equal to the chat route's answer, streaming events
adding up to the whole response, a previous_response_id chain equal to the same
conversation sent whole, json_schema and function-call outputs validating, the store's
bound, errors.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from verispec.engine.request import RequestRejected
from verispec.server.protocol import FUNCTION_NAME, ChatCompletionRequest, StrictBody, parse_body
from verispec.server.responses import Choice, WireFormat, new_id
from verispec.server.streaming import sse_event

MAX_STORED = 1024  # responses kept for previous_response_id and GET
MAX_STORED_BYTES = 64 * 2**20


class TextPart(StrictBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


class UnsupportedPart(StrictBody):
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Part = Annotated[TextPart | UnsupportedPart, Field(discriminator="type")]


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)] | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ResponsesRequest(StrictBody):
    model: str
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    speculation: bool = True  # verispec: false decodes without a draft source
    # refused by name when set
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    include: Any = None


REFUSED = ("background", "conversation", "prompt", "reasoning", "top_logprobs", "include")


def parse_responses(body: bytes) -> ResponsesRequest:
    req = parse_body(ResponsesRequest, body)
    for name in REFUSED:
        if getattr(req, name) not in (None, False, [], {}, 0):
            raise RequestRejected(f"{name} is not supported by this server", name)
    for i, item in enumerate(req.input if isinstance(req.input, list) else []):
        if isinstance(item, MessageItem) and isinstance(item.content, list):
            for j, part in enumerate(item.content):
                if isinstance(part, UnsupportedPart):
                    raise RequestRejected(f"{part.type} content is not supported by this server (text is)",
                                          f"input[{i}].content[{j}].type")
    return req


class ResponseStore:
    """Past responses by id, for previous_response_id and GET: bounded in count and in
    bytes of their JSON, least recently used evicted first; thread-safe."""

    def __init__(self, max_items: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, body: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return
        with self._lock:
            self._drop(body["id"])
            self._items[body["id"]] = (body, conversation, size)
            self.bytes += size
            while len(self._items) > self.max_items or self.bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return found[0], found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is not None:
            self.bytes -= found[2]
        return found is not None

    def __len__(self) -> int:
        return len(self._items)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input as OpenAI chat messages (consecutive function calls become one
    assistant message with tool_calls; their outputs, tool messages)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request that asks the same thing, and the conversation without the
    instructions (what a later previous_response_id continues)."""
    conversation = history + input_messages(req)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict = {"model": req.model, "messages": messages, "stream": req.stream, "speculation": req.speculation}
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters, "strict": t.strict}}
                         for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.name is None or fmt.schema_ is None:
            raise RequestRejected("text.format of type json_schema needs name and schema", "text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                          "strict": bool(fmt.strict)}}
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValidationError as e:  # a translated field out of the chat route's bounds
        raise RequestRejected(f"the request cannot be served: {e.errors(include_url=False)[0]['msg']}", None) from None


class ResponsesFormat(WireFormat):
    """Response objects and their stream events (one choice: the API has no `n`). The
    finished response goes to `store(body, conversation)` unless the request said
    store: false."""

    def __init__(self, model: str, tools, req: ResponsesRequest, conversation: list[dict], store: ResponseStore):
        self.model, self.tools, self.req, self.conversation, self.store = model, tools, req, conversation, store
        self.id = new_id("resp").replace("-", "_")
        self.created = int(time.time())
        self.message_id = new_id("msg").replace("-", "_")
        self.sequence = 0
        self.text_open = False
        self.choice: Choice | None = None

    # -- bodies --

    def _envelope(self, status: str, output: list[dict], usage_block: dict | None, incomplete: bool = False) -> dict:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
            "truncation": req.truncation or "disabled", "store": req.store, "metadata": req.metadata or {},
            "user": req.user, "usage": usage_block,
        }

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _calls(self, choice: Choice) -> list[dict]:
        return [{"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                 "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                for c in self.tool_calls(choice) or []]

    def _output(self, choice: Choice) -> list[dict]:
        text = self.content(choice)
        return ([self._message(text or "", "completed")] if self.tools is None or text else []) + self._calls(choice)

    def _usage(self, usage_block: dict) -> dict:
        out = {"input_tokens": usage_block["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
               "output_tokens": usage_block["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": usage_block["total_tokens"]}
        if "speculation" in usage_block:
            out["speculation"] = usage_block["speculation"]
        return out

    def final(self, choices: list[Choice], usage_block: dict) -> dict:
        choice = choices[0]
        incomplete = choice.finish_reason == "length"
        body = self._envelope("incomplete" if incomplete else "completed", self._output(choice),
                              self._usage(usage_block), incomplete)
        if self.req.store:
            self.store.put(body, self.conversation + self._turn(body["output"]))
        return body

    @staticmethod
    def _turn(output: list[dict]) -> list[dict]:
        """This response's output as chat messages (what a continuation reads)."""
        calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in output if o["type"] == "function_call"]
        if calls:
            return [{"role": "assistant", "content": None, "tool_calls": calls}]
        return [{"role": "assistant", "content": "".join(p["text"] for o in output for p in o["content"])}]

    # -- events --

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse_event(event)

    def stream_start(self, n: int) -> list[str]:
        snapshot = self._envelope("in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _open_text(self) -> list[str]:
        self.text_open = True
        return [self._event("response.output_item.added", output_index=0, item={**self._message("", "in_progress"),
                                                                                "content": []}),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _text_events(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.text_open else self._open_text()
        return out + [self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                  content_index=0, delta=text, logprobs=[])]

    def stream_delta(self, index: int, text: str, tokens, offset: int) -> list[str]:
        return self._text_events(self.visible(index, text))  # calls are sent whole, once complete

    def stream_finish(self, index: int, choice: Choice) -> list[str]:
        self.choice = choice
        text = self.content(choice) or ""
        out = self._text_events(self.unsent(index, choice))
        if self.tools is None or text:
            out += self._message_done(text)
        first = 1 if self.tools is None or text else 0
        for i, item in enumerate(self._calls(choice), first):
            out += [self._event("response.output_item.added", output_index=i,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=i, item=item)]
        return out

    def _message_done(self, text: str) -> list[str]:
        out = [] if self.text_open else self._open_text()
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return out + [self._event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                                  text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                  content_index=0, part=part),
                      self._event("response.output_item.done", output_index=0, item=self._message(text, "completed"))]

    def stream_end(self, usage_block: dict) -> list[str]:
        body = self.final([self.choice], usage_block)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=body)]

    def stream_error(self, status: int, message: str) -> list[str]:
        body = {**self._envelope("failed", [], None), "error": {"code": "server_error", "message": message}}
        return [self._event("response.failed", response=body)]
