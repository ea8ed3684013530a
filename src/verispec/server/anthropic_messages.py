"""Anthropic's Messages API (POST /v1/messages) on top of the chat path.

A Messages body is validated here (strict JSON types, a 400 naming the field, as for the
OpenAI routes), translated into the equivalent `ChatCompletionRequest` (so prompts,
grammars, tools and speculation are the chat route's, written once) and answered in
Anthropic's shapes by `MessagesFormat`:

* request: `model`, `max_tokens` (required, as Anthropic requires it), `messages` whose
  `content` is a string or blocks (`text`, `tool_use`, `tool_result`), `system` (string or
  text blocks), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `tools`
  (`name`, `description`, `input_schema`), `tool_choice` (`auto`, `any`, `tool`, `none`,
  `disable_parallel_tool_use`), `output_config.format` (`json_schema`: the text is
  constrained to the schema), `metadata` (accepted, unused); verispec's `speculation`
  flag as on the OpenAI routes. Refused with a 400 by name: image and document blocks,
  `thinking`, `container`, `mcp_servers`; server tools (a tool with a `type` other than
  `custom`).
* response: `{"id": "msg_...", "type": "message", "role": "assistant", "content": [text
  and tool_use blocks], "stop_reason": end_turn | max_tokens | stop_sequence | tool_use,
  "stop_sequence", "usage": {"input_tokens", "output_tokens", "speculation"}}`.
* streaming: `message_start`, `content_block_start` / `content_block_delta` (`text_delta`,
  `input_json_delta`) / `content_block_stop`, `message_delta` (stop reason, usage),
  `message_stop`, each as `event: <type>` + `data:`; an engine failure mid-stream is an
  `error` event.
* errors: `{"type": "error", "error": {"type", "message"}}` (app.py picks this body for
  the route); the key may come as `x-api-key` (Anthropic's header) or a bearer token.

Checked by tests/test_api_messages.py with the official `anthropic` client against a live
server: text and streamed text equal the chat route's answer to the same conversation,
tool_use inputs validate against their input_schema, stop sequences, usage, errors.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from verispec.engine.request import RequestRejected
from verispec.server.protocol import FUNCTION_NAME, MAX_STOP_STRINGS, ChatCompletionRequest, StrictBody, parse_body
from verispec.server.responses import Choice, WireFormat, new_id
from verispec.server.streaming import sse_event

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                         429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error",
                         503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class UnsupportedBlock(StrictBody):
    type: Literal["image", "document", "thinking", "redacted_thinking", "search_result", "server_tool_use",
                  "web_search_tool_result", "container_upload"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")]


class Message(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(StrictBody):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    input_schema: dict
    type: str | None = None  # "custom" (or absent); server tools are refused


class ToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(StrictBody):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": ...}}; "effort" is ignored
    speculation: bool = True  # verispec: false decodes without a draft source
    # refused by name when set
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None


def parse_messages(body: bytes) -> MessagesRequest:
    req = parse_body(MessagesRequest, body)
    for name in ("thinking", "container", "mcp_servers"):
        value = getattr(req, name)
        if value not in (None, [], {}) and not (name == "thinking" and isinstance(value, dict)
                                                  and value.get("type") == "disabled"):
            raise RequestRejected(f"{name} is not supported by this server", name)
    for i, m in enumerate(req.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(block, UnsupportedBlock):
                raise RequestRejected(f"{block.type} content blocks are not supported by this server (text, "
                                      "tool_use and tool_result are)", f"messages[{i}].content[{j}].type")
            if isinstance(block, ToolUseBlock) and m.role != "assistant":
                raise RequestRejected("tool_use blocks belong to assistant messages", f"messages[{i}].content[{j}]")
            if isinstance(block, ToolResultBlock) and m.role != "user":
                raise RequestRejected("tool_result blocks belong to user messages", f"messages[{i}].content[{j}]")
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise RequestRejected(f"server tools ({tool.type}) are not supported by this server; define the "
                                  "function with name, description and input_schema", f"tools[{i}].type")
    fmt = (req.output_config or {}).get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                                and isinstance(fmt.get("schema"), dict)):
        raise RequestRejected('output_config.format must be {"type": "json_schema", "schema": {...}}',
                              "output_config.format")
    if req.tool_choice is not None and req.tool_choice.type == "tool" and not req.tool_choice.name:
        raise RequestRejected("tool_choice of type tool needs the tool's name", "tool_choice.name")
    return req


def chat_messages(req: MessagesRequest) -> list[dict]:
    """Anthropic's conversation as OpenAI chat messages: system first; a user message's
    tool_result blocks become tool messages (before its text, in block order); an
    assistant's tool_use blocks become its tool_calls."""
    out = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        if m.role == "user":
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    for b in m.content if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": "user", "content": text})
        else:
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    return out


TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that asks the same thing."""
    body: dict = {"model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens,
                  "stream": req.stream, "speculation": req.speculation}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                                          "strict": True}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema}} for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = TOOL_CHOICES.get(choice.type) or {"type": "function",
                                                                   "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    elif req.tool_choice is not None and req.tool_choice.type != "none":
        raise RequestRejected("tool_choice needs tools", "tool_choice")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a translated field out of the chat route's bounds
        raise RequestRejected(f"the request cannot be served: {e.errors(include_url=False)[0]['msg']}", None) from None


class MessagesFormat(WireFormat):
    """Anthropic message bodies and stream events (one choice: the API has no `n`)."""

    def __init__(self, model: str, tools=None):
        self.model, self.tools = model, tools
        self.id = new_id("msg").replace("-", "_")
        self.text_open = False
        self.blocks = 0  # content blocks started so far

    def _usage(self, output_tokens: int, speculation: dict | None) -> dict:
        block = {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}
        if speculation:
            block["speculation"] = speculation
        return block

    def _stop(self, choice: Choice, calls) -> tuple[str, str | None]:
        if choice.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if choice.stop_string is not None:
            return "stop_sequence", choice.stop_string
        return "end_turn", None

    def _tool_blocks(self, calls) -> list[dict]:
        return [{"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in calls or []]

    def stream_start(self, n: int) -> list[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self._usage(0, None)}
        return [sse_event({"type": "message_start", "message": message})]

    def _text_events(self, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if not self.text_open:
            self.text_open = True
            out.append(sse_event({"type": "content_block_start", "index": self.blocks,
                             "content_block": {"type": "text", "text": ""}}))
        out.append(sse_event({"type": "content_block_delta", "index": self.blocks,
                         "delta": {"type": "text_delta", "text": text}}))
        return out

    def stream_delta(self, index: int, text: str, tokens, offset: int) -> list[str]:
        return self._text_events(self.visible(index, text))  # calls are sent whole, once complete

    def stream_finish(self, index: int, choice: Choice) -> list[str]:
        out = self._text_events(self.unsent(index, choice))
        if self.text_open:
            out.append(sse_event({"type": "content_block_stop", "index": self.blocks}))
            self.blocks += 1
            self.text_open = False
        calls = self.tool_calls(choice)
        for block in self._tool_blocks(calls):
            out.append(sse_event({"type": "content_block_start", "index": self.blocks,
                             "content_block": {**block, "input": {}}}))
            out.append(sse_event({"type": "content_block_delta", "index": self.blocks,
                             "delta": {"type": "input_json_delta",
                                       "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            out.append(sse_event({"type": "content_block_stop", "index": self.blocks}))
            self.blocks += 1
        reason, sequence = self._stop(choice, calls)
        out.append(sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": self._usage(choice.completion_tokens, choice.speculation)}))
        return out

    def stream_end(self, usage_block: dict) -> list[str]:
        return [sse_event({"type": "message_stop"})]

    def stream_error(self, status: int, message: str) -> list[str]:
        return [sse_event(anthropic_error_body(status, message))]

    def final(self, choices: list[Choice], usage_block: dict) -> dict:
        choice = choices[0]
        calls = self.tool_calls(choice)
        text = self.content(choice)
        content = ([{"type": "text", "text": text}] if text else []) + self._tool_blocks(calls)
        reason, sequence = self._stop(choice, calls)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(choice.completion_tokens, choice.speculation)}
