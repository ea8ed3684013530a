"""The matrix's peers, run in the same session on the same model:

  llama.cpp          llama-cpp-python's OpenAI server on the model's GGUF: plain decoding,
                     and its JSON-schema grammar for the grammar cells (chat:
                     `response_format` {"type": "json_object", "schema"}; completions: the
                     schema converted to GBNF by llama-cpp-python itself)
  llama.cpp-lookup   the same server with its prompt-lookup (n-gram) speculation
                     (`--draft_model prompt-lookup-decoding`, 10 predicted tokens: its default)
  transformers       `generate` in this process on the same HF folder, bfloat16, one request
                     at a time (serial lane, grammar off, no speculation: the cells it has)

llama-cpp-python's server runs one request at a time, so its batch lanes measure a queue;
they run only with `--peer-batch` (matrix.peer_cell_skipped). Neither peer is a dependency: an absent one is reported as
skipped with the install line (llama.cpp's portable build flags are in bench/decode.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time

from verispec.bench.loadgen import LaneResult, RequestResult

LLAMACPP_ARMS = ("llama.cpp", "llama.cpp-lookup")
PEER_ARMS = (*LLAMACPP_ARMS, "transformers")


def llamacpp_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
        return "llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')"
    return None


def llamacpp_command(arm: str, gguf, port: int, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
           # queue concurrent requests instead of cutting the running stream off
           "--interrupt_requests", "False"]
    if arm == "llama.cpp-lookup":
        cmd += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "10"]
    return cmd


def describe(arm: str, gguf) -> str:
    """What a peer arm runs, for the report."""
    if arm == "transformers":
        import transformers

        return f"transformers {transformers.__version__} `generate`, bfloat16, greedy, one request at a time"
    import llama_cpp

    lookup = " with prompt-lookup drafting (10 tokens)" if arm == "llama.cpp-lookup" else ""
    return f"llama-cpp-python {llama_cpp.__version__} server on {gguf.name}{lookup}, one request at a time"


def llamacpp_body(body: dict) -> dict:
    """A verispec request body in the form llama-cpp-python's server takes a schema."""
    body = dict(body)
    fmt = body.pop("response_format", None)
    if fmt is None:
        return body
    schema = fmt["json_schema"]["schema"]
    if "messages" in body:
        body["response_format"] = {"type": "json_object", "schema": schema}
    else:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        body["grammar"] = json_schema_to_gbnf(json.dumps(schema))
    return body


def transformers_missing() -> str | None:
    return None if importlib.util.find_spec("transformers") else "transformers is not installed"


class _TimingStreamer:
    """generate()'s streamer: the first put is the prompt, every later one a new token."""

    def __init__(self, stop_ids):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.prompt_seen = False
        self.stop_ids = set(stop_ids)

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for token in value.reshape(-1).tolist():
            self.times.append(now)
            self.tokens.append(token)

    def end(self):
        pass


@functools.lru_cache(maxsize=1)
def _transformers_model(folder: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def run_transformers(folder, bodies: list[dict], threads: int) -> LaneResult:
    """One request after another through transformers' `generate`, greedy, bfloat16 (the
    model is loaded once per folder and kept for the next cell)."""
    import torch

    torch.set_num_threads(threads)
    tokenizer, model = _transformers_model(str(folder))
    stop_ids = [t for t in [tokenizer.eos_token_id, *([model.generation_config.eos_token_id]
                                                        if isinstance(model.generation_config.eos_token_id, int)
                                                        else model.generation_config.eos_token_id or [])]
                if t is not None]
    results = []
    t_all = time.perf_counter()
    for body in bodies:
        if "messages" in body:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
        else:
            ids = tokenizer(body["prompt"], return_tensors="pt")["input_ids"]
        streamer = _TimingStreamer(stop_ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                           do_sample=False, streamer=streamer, pad_token_id=stop_ids[0] if stop_ids else None)
        tokens = [t for t in streamer.tokens if t not in streamer.stop_ids]
        n = len(tokens)
        if n == 0:
            continue
        first, last = streamer.times[0], streamer.times[n - 1]
        results.append(RequestResult(first - t0, last - first, n, tokenizer.decode(tokens, skip_special_tokens=True),
                                     "stop" if n < body["max_tokens"] else "length"))
    return LaneResult(results, time.perf_counter() - t_all)
