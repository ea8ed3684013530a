"""Request text -> prompt token ids, off the event loop and bounded before tokenizing.

Chat prompts are the model's chat template rendered once with the generation prompt
(it carries BOS; encoding adds no second one); tools go to templates that take them,
other templates get them as a system note. Completion prompts are a string, a list of
strings, token ids or lists of token ids.

Tokenizing is the one piece of request handling whose cost grows with what a client
sends: a 5 MB prompt took 3-5 s, on the event loop, which froze /health and every
stream until its 400. So:

* a prompt too long to fit is refused by its size before it is tokenized: no token of
  this tokenizer spells more than `longest_token` characters (read off its vocabulary),
  so a text of more than `longest_token x context` characters cannot fit, whatever it
  says;
* everything else is rendered and tokenized on a worker thread (`asyncio.to_thread`;
  the Rust tokenizer releases the GIL: the event loop ticked every <= 15 ms while a
  663k-character prompt was encoded beside it).

Checked by tests/test_server.py (a prompt over the size bound is a 400 naming `messages`
/ `prompt` while /health answers; a prompt under it and over the context gets the same
400 after tokenizing) and tests/test_structured_server.py (tools in the prompt).
"""

from __future__ import annotations

import asyncio
import json

from verispec.engine.request import RequestRejected
from verispec.models.tokenizer import encode_chat, encode_prompt
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest
from verispec.server.structured import tools_system_note
from verispec.server.tool_syntax import ToolSyntax, syntax_of


class PromptBuilder:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        vocab = tokenizer.get_vocab()
        # spelled tokens (byte-level BPE's alphabet, SentencePiece's pieces) are never
        # shorter than the text they decode to: an upper bound on characters per token
        self.longest_token = max(1, max((len(piece) for piece in vocab), default=1))
        self.max_chars = self.longest_token * max_model_len
        self.tool_syntax = syntax_of(getattr(tokenizer, "chat_template", None))  # tool_choice "auto"'s

    def _check_size(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise RequestRejected(
                f"the prompt is {chars:,} characters, more than this model's context of {self.max_model_len:,} tokens "
                f"can hold (no token spells more than {self.longest_token} characters); shorten it", param)

    async def chat(self, req: ChatCompletionRequest, with_tools: bool = False, auto: bool = False) -> list[int]:
        self._check_size(sum(len(m.text()) for m in req.messages) + sum(len(json.dumps(m.tool_calls)) for m in req.messages
                                                                        if m.tool_calls), "messages")
        return await asyncio.to_thread(chat_prompt, self.tokenizer, req, with_tools,
                                       self.tool_syntax if auto else None)

    async def completion(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        for text in texts:
            self._check_size(len(text), "prompt")
        return await asyncio.to_thread(completion_prompts, self.tokenizer, req)


def chat_prompt(tokenizer, req: ChatCompletionRequest, with_tools: bool = False,
                syntax: ToolSyntax | None = None) -> list[int]:
    """The chat template, rendered once with the generation prompt (it carries BOS).
    Tools go to templates that take them; other templates get them as a system note
    (under tool_choice "auto", `syntax`: with how to call, and earlier calls written in
    that syntax)."""
    own_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
    messages = [chat_message(m, None if own_tools else syntax) for m in req.messages]
    tools = None
    if with_tools:
        if own_tools:
            tools = [t.model_dump() for t in req.tools]
        else:
            note = tools_system_note(req.tools, syntax)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
            else:
                messages.insert(0, {"role": "system", "content": note})
    try:
        return encode_chat(tokenizer, messages, tools)
    except Exception as e:  # noqa: BLE001 - a template's own complaint (e.g. role order) is the user's to fix
        raise RequestRejected(f"the chat template refused these messages: {e}", "messages") from None


def chat_message(m, syntax: ToolSyntax | None = None) -> dict:
    """A message as templates read it; earlier tool calls stay visible to templates that
    know nothing of them, as their JSON (under "auto", in the call syntax the note taught)."""
    message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = m.tool_calls
        if not message["content"] and syntax is not None:
            message["content"] = syntax.render([c.get("function", c) for c in m.tool_calls])
        elif not message["content"]:
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
