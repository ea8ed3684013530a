"""OpenAI response bodies: chat.completion(.chunk), text_completion, usage, logprobs.

Shapes follow OpenAI's API reference: chat logprobs are `{"content": [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}`; completion logprobs are the legacy
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. Streaming
chunks carry the same per-token entries for the tokens whose text they carry.
"""

from __future__ import annotations

import time
import uuid

from verispec.engine.request import TokenInfo
from verispec.models.tokenizer import TokenText
from verispec.server.errors import error_body
from verispec.server.streaming import DONE, sse


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, choices: list["Choice"]) -> dict:
    completion_tokens = sum(c.completion_tokens for c in choices)
    block = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    blocks = [c.speculation for c in choices if c.speculation]
    if blocks:
        block["speculation"] = merge_speculation(blocks)
    return block


def merge_speculation(blocks: list[dict]) -> dict:
    """One request's choices together: counts add up, tau is per round over all of them."""
    rounds = sum(b["rounds"] for b in blocks)
    emitted = sum(b["mean_accepted_length"] * b["rounds"] for b in blocks)
    merged = {
        "drafted": sum(b["drafted"] for b in blocks),
        "accepted": sum(b["accepted"] for b in blocks),
        "rounds": rounds,
        "mean_accepted_length": round(emitted / rounds, 3) if rounds else 0.0,
    }
    for key in ("forced_drafted", "forced_accepted"):
        if any(key in b for b in blocks):
            merged[key] = sum(b.get(key, 0) for b in blocks)
    if len(blocks) == 1 and "acceptance_by_position" in blocks[0]:  # (choices' ratios do not add up)
        merged["acceptance_by_position"] = blocks[0]["acceptance_by_position"]
    return merged


def chat_logprobs(token_text: TokenText, infos: list[TokenInfo]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            {**entry(info.token, info.logprob), "top_logprobs": [entry(t, lp) for t, lp in info.top]} for info in infos
        ]
    }


def completion_logprobs(token_text: TokenText, infos: list[TokenInfo], text_offset: int) -> dict:
    """Legacy logprobs; `text_offset` is where the first of these tokens starts in the
    choice's text."""
    tokens, offsets, offset = [], [], text_offset
    for info in infos:
        text = token_text(info.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [info.logprob for info in infos],
        "top_logprobs": [{token_text(t)[0]: lp for t, lp in info.top} for info in infos],
        "text_offset": offsets,
    }


def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's (abort and error never reach a client as a
    normal finish: the stream carries an error instead)."""
    return reason if reason in (None, "stop", "length") else "stop"


class Choice:
    """One choice's text and tokens as they accumulate."""

    def __init__(self):
        self.text: list[str] = []
        self.chars = 0
        self.tokens: list[TokenInfo] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.error: str | None = None
        self.speculation: dict | None = None
        self.stop_string: str | None = None

    def finish(self, out) -> None:
        self.finish_reason, self.completion_tokens = out.finish_reason, out.completion_tokens
        self.error, self.speculation, self.stop_string = out.error, out.speculation, out.stop_string

    def finish_early(self) -> None:
        """Ended by the server before the engine finished it (a repeated tool call)."""
        self.finish_reason, self.completion_tokens = "stop", len(self.tokens)

    def add(self, text: str, tokens: list[TokenInfo]) -> int:
        """Append; return the character offset where this text starts."""
        start = self.chars
        self.text.append(text)
        self.chars += len(text)
        self.tokens.extend(tokens)
        return start


class WireFormat:
    """What an API's bodies look like: the whole answer (`final`) and, when streaming, the
    Server-Sent Events text the handler yields as the rows progress (`stream_*`). The
    handlers in app.py drive every API through these methods; an API is one subclass
    (OpenAI chat and completions here, Anthropic's Messages in anthropic_messages.py,
    OpenAI's Responses in openai_responses.py)."""

    tools = None  # server/structured.py ToolMode: the constrained text becomes tool calls
    prompt_tokens = 0  # set by the handler before the stream starts

    def stream_start(self, n: int) -> list[str]:
        return []

    def stream_delta(self, index: int, text: str, tokens: list[TokenInfo], offset: int) -> list[str]:
        raise NotImplementedError

    def stream_finish(self, index: int, choice: Choice) -> list[str]:
        raise NotImplementedError

    def stream_end(self, usage_block: dict) -> list[str]:
        """After every choice finished."""
        return []

    def stream_error(self, status: int, message: str) -> list[str]:
        return [sse(error_body(status, message))]

    def stream_tail(self) -> list[str]:
        """The last text of every stream, also after an error."""
        return []

    def final(self, choices: list[Choice], usage_block: dict) -> dict:
        raise NotImplementedError

    def visible(self, index: int, text: str) -> str:
        """Of a streamed delta, what the client may see now as text: all of it without
        tools; nothing of a forced call; under tool_choice "auto", the text before the call
        syntax, holding back a tail that could still begin it."""
        if self.tools is None:
            return text
        if not self.tools.auto:
            return ""
        seen, sent = self.__dict__.setdefault("_seen", {}), self.__dict__.setdefault("_sent", {})
        seen[index] = whole = seen.get(index, "") + text
        content = self.tools.content(whole)
        safe = len(content) if len(content) < len(whole) else len(whole) - self.tools.syntax.held(whole)
        start = sent.get(index, 0)
        sent[index] = max(start, safe)
        return whole[start:safe]

    def unsent(self, index: int, choice: Choice) -> str:
        """At a finish under "auto": the text not yet streamed (a held-back tail that did
        not begin a call)."""
        if self.tools is None or not self.tools.auto:
            return ""
        return self.tools.content("".join(choice.text))[self.__dict__.get("_sent", {}).get(index, 0):]

    def content(self, choice: Choice) -> str | None:
        """A whole answer's text: all of it without tools, none of a forced call, the text
        before the calls under "auto" (None when empty and calls were made)."""
        text = "".join(choice.text)
        if self.tools is None:
            return text
        return (self.tools.content(text) or None) if self.tools.auto else None

    def repeats_a_call(self, choice: Choice) -> bool:
        """A tool answer that just repeated one of its calls: the caller ends it there."""
        return self.tools is not None and choice.finish_reason is None and self.tools.repeats("".join(choice.text))

    def tool_calls(self, choice: Choice) -> list[dict] | None:
        """The complete calls of a tool-constrained output, OpenAI-shaped (a call cut short
        by max_tokens is dropped, never sent as content)."""
        if self.tools is None or choice.finish_reason not in ("stop", "length"):
            return None
        return self.tools.calls("".join(choice.text)) or None


class ChatFormat(WireFormat):
    """chat.completion and chat.completion.chunk bodies."""

    object_final, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, token_text: TokenText, logprobs: bool, tools=None, include_usage: bool = False):
        self.model, self.token_text, self.logprobs = model, token_text, logprobs
        self.tools = tools
        self.include_usage = include_usage  # stream_options.include_usage: every chunk says "usage": null
        self.id, self.created = new_id(self.id_prefix), now()

    def frame(self, payload: dict) -> str:
        return sse({**payload, "usage": None} if self.include_usage else payload)

    def stream_start(self, n: int) -> list[str]:
        return [self.frame(p) for p in self.opening(n)]

    def stream_delta(self, index: int, text: str, tokens: list[TokenInfo], offset: int) -> list[str]:
        payload = self.delta(index, text, tokens, offset)
        return [] if payload is None else [self.frame(payload)]

    def stream_finish(self, index: int, choice: Choice) -> list[str]:
        return [self.frame(p) for p in self.finish_chunks(index, choice)]

    def stream_end(self, usage_block: dict) -> list[str]:
        return [sse(self.usage_chunk(usage_block))] if self.include_usage else []

    def stream_tail(self) -> list[str]:
        return [DONE]

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def opening(self, n: int) -> list[dict]:
        return [
            self._envelope(self.object_chunk, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}])
            for i in range(n)
        ]

    def _logprobs(self, tokens: list[TokenInfo], offset: int):
        return chat_logprobs(self.token_text, tokens) if self.logprobs else None

    def delta(self, index: int, text: str, tokens: list[TokenInfo], offset: int) -> dict | None:
        shown = self.visible(index, text)  # a call's JSON is sent whole, once complete (finish_chunks)
        if self.tools is not None and not shown:
            return None
        return self._envelope(self.object_chunk, [{"index": index, "delta": {"content": shown},
                                                   "logprobs": self._logprobs(tokens, offset) if self.tools is None
                                                   else None, "finish_reason": None}])

    def finish_chunks(self, index: int, choice: Choice) -> list[dict]:
        chunks = []
        rest = self.unsent(index, choice)
        if rest:
            chunks.append(self._envelope(self.object_chunk, [{"index": index, "delta": {"content": rest},
                                                              "logprobs": None, "finish_reason": None}]))
        calls = self.tool_calls(choice)
        if calls:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            chunks.append(self._envelope(self.object_chunk, [{"index": index, "delta": delta, "logprobs": None,
                                                              "finish_reason": None}]))
        chunks.append(self._envelope(self.object_chunk, [{"index": index, "delta": {}, "logprobs": None,
                                                          "finish_reason": self._reason(choice, calls)}]))
        return chunks

    def _reason(self, choice: Choice, calls) -> str | None:
        if choice.finish_reason == "length":
            return "length"
        return "tool_calls" if calls else finish_reason(choice.finish_reason)

    def usage_chunk(self, usage_block: dict) -> dict:
        return {**self._envelope(self.object_chunk, []), "usage": usage_block}

    def final_choice(self, index: int, choice: Choice) -> dict:
        calls = self.tool_calls(choice)
        message = {"role": "assistant", "content": self.content(choice)}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": self._logprobs(choice.tokens, 0),
                "finish_reason": self._reason(choice, calls)}

    def final(self, choices: list[Choice], usage_block: dict) -> dict:
        body = self._envelope(self.object_final, [self.final_choice(i, c) for i, c in enumerate(choices)])
        return {**body, "usage": usage_block, "system_fingerprint": None}


class CompletionFormat(ChatFormat):
    """text_completion bodies (the same object name for chunks, as OpenAI does)."""

    object_final = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def opening(self, n: int) -> list[dict]:
        return []

    def _logprobs(self, tokens: list[TokenInfo], offset: int):
        return completion_logprobs(self.token_text, tokens, offset) if self.logprobs else None

    def delta(self, index: int, text: str, tokens: list[TokenInfo], offset: int) -> dict:
        return self._envelope(self.object_chunk, [{"index": index, "text": text,
                                                   "logprobs": self._logprobs(tokens, offset), "finish_reason": None}])

    def finish_chunks(self, index: int, choice: Choice) -> list[dict]:
        return [self._envelope(self.object_chunk, [{"index": index, "text": "", "logprobs": None,
                                                    "finish_reason": finish_reason(choice.finish_reason)}])]

    def final_choice(self, index: int, choice: Choice) -> dict:
        return {"index": index, "text": "".join(choice.text), "logprobs": self._logprobs(choice.tokens, 0),
                "finish_reason": finish_reason(choice.finish_reason)}
