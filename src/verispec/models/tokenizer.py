"""Tokenizer, chat template and stop ids of a model folder, through transformers'
AutoTokenizer (never remote code).

Chat prompts are rendered by the model's own template with add_generation_prompt and
then encoded *without* adding special tokens: templates already contain BOS, and
adding it again shifts every model off its training distribution.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from verispec.models.config import read_config


def load_tokenizer(folder: str | Path):
    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template; pass a plain prompt with --raw")
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A raw completion prompt: the tokenizer adds BOS itself if the model wants one."""
    return tokenizer.encode(text, add_special_tokens=True)


def encode_user_text(tokenizer, text: str) -> list[int]:
    """One user turn as a prompt: through the chat template where the model has one, else
    the text alone as a completion prompt (a base model such as gemma3-270m continues it)."""
    if has_chat_template(tokenizer):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return encode_prompt(tokenizer, text)


def stop_token_ids(folder: str | Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (union)."""
    folder = Path(folder)
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    gen = folder / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(read_config(folder).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    return sorted(ids)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the printable character each byte is
    spelled with inside a token -> the byte. Printable Latin-1 bytes stand for
    themselves; the other 68 are shifted to 256 + n, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


class TokenText:
    """Per-token text and exact bytes, as OpenAI's logprobs report them (cached by id).

    A token's own decode can be a broken character (byte-level BPE splits UTF-8
    sequences across tokens), so `bytes` is read from the token's spelling: byte-level
    BPE through GPT-2's alphabet, SentencePiece byte-fallback tokens (<0x0A>) directly,
    anything else from its decode."""

    _BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.alphabet = _byte_level_alphabet() if self.byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = self._cache[token_id] = (text, list(self._bytes(token_id, text)))
        return hit

    def _bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_level and piece and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        match = self._BYTE_TOKEN.fullmatch(piece or "")
        if match:
            return bytes([int(match.group(1), 16)])
        return text.encode("utf-8")


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


def generation_defaults(folder: str | Path, name: str | None = None) -> dict:
    """The sampling a model's authors recommend, used where a request (or `verispec
    generate`) leaves a field unset, as vLLM does: its generation_config.json when that
    says do_sample (transformers ignores the values otherwise), else what the catalog
    records for an embedded model (a GGUF has no generation config), else nothing."""
    path = Path(folder) / "generation_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if config.get("do_sample", False):
            return {k: config[k] for k in SAMPLING_DEFAULT_KEYS
                    if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    from verispec.models import registry

    entry = registry.REGISTRY.get(name or "")
    if entry is None:  # an embedded model named by its converted folder
        here = Path(folder).resolve()
        entry = next((s for n, s in registry.REGISTRY.items() if registry._model_folder(n).resolve() == here), None)
    return dict(entry.sampling) if entry is not None else {}
