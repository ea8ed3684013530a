"""Tokenizer, chat template and stop ids of a model folder, through transformers'
AutoTokenizer (never remote code).

Chat prompts are rendered by the model's own template with add_generation_prompt and
then encoded *without* adding special tokens: templates already contain BOS, and
adding it again shifts every model off its training distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from verispec.models.loader import read_config


def load_tokenizer(folder: str | Path):
    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template; pass a plain prompt with --raw")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A raw completion prompt: the tokenizer adds BOS itself if the model wants one."""
    return tokenizer.encode(text, add_special_tokens=True)


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
