"""Drafter training data: every user turn as a prompt, decontamination against the benchmark
prompts (oracle: the eval files' own 8-word runs, compared as word tuples, not hashes), and
the packs the repository keeps (JSONL -> pack -> records round-trips exactly).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.fixtures import oracle
from verispec.cli import main
from verispec.data import decontaminate
from verispec.data.eval_prompts import default_eval_dir

ORACLE = oracle("deepspec-gemma4-tiny")
EVAL_DIR = default_eval_dir()
needs_eval = pytest.mark.skipif(EVAL_DIR is None, reason="no shared/eval-prompts above this checkout")
PACKS = Path(__file__).resolve().parents[1] / "data" / "dspark"


def _eval_ngrams() -> set[tuple[str, ...]]:
    grams = set()
    for turn in decontaminate.eval_turns(EVAL_DIR):
        w = decontaminate.words(turn)
        grams |= {tuple(w[i : i + decontaminate.NGRAM]) for i in range(len(w) - decontaminate.NGRAM + 1)}
    return grams


def _overlaps(text: str, grams: set) -> bool:
    w = decontaminate.words(text)
    return any(tuple(w[i : i + decontaminate.NGRAM]) in grams for i in range(len(w) - decontaminate.NGRAM + 1))


@needs_eval
def test_the_shipped_fingerprint_is_the_eval_prompts_own():
    assert decontaminate.FINGERPRINT.read_bytes() == decontaminate.build_fingerprint(EVAL_DIR)


@needs_eval
def test_contamination_agrees_with_the_word_tuple_oracle():
    grams = _eval_ngrams()
    turns = decontaminate.eval_turns(EVAL_DIR)
    rng = random.Random(0)
    vocabulary = sorted({w for t in turns for w in decontaminate.words(t)})
    texts = []
    for turn in rng.sample(turns, 200):  # an eval turn's 8-word window inside other text
        w = decontaminate.words(turn)
        if len(w) >= 8:
            at = rng.randrange(len(w) - 7)
            texts.append("Please help. " + " ".join(w[at : at + 8]).upper() + ", thanks!")
    texts += [" ".join(rng.choices(vocabulary, k=rng.randrange(5, 60))) for _ in range(500)]  # eval words, shuffled
    texts += ["Now rewrite it.", "hello"]  # short eval turns are not n-grams
    got = [decontaminate.contaminated(t) for t in texts]
    assert got == [_overlaps(t, grams) for t in texts]
    assert 150 < sum(got) < len(texts) - 400, "both kinds are present"


def _conversations(path: Path, eval_prompt: str) -> None:
    convs = [
        [{"from": "human", "value": "tell me about t12 t7 t40 and more"},
         {"from": "gpt", "value": "t12 t7 t40 are tokens"},
         {"from": "human", "value": "and what of t99 t100 please"}],
        [{"from": "human", "value": "a question about t5 t6 t7 t8"},
         {"from": "gpt", "value": "t5 answers"},
         {"from": "human", "value": eval_prompt},  # left out, and so is every later turn that carries it
         {"from": "gpt", "value": "t9"},
         {"from": "human", "value": "one more thing t11"}],
        [{"from": "gpt", "value": "an answer with no question"}],  # not a prompt at all
    ]
    path.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))


@needs_eval
def test_datagen_takes_every_user_turn_but_never_an_eval_prompt(tmp_path, capsys):
    eval_prompt = decontaminate.eval_turns(EVAL_DIR)[100]
    _conversations(tmp_path / "convs.jsonl", eval_prompt)
    out = tmp_path / "answers.jsonl"
    argv = ["dspark", "datagen", "-m", str(ORACLE / "target"), "--prompts", str(tmp_path / "convs.jsonl"),
            "--out", str(out), "--max-tokens", "16", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    assert "2 prompts left out" in capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = [r["prompt"] for r in records]
    assert sorted(prompts) == sorted(["tell me about t12 t7 t40 and more", "and what of t99 t100 please",
                                      "a question about t5 t6 t7 t8"])
    second = next(r for r in records if r["prompt"] == "and what of t99 t100 please")
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert all(r["answer_ids"] for r in records)
    firsts = tmp_path / "firsts.jsonl"  # first turns of the same conversations: all written already
    firsts.write_text("".join(line + "\n" for line in (tmp_path / "convs.jsonl").read_text().splitlines()[:2]))
    assert main(["dspark", "datagen", "-m", str(ORACLE / "target"), "--prompts", str(firsts),
                 "--out", str(out), "--max-tokens", "16", "--dtype", "float32", "--quiet", "--turns", "first"]) == 0
    assert len(out.read_text().splitlines()) == 3
    # a committed pack continues: its records count as done for a new output file
    pack = tmp_path / "done.pack.xz"
    assert main(["dspark", "pack", "--data", str(out), "--out", str(pack), "--vocab-size", "512"]) == 0
    more = [str(tmp_path / "more.jsonl") if a == str(out) else a for a in argv]
    assert main(more + ["--packed", str(pack)]) == 0
    assert (tmp_path / "more.jsonl").read_text() == ""


def test_datagen_at_its_deadline_finishes_the_rows_decoding_and_drops_the_queued(tmp_path, capsys, monkeypatch):
    """--max-minutes: past the deadline no prompt is submitted, a row already decoding is
    finished and written whole, a row still queued is dropped unwritten, and a rerun writes the
    rest. Oracle: the same prompts run to completion with no deadline (each answer is the one
    its prompt gets alone: --batch 1)."""
    import time

    from verispec.engine.engine import Engine

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a question about t{i} t{i + 1}"}) + "\n" for i in range(3)))
    argv = ["dspark", "datagen", "-m", str(ORACLE / "target"), "--prompts", str(prompts), "--max-tokens", "12",
            "--dtype", "float32", "--quiet", "--batch", "1"]
    assert main([*argv, "--out", str(tmp_path / "whole.jsonl")]) == 0
    whole = {r["id"]: r for r in map(json.loads, (tmp_path / "whole.jsonl").read_text().splitlines())}
    # the clock jumps an hour once the first step has run: one row decodes, one waits behind it
    stepped, real_clock, real_step = [False], time.perf_counter, Engine.step
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + (3600.0 if stepped[0] else 0.0))

    def step(self):
        stepped[0] = True
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    out = tmp_path / "answers.jsonl"
    assert main([*argv, "--out", str(out), "--max-minutes", "1"]) == 0
    assert "stopped after --max-minutes 1" in capsys.readouterr().err
    monkeypatch.undo()
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(first) == 1, "the row decoding is written, the queued one is not"
    assert first[0]["answer_ids"] == whole[first[0]["id"]]["answer_ids"], "finished whole, not cut at the deadline"
    assert main([*argv, "--out", str(out)]) == 0
    assert {r["id"]: r["answer_ids"] for r in map(json.loads, out.read_text().splitlines())} == \
        {k: r["answer_ids"] for k, r in whole.items()}


def test_a_base_model_continues_each_user_turn_as_raw_text(tmp_path):
    """A model without a chat template (a base model such as gemma3-270m) gets each distinct user
    turn's text alone as a raw completion prompt (oracle: the tokenizer's own encoding with its
    special tokens, what /v1/completions sends), and its answers are those `--raw` gets from the
    same model with a template: the same prompts, the same per-prompt seeds."""
    import shutil

    from verispec.models.tokenizer import encode_prompt, load_tokenizer

    base = tmp_path / "base"
    shutil.copytree(ORACLE / "target", base)
    (base / "chat_template.jinja").unlink()
    _conversations(tmp_path / "convs.jsonl", "a plain third turn about t3")
    common = ["dspark", "datagen", "--prompts", str(tmp_path / "convs.jsonl"), "--max-tokens", "12",
              "--dtype", "float32", "--quiet"]
    assert main([*common, "-m", str(base), "--out", str(tmp_path / "base.jsonl")]) == 0
    assert main([*common, "-m", str(ORACLE / "target"), "--raw", "--out", str(tmp_path / "raw.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "base.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(base)
    assert sorted(r["prompt"] for r in records) == sorted(
        ["tell me about t12 t7 t40 and more", "and what of t99 t100 please", "a question about t5 t6 t7 t8",
         "a plain third turn about t3", "one more thing t11"])
    for r in records:
        assert r["prompt_ids"] == encode_prompt(tokenizer, r["prompt"]) and "messages" not in r and r["answer_ids"]
    assert (tmp_path / "raw.jsonl").read_text() == (tmp_path / "base.jsonl").read_text()


def test_measure_and_calibrate_prompt_a_base_model_with_the_text_alone(tmp_path):
    """`dspark measure` / `calibrate` encode an eval prompt with encode_user_text: a model with a
    chat template gets it through the template, one without (gemma3-270m) the text alone, as
    /v1/completions sends it (oracle: the tokenizer's own apply_chat_template and encode);
    before, gemma3-270m's measure stopped with "no chat template"."""
    import shutil

    from verispec.models.tokenizer import encode_user_text, load_tokenizer

    base = tmp_path / "base"
    shutil.copytree(ORACLE / "target", base)
    (base / "chat_template.jinja").unlink()
    text = "a question about t5 t6 t7 t8"
    chat, plain = load_tokenizer(ORACLE / "target"), load_tokenizer(base)
    templated = chat.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    assert encode_user_text(chat, text) == chat.encode(templated, add_special_tokens=False)
    assert encode_user_text(plain, text) == plain.encode(text, add_special_tokens=True)
    assert encode_user_text(chat, text) != encode_user_text(plain, text)


@needs_eval
def test_an_answer_that_shares_8_words_with_an_eval_prompt_is_never_kept(tmp_path, capsys, monkeypatch):
    """Datagen checks each generated answer too (a prompt can be clean and its answer not): such
    a record is written without its answer, so a rerun skips it and nothing trains on it; `pack`
    leaves out any record whose prompt or answer text shares an eval prompt's 8-word run.
    Oracles: the word-tuple check the committed-data test uses; a rerun's output."""
    from verispec.training.dspark.features import read_records
    from verispec.training.dspark.pack import read_pack

    _conversations(tmp_path / "convs.jsonl", "a plain third turn about t3")
    argv = ["dspark", "datagen", "-m", str(ORACLE / "target"), "--prompts", str(tmp_path / "convs.jsonl"),
            "--max-tokens", "16", "--dtype", "float32", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "clean.jsonl")]) == 0
    clean = [json.loads(line) for line in (tmp_path / "clean.jsonl").read_text().splitlines()]
    # pretend one record's answer (to its prompt, and only there) carries an eval prompt's 8 words
    prompt, marked = clean[1]["prompt"], clean[1]["answer"]
    real = decontaminate.contaminated
    monkeypatch.setattr(decontaminate, "contaminated",
                        lambda *texts: (texts[-2:] == (prompt, marked)) or real(*texts))
    out = tmp_path / "answers.jsonl"
    assert main([*argv, "--out", str(out)]) == 0
    assert "1 answers left out" in capsys.readouterr().err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == len(clean) and sum("left_out" in r and "answer_ids" not in r for r in got) == 1
    assert [r["id"] for r in read_records(out)] == [r["id"] for r in clean if r["prompt"] != prompt]
    assert main([*argv, "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == len(clean), "a rerun does not generate the left-out answer again"
    # the pack carries the left-out prompt's id, so a machine with only the pack does not ask it again
    left = tmp_path / "left.pack.xz"
    assert main(["dspark", "pack", "--data", str(out), "--out", str(left), "--vocab-size", "512"]) == 0
    left_id = next(r["id"] for r in got if "left_out" in r)
    assert read_pack(left)[0]["left_out"] == [left_id] and left_id not in {r["id"] for r in read_pack(left)[1]}
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "elsewhere.jsonl"), "--packed", str(left)]) == 0
    assert f"{len(clean)} answers already in" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere.jsonl").read_text().strip(), "nothing the pack settled is asked again"
    monkeypatch.undo()
    # pack: a record whose answer quotes an eval prompt is left out, whatever wrote it
    eval_prompt = decontaminate.eval_turns(EVAL_DIR)[7]
    records = [dict(r) for r in clean]
    records[0]["answer"] = "Sure. " + eval_prompt
    assert _overlaps(records[0]["answer"], _eval_ngrams())
    (tmp_path / "quoted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pack = tmp_path / "quoted.pack.xz"
    assert main(["dspark", "pack", "--data", str(tmp_path / "quoted.jsonl"), "--out", str(pack),
                 "--vocab-size", "512"]) == 0
    assert "1 records left out" in capsys.readouterr().err
    assert [r["id"] for r in read_pack(pack)[1]] == [r["id"] for r in records[1:]]


def test_a_pack_holds_exactly_the_records_and_grows_by_the_new_ones(tmp_path, capsys):
    from verispec.training.dspark.features import read_records
    from verispec.training.dspark.pack import read_pack

    rng = random.Random(1)
    records = [{"id": f"{i:016x}", "source": "sharegpt", "prompt": "x", "finish_reason": rng.choice(["stop", "length"]),
                "prompt_ids": [rng.randrange(70000) for _ in range(rng.randrange(1, 40))],
                "answer_ids": [rng.randrange(70000) for _ in range(rng.randrange(14, 60))]} for i in range(30)]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:20]))
    pack = tmp_path / "answers.pack.xz"
    assert main(["dspark", "pack", "--data", str(data), "--out", str(pack), "--vocab-size", "70000"]) == 0
    first = pack.read_bytes()
    assert main(["dspark", "pack", "--data", str(data), "--out", str(pack)]) == 0
    assert pack.read_bytes() == first, "packing the same data again changes nothing"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["dspark", "pack", "--data", str(data), "--out", str(pack)]) == 0
    meta, got = read_pack(pack)
    assert meta["width"] == 4 and len(got) == 30
    keys = ("id", "source", "finish_reason", "prompt_ids", "answer_ids")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in records]
    assert [r["id"] for r in read_records(pack)] == [r["id"] for r in read_records(data)]
    capsys.readouterr()
    assert main(["dspark", "pack", "--data", str(data), "--out", str(tmp_path / "small.pack.xz"),
                 "--vocab-size", "100"]) == 2
    assert "beyond the vocabulary of 100" in capsys.readouterr().err
    # a new pack takes the target's vocabulary from -m MODEL's config.json, or says what it needs
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 70000}}))
    assert main(["dspark", "pack", "--data", str(data), "--out", str(tmp_path / "m.pack.xz"), "-m", str(model)]) == 0
    assert read_pack(tmp_path / "m.pack.xz")[0]["vocab_size"] == 70000
    capsys.readouterr()
    assert main(["dspark", "pack", "--data", str(data), "--out", str(tmp_path / "none.pack.xz")]) == 2
    assert "-m MODEL or --vocab-size" in capsys.readouterr().err


@needs_eval
def test_a_pack_leaves_out_an_eval_run_that_spans_prompt_and_answer(tmp_path, capsys):
    """A base model's answer continues its prompt's last words, so an eval prompt's 8-word run
    can start in the prompt and end in the answer (stage 16 met one); neither text alone holds
    it. Oracle: the word-tuple check over the joined text, which the pack must agree with."""
    turn = next(t for t in decontaminate.eval_turns(EVAL_DIR) if len(decontaminate.words(t)) >= 8)
    w = decontaminate.words(turn)[:8]
    prompt, answer = "Notes: " + " ".join(w[:4]), " " + " ".join(w[4:]) + " and so on."
    grams = _eval_ngrams()
    assert not _overlaps(prompt, grams) and not _overlaps(answer, grams) and _overlaps(prompt + answer, grams)
    records = [{"id": f"{i:016x}", "source": "sharegpt", "prompt": text, "answer": reply, "finish_reason": "stop",
                "prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6]}
               for i, (text, reply) in enumerate([(prompt, answer), (prompt, " and then something else entirely.")])]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["dspark", "pack", "--data", str(data), "--out", str(tmp_path / "a.pack.xz"), "--vocab-size", "100"]) == 0
    from verispec.training.dspark.pack import read_pack

    assert [r["id"] for r in read_pack(tmp_path / "a.pack.xz")[1]] == [records[1]["id"]]
    assert "1 records left out" in capsys.readouterr().err


@needs_eval
@pytest.mark.parametrize("pack", sorted(PACKS.glob("*/*.pack.xz")) or [None], ids=lambda p: p and p.parent.name)
def test_the_committed_training_data_shares_no_8_words_with_an_eval_prompt(pack):
    """The repository's regenerated answers (prompts decoded with their model's tokenizer)."""
    if pack is None:
        pytest.skip("no training data committed under data/dspark yet")
    from verispec.models.registry import pull
    from verispec.models.tokenizer import load_tokenizer
    from verispec.training.dspark.pack import read_pack

    tokenizer = load_tokenizer(pull(pack.parent.name, progress=False))
    grams = _eval_ngrams()
    _, records = read_pack(pack)
    for r in records:
        assert not _overlaps(tokenizer.decode(r["prompt_ids"] + r["answer_ids"]), grams), r["id"]


@pytest.mark.real_model
def test_a_datagen_answer_is_the_one_its_prompt_gets_alone(smollm2_folder, tmp_path):
    """Datagen runs the served plan (batch-invariant kernels on SmolLM2) with a seed per prompt,
    so each answer equals the answer of its prompt generated alone (oracle: a --batch 1 run,
    one row at a time): a data set continued on another day or batch size is the same data."""
    prompts = ["Give me three tips for learning to cook.", "What is a prime number? Explain briefly.",
               "Write a haiku about rain on a tin roof.", "How do I reverse a list in Python?"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["dspark", "datagen", "-m", "smollm2-135m-instruct", "--max-tokens", "24", "--quiet"]
    assert main([*common, "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "batched.jsonl"),
                 "--batch", "4"]) == 0
    assert main([*common, "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "alone.jsonl"),
                 "--batch", "1"]) == 0  # one row at a time: each prompt alone

    def answers(name):
        return {r["prompt"]: r["answer_ids"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    batched, alone = answers("batched.jsonl"), answers("alone.jsonl")
    assert sorted(batched) == sorted(prompts) and all(len(a) > 1 for a in batched.values())
    assert batched == alone
