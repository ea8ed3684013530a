"""Training a DSpark drafter end to end on the fixture's tiny target (fast: 1M parameters).

datagen -> features -> train through the CLI; the loss goes down; an interrupted run
resumed from its checkpoint ends with exactly the weights of an uninterrupted one; two
processes under torchrun (gloo, DistributedDataParallel) end with the weights of one
process with the same global batch; the trained checkpoint loads as a drafter; validation's
walked greedy tau is what live T=0 decoding keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import oracle
from verispec.cli import main
from verispec.engine.verify_schedule import SERVED

ORACLE = oracle()
TRAIN = ["--layers", "1", "--block-size", "4", "--markov-rank", "8", "--draft-vocab", "0", "--mask-token-id", "511",
         "--anchors", "16", "--batch", "4", "--log-every", "100"]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    work = tmp_path_factory.mktemp("dspark-train")
    prompts = work / "prompts.jsonl"
    lines = [json.loads(line) for line in (ORACLE / "prompts.jsonl").read_text().splitlines()]
    prompts.write_text("".join(json.dumps({"prompt": p["turns_text"]}) + "\n" for p in lines))
    target = str(ORACLE / "target")
    # out of time before the first prompt: nothing written, and the next run does the work
    assert main(["dspark", "datagen", "-m", target, "--prompts", str(prompts), "--out", str(work / "answers.jsonl"),
                 "--max-tokens", "48", "--dtype", "float32", "--quiet", "--max-minutes", "1e-9"]) == 0
    assert (work / "answers.jsonl").read_text() == ""
    assert main(["dspark", "datagen", "-m", target, "--prompts", str(prompts), "--out", str(work / "answers.jsonl"),
                 "--max-tokens", "48", "--dtype", "float32", "--quiet"]) == 0
    assert len((work / "answers.jsonl").read_text().splitlines()) == len(lines)
    # resumable: a second run finds everything done and writes nothing new
    before = (work / "answers.jsonl").read_text()
    assert main(["dspark", "datagen", "-m", target, "--prompts", str(prompts), "--out", str(work / "answers.jsonl"),
                 "--max-tokens", "48", "--dtype", "float32", "--quiet"]) == 0
    assert (work / "answers.jsonl").read_text() == before
    assert main(["dspark", "features", "-m", target, "--data", str(work / "answers.jsonl"), "--out",
                 str(work / "features"), "--taps", "0,2,4", "--shard-size", "6", "--dtype", "float32", "--quiet",
                 "--store", "bf16"]) == 0  # bf16: the on-the-fly test below wants bit-identical samples
    return work / "features"


def _weights(folder: Path) -> dict:
    return {k: v for k, v in load_file(str(folder / "trainer" / "state.safetensors")).items() if k.startswith("param.")}


@pytest.fixture(scope="module")
def trained(features, tmp_path_factory):
    """A drafter trained 80 steps on the fixture's answers (its run folder)."""
    out = tmp_path_factory.mktemp("dspark-trained") / "run"
    assert main(["dspark", "train", "--features", str(features), "--out", str(out), *TRAIN, "--steps", "80",
                 "--lr", "3e-3", "--save-every", "80"]) == 0
    return out


def test_training_lowers_the_loss_and_the_checkpoint_serves(trained, capsys):
    out = trained
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(r["loss"] for r in rows[:4]) / 4, sum(r["loss"] for r in rows[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    assert (out / "curves.png").stat().st_size > 1000
    from verispec.models.loader import load_model
    from verispec.drafting.dspark.checkpoint import load_dspark

    target = load_model(str(ORACLE / "target"), dtype=torch.float32)
    drafter = load_dspark(out / (out / "latest").read_text().strip(), target=target)
    assert drafter.config.block_size == 4 and drafter.config.target_layer_ids == [0, 2, 4]
    # the run folder stands for its newest checkpoint, and that drafter changes no greedy token
    text = json.loads((ORACLE / "prompts.jsonl").read_text().splitlines()[0])["turns_text"]
    prompt = ["--max-tokens", "24", "--temperature", "0", "--dtype", "float32", "-m",
              str(ORACLE / "target"), "--raw", text]
    capsys.readouterr()
    assert main(["generate", *prompt, "--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", *prompt, "--draft-model", str(out)]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain and "drafts accepted" in drafted.err


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(features, tmp_path):
    common = ["dspark", "train", "--features", str(features), *TRAIN, "--steps", "6", "--save-every", "3"]
    assert main([*common, "--out", str(tmp_path / "straight")]) == 0
    interrupted = tmp_path / "interrupted"
    assert main([*common, "--stop-at", "3", "--out", str(interrupted)]) == 0
    assert (interrupted / "latest").read_text() == "step_3"
    # the same command as the straight run, pointed at the interrupted folder: resumes at step 3
    assert main([*common, "--out", str(interrupted)]) == 0
    a, b = _weights(tmp_path / "straight" / "step_6"), _weights(interrupted / "step_6")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


def test_a_warm_restart_starts_from_the_drafters_weights(features, tmp_path, capsys):
    """--init-from: step 0 is the given drafter (its bf16 file, as shipped), validated on the
    same held-out sequences as the run that trained it; a drafter reading other taps, or a
    folder with no drafter, is refused before any training."""
    base = tmp_path / "base"
    common = ["dspark", "train", "--features", str(features), *TRAIN, "--holdout", "2"]
    assert main([*common, "--steps", "6", "--save-every", "6", "--lr", "3e-3", "--out", str(base)]) == 0
    warm = tmp_path / "warm"
    # lr 0: AdamW leaves the weights where they started, so step 1 holds the starting weights
    assert main([*common, "--steps", "1", "--save-every", "1", "--lr", "0", "--markov-rank", "16",
                 "--init-from", str(base), "--out", str(warm)]) == 0
    shipped = load_file(str(base / "step_6" / "model.safetensors"))
    started = _weights(warm / "step_1")
    assert started and {k[len("param."):] for k in started} <= shipped.keys()
    assert not any(k.startswith("param.layers.1.") for k in started)  # its depth: no --layers, no deepening
    for k, v in started.items():  # its head options too (rank 8), not --markov-rank 16: same shapes, same values
        torch.testing.assert_close(v, shipped[k[len("param."):]].float(), atol=0, rtol=0, msg=k)
    trained = [json.loads(line) for line in (base / "validation.jsonl").read_text().splitlines()]
    restart = [json.loads(line) for line in (warm / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in restart] == [0, 1]
    # the same drafter, rounded to bf16 by the file: the same held-out acceptance within rounding
    assert abs(restart[0]["tau_probabilistic"] - trained[-1]["tau_probabilistic"]) < 0.02
    other = tmp_path / "other-taps"
    other.mkdir()
    (other / "model.safetensors").write_bytes((base / "step_6" / "model.safetensors").read_bytes())
    config = json.loads((base / "step_6" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "target_layer_ids": [0, 1, 4]}))
    capsys.readouterr()
    assert main([*common, "--steps", "1", "--init-from", str(other), "--out", str(tmp_path / "refused")]) != 0
    assert "reads target layers [0, 1, 4], the features hold [0, 2, 4]" in capsys.readouterr().err
    assert main([*common, "--steps", "1", "--init-from", str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "refused")]) != 0
    assert "no drafter there" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "latest").exists()


def test_two_processes_train_like_one(features, tmp_path):
    common = [*TRAIN, "--features", str(features), "--steps", "4", "--save-every", "4", "--threads", "1"]
    assert main(["dspark", "train", *common, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_free_port()), "-m", "verispec.cli", "dspark", "train", *common,
                           "--out", str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _weights(tmp_path / "one" / "step_4"), _weights(tmp_path / "two" / "step_4")
    for k in one:
        torch.testing.assert_close(one[k], two[k], atol=2e-5, rtol=1e-4, msg=k)
    moved = max(float((one[k] - _weights_init(features, tmp_path)[k]).abs().max()) for k in one)
    assert moved > 1e-3, "the weights did move"


def test_training_on_the_fly_ends_with_the_weights_of_training_on_the_cache(features, tmp_path, capsys):
    """`--data` computes each sample with a target forward when the step needs it (nothing on
    disk); oracle: the same run on the cache `dspark features` wrote from the same records.
    A draft vocabulary is counted from the samples' answer tokens in both."""
    common = ["dspark", "train", *TRAIN, "--steps", "3", "--save-every", "3", "--holdout", "2"]
    common[common.index("--draft-vocab") + 1] = "64"
    assert main([*common, "--features", str(features), "--out", str(tmp_path / "cached")]) == 0
    assert main([*common, "--data", str(features.parent / "answers.jsonl"), "-m", str(ORACLE / "target"),
                 "--taps", "0,2,4", "--dtype", "float32", "--out", str(tmp_path / "fly")]) == 0
    cached, fly = _weights(tmp_path / "cached" / "step_3"), _weights(tmp_path / "fly" / "step_3")
    assert cached.keys() == fly.keys()
    for k in cached:
        torch.testing.assert_close(cached[k], fly[k], atol=0, rtol=0, msg=k)
    vocab = [load_file(str(tmp_path / run / "step_3" / "trainer" / "state.safetensors"))["draft_vocab_ids"]
             for run in ("cached", "fly")]
    assert len(vocab[0]) == 64 and torch.equal(*vocab)
    assert [json.loads(line) for line in (tmp_path / "cached" / "validation.jsonl").read_text().splitlines()] == \
        [json.loads(line) for line in (tmp_path / "fly" / "validation.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert main([*common, "--features", str(features), "--data", str(features.parent / "answers.jsonl"),
                 "--out", str(tmp_path / "both")]) == 2
    assert "not both" in capsys.readouterr().err


def test_limit_takes_nested_subsets_shared_evenly_between_sources():
    """`train --limit` (the scaling curve's subsets): a smaller limit is a prefix-subset of a larger
    one, two sources give equal parts, a short source leaves its share to the other, and the
    held-out sequences are never taken."""
    from verispec.training.dspark.train import limited

    ids = [i for i in range(20) if i not in (8, 9)]  # 8, 9: held out (the first source's last two)
    one = [(0, 10), (10, 20)]
    small, large = limited(ids, one, 6), limited(ids, one, 12)
    assert set(small) <= set(large) and len(small) == 6 and len(large) == 12
    assert sum(i < 10 for i in small) == 3 and sum(i < 10 for i in large) == 6
    assert limited(ids, one, 17) == [*range(0, 8), *range(10, 19)]  # the first has only 8 of its 9
    assert limited(ids, one, 100) == ids and limited(ids, [(0, 20)], 5) == [0, 1, 2, 3, 4]


def test_train_folders_pick_the_training_source_and_keep_the_first_folders_holdout():
    """`train --train-folders` (the scaling curve's source points): training takes only the named
    folders, the held-out ids stay the first folder's last ones (validation on the target's own
    answers whatever is trained on), --limit counts within the chosen folders, and a folder
    number that does not exist is a clear error."""
    from verispec.errors import UserError
    from verispec.training.dspark.train import split_ids

    ranges = [(0, 10), (10, 25)]
    held, ids = split_ids(ranges, 2, "2", None)
    assert held == [8, 9] and ids == list(range(10, 25))
    assert split_ids(ranges, 2, "2", 4) == ([8, 9], [10, 11, 12, 13])
    assert split_ids(ranges, 2, None, None)[1] == [*range(0, 8), *range(10, 25)]
    assert split_ids(ranges, 0, "1", None) == ([], list(range(10)))
    for bad in ("3", "0", "two", ","):
        with pytest.raises(UserError, match="--train-folders"):
            split_ids(ranges, 2, bad, None)


def _weights_init(features, tmp_path):
    out = tmp_path / "zero"
    if not (out / "step_1").is_dir():
        assert main(["dspark", "train", *TRAIN, "--features", str(features), "--steps", "1", "--save-every", "1",
                     "--lr", "0", "--out", str(out)]) == 0
    return _weights(out / "step_1")


def _free_port() -> int:
    from verispec.server.launch import free_port

    return free_port()


def test_calibrate_writes_thresholds_and_measure_reports(tmp_path, monkeypatch):
    """On the fixture: calibrate fits one threshold per position from live rounds and writes
    them into the checkpoint's config (which then loads with them); measure writes its table,
    plots and JSON, tau within (1, gamma + 1] and the acceptance a probability."""
    import shutil

    from verispec.training.dspark.calibrate import fit_threshold

    drafter = tmp_path / "drafter"
    shutil.copytree(ORACLE / "drafter", drafter)
    for f in drafter.iterdir():
        f.chmod(0o644)
    lines = [json.loads(line) for line in (ORACLE / "prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p["turns_text"]}) + "\n" for p in lines))
    target = str(ORACLE / "target")
    assert main(["dspark", "calibrate", "--drafter", str(drafter), "-m", target, "--prompts", str(prompts), "--skip", "0",
                 "--limit", "16", "--max-tokens", "48", "--min-evidence", "5", "--dtype", "float32", "--quiet"]) == 0
    config = json.loads((drafter / "config.json").read_text())
    assert isinstance(config["confidence_threshold"], list) and len(config["confidence_threshold"]) == 4
    report = json.loads((drafter / "calibration.json").read_text())
    assert all(p["tested"] > 50 and 0 <= p["ece"] <= 1 for p in report["positions"])
    assert (drafter / "reliability.png").stat().st_size > 1000
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.models.loader import load_for_serving
    from verispec.serve_cli import plan_summary

    assert load_dspark(drafter).config.confidence_threshold == config["confidence_threshold"]
    # STS (the default method): one positive temperature per position, fitted on half the prompts
    # and reported on the other half, loaded back with the checkpoint
    temperatures = config["confidence_temperature"]
    assert len(temperatures) == 4 and all(t > 0 for t in temperatures)
    assert report["sts"]["temperatures"] == temperatures and report["sts"]["check_rounds"] > 50
    assert len(report["sts"]["before"]) == len(report["sts"]["after"]) == 4
    assert (drafter / "sts.png").stat().st_size > 1000
    assert load_dspark(drafter).config.confidence_temperature == temperatures
    # the threshold method is DeepSpec's kind: no temperatures
    assert main(["dspark", "calibrate", "--drafter", str(drafter), "-m", target, "--prompts", str(prompts), "--skip", "0",
                 "--limit", "4", "--max-tokens", "16", "--min-evidence", "5", "--dtype", "float32", "--quiet",
                 "--method", "threshold"]) == 0
    assert "confidence_temperature" not in json.loads((drafter / "config.json").read_text())
    assert load_dspark(drafter).config.confidence_temperature is None

    evals = tmp_path / "eval"
    evals.mkdir()
    (evals / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [p["turns_text"]]}) + "\n" for p in lines[:4]))
    assert main(["dspark", "measure", "--drafter", str(drafter), "-m", target, "--eval-dir", str(evals), "--datasets",
                 "gsm8k", "--per-dataset", "3", "--max-tokens", "32", "--dtype", "float32", "--quiet",
                 "--fixed-draft", "--with-ngram", "--with-composite"]) == 0
    measured = json.loads((drafter / "measure.json").read_text())
    for row in measured["rows"]:
        assert 1.0 < row["tau"] <= 5.0 and row["plain_tok_s"] > 0 and row["dspark_tok_s"] > 0
        assert 1.0 <= row["ngram_tau"] <= 5.0 and row["ngram_tok_s"] > 0
        assert 1.0 <= row["composite_tau"] <= 5.0 and row["composite_tok_s"] > 0
        assert all(a is None or 0 <= a <= 1 for a in row["acceptance_by_position"])
        # per position, the slots the target tested and kept: every kept draft once, no slot
        # tested that was not sent (a proposal's unsent tail is not a rejection), and a slot
        # tested only where the one before it was kept
        tested, kept = row["tested_by_position"], row["kept_by_position"]
        assert sum(kept) == row["accepted"] and sum(tested) <= row["drafted"]
        assert all(t <= k for t, k in zip(tested[1:], kept)) and all(k <= t for k, t in zip(kept, tested))
    assert (drafter / "report.md").read_text().count("| gsm8k |") == 2 and (drafter / "measure.png").is_file()
    # the target ran the kernel plan `verispec serve` runs, not PyTorch's defaults: speed as served
    composite = measured["target"].pop("composite")  # the composite's drafter was asked for some rows, not more
    # verify lengths decided as `verispec serve` decides them by default
    assert measured["target"].pop("verify_schedule") == SERVED == "strict" and measured["target"].pop("fixed_draft") is True
    assert "verify schedule strict" in (drafter / "report.md").read_text()
    assert 0 < composite["asked"]["dspark"] <= composite["rows"] == composite["asked"]["ngram"]
    assert measured["target"] == {"dtype": "float32", "plan": plan_summary(load_for_serving(target, "float32"))}
    assert measured["target"]["plan"] != "PyTorch kernels"
    # --against: a second drafter on the same prompts in the same run. The same drafter against
    # itself at T=0 keeps exactly the same tokens per round where nothing timed decides: unpacked,
    # so neither load's timed int8 choice can flip a near-tie; full proposals, so neither arm's
    # timed round price sizes its drafts; and one SPS table for both arms' verify schedules (each
    # engine reading it alone re-timed it on a busy CI machine: 2.556 against 2.3). The report
    # names it
    monkeypatch.setenv("VERISPEC_NO_PACK", "1")
    out = tmp_path / "against"
    assert main(["dspark", "measure", "--drafter", str(drafter), "-m", target, "--eval-dir", str(evals), "--datasets",
                 "gsm8k", "--per-dataset", "2", "--max-tokens", "24", "--dtype", "float32", "--quiet",
                 "--temperatures", "0", "--fixed-draft", "--against", str(drafter), "--out", str(out)]) == 0
    (row,) = json.loads((out / "measure.json").read_text())["rows"]
    assert row["against_tau"] == row["tau"] > 1.0 and row["against_tok_s"] > 0
    assert f"against {drafter.name} tau" in (out / "report.md").read_text()

    # the threshold rule itself: thin evidence never cuts, a clearly bad region does
    assert fit_threshold([(0.1, False)] * 3, target=0.5, min_evidence=5) == 0.0
    bad = [(0.1, False)] * 40 + [(0.9, True)] * 40
    assert 0.1 < fit_threshold(bad, target=0.5, min_evidence=5) <= 0.9


def test_the_training_precision_is_measured_once_per_machine_and_can_be_forced(tmp_path, monkeypatch):
    """bf16 autocast only where it measures >= 10% faster (emulated bf16 on AVX2 was ~20x slower);
    the measurement is cached under its machine key and reused; --precision / --fp32 skip it."""
    from verispec.training.dspark import precision

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    calls = []
    real = precision.measure
    monkeypatch.setattr(precision, "measure", lambda: calls.append(1) or real())
    cpu = torch.device("cpu")
    choice, why = precision.training_precision("auto", cpu)
    found = json.loads(precision.profile_path(torch.get_num_threads()).read_text())
    assert choice == found["choice"] == ("bf16" if found["bf16_ms"] < 0.9 * found["fp32_ms"] else "fp32")
    assert str(found["fp32_ms"]) in why and calls == [1]
    assert precision.training_precision("auto", cpu)[0] == choice and calls == [1], "the cached choice is reused"
    assert precision.training_precision("fp32", cpu) == ("fp32", "asked for")
    assert precision.training_precision("bf16", cpu) == ("bf16", "asked for") and calls == [1]
    with pytest.raises(ValueError):
        precision.training_precision("fp16", cpu)


def test_a_draft_vocabulary_markov_embedding_is_the_full_one_with_outside_rows_shared(features, tmp_path, capsys):
    """`--markov-vocab draft` (the default with a draft vocabulary): the Markov head embeds the
    previous token over the draft vocabulary plus one row shared by every other token.
    Oracle: the same drafter in DeepSpec's full-vocabulary layout, each target token's row
    copied from its compact row. Every target id embeds the same, a block proposes the same
    tokens and confidences (anchors inside and outside the draft vocabulary), and the trained
    checkpoint changes no greedy token."""
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.drafting.dspark.config import DSparkConfig
    from verispec.drafting.dspark.model import DSparkDrafter
    from verispec.models.loader import load_model

    out = tmp_path / "compact"
    common = ["dspark", "train", *TRAIN, "--steps", "3", "--save-every", "3", "--holdout", "2",
              "--features", str(features)]
    common[common.index("--draft-vocab") + 1] = "64"
    assert main([*common, "--out", str(out)]) == 0
    target = load_model(str(ORACLE / "target"), dtype=torch.float32)
    compact = load_dspark(out / "step_3", target=target, prepare=False)
    V = target.model.args.vocab_size
    assert compact.config.markov_vocab == "draft" and compact.markov_head.markov_w1.weight.shape[0] == 65 < V

    raw = dict(compact.config.raw)
    del raw["markov_vocab"]
    full = DSparkDrafter(DSparkConfig.from_dict(raw))
    state = compact.state_dict()
    state["markov_head.markov_w1.weight"] = compact.markov_head.markov_w1.weight[compact.markov_rows()]
    full.load_state_dict(state, strict=True)
    assert full.markov_head.markov_w1.weight.shape[0] == V

    every = torch.arange(V)
    torch.testing.assert_close(compact.markov_embedding(every), full.markov_embedding(every), atol=0, rtol=0)
    vocab = set(compact.draft_vocab_ids.tolist())
    outside = [t for t in range(V) if t not in vocab][:2]
    inside = sorted(vocab)[:2]
    h = torch.randn(4, compact.block_size, compact.config.args.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens_c, conf_c = compact.propose(h, inside + outside, lambda j, logits: logits.argmax(-1))
    tokens_f, conf_f = full.propose(h, inside + outside, lambda j, logits: logits.argmax(-1))
    assert torch.equal(tokens_c, tokens_f)
    torch.testing.assert_close(conf_c, conf_f, atol=0, rtol=0)

    text = json.loads((ORACLE / "prompts.jsonl").read_text().splitlines()[0])["turns_text"]
    prompt = ["--max-tokens", "24", "--temperature", "0", "--dtype", "float32", "-m", str(ORACLE / "target"), "--raw", text]
    capsys.readouterr()
    assert main(["generate", *prompt, "--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", *prompt, "--draft-model", str(out)]) == 0
    assert capsys.readouterr().out == plain


def test_measure_takes_a_shipped_drafters_name_and_never_writes_into_the_package(tmp_path):
    # the oracle: the factory's table of shipped drafters, the folder given, and the error's list
    from verispec.drafting.factory import BUNDLED_DRAFTERS, named_drafter
    from verispec.errors import UserError
    from verispec.training.dspark.measure import report_folder

    assert named_drafter("gemma3-270m", "--drafter") == BUNDLED_DRAFTERS["gemma3-270m"]
    assert report_folder("gemma3-270m", None) == Path("dspark-measure") / "gemma3-270m"
    own = tmp_path / "ckpt"
    own.mkdir()
    (own / "config.json").write_text("{}")
    assert named_drafter(str(own), "--drafter") == own and report_folder(str(own), None) == own
    assert report_folder("gemma3-270m", str(tmp_path / "o")) == tmp_path / "o"
    with pytest.raises(UserError, match="--drafter .*smollm2-135m-instruct"):
        named_drafter(str(tmp_path / "missing"), "--drafter")


def test_a_warm_restart_widens_the_draft_vocabulary_and_keeps_what_the_drafter_learnt(features, tmp_path, capsys):
    """`--init-from D --draft-vocab N`, N above D's draft vocabulary: the most frequent answer
    tokens D lacks join, and D's own computation is kept. Oracle: D itself. Driven along the
    same tokens, the widened drafter's logits on D's rows and its confidences equal D's, from
    anchors inside D's vocabulary, joining it, and outside both (a joining token embeds as the
    outside row it was). Narrowing, or widening to the full vocabulary, is refused."""
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.models.loader import load_model

    common = ["dspark", "train", "--features", str(features), *TRAIN, "--holdout", "2"]
    vocab_at = common.index("--draft-vocab") + 1
    narrow = list(common)
    narrow[vocab_at] = "32"
    assert main([*narrow, "--steps", "3", "--save-every", "3", "--lr", "3e-3", "--out", str(tmp_path / "base")]) == 0
    wide = list(common)
    wide[vocab_at] = "64"
    capsys.readouterr()
    # lr 0: AdamW leaves the weights where they started, so step 1 holds the widened starting weights
    assert main([*wide, "--steps", "1", "--save-every", "1", "--lr", "0", "--init-from", str(tmp_path / "base" / "step_3"),
                 "--out", str(tmp_path / "wide")]) == 0
    assert "draft vocabulary 64, widened: it covers" in capsys.readouterr().err
    # without --draft-vocab the drafter's own is kept, and the run says what share of the data it covers
    from verispec.training.dspark.features import FeatureCache

    cache = FeatureCache([features])
    answers = [int(t) for i in range(len(cache)) for t in cache.answer_tokens(i)]
    base_ids = set(load_file(str(tmp_path / "base" / "step_3" / "model.safetensors"))["draft_vocab_ids"].tolist())
    share = sum(t in base_ids for t in answers) / len(answers)
    kept = list(common)
    del kept[vocab_at - 1 : vocab_at + 1]
    assert main([*kept, "--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "base" / "step_3"),
                 "--out", str(tmp_path / "kept")]) == 0
    assert f"draft vocabulary 32, covering {share:.1%} of the answer tokens (a larger --draft-vocab widens it)" \
        in capsys.readouterr().err
    target = load_model(str(ORACLE / "target"), dtype=torch.float32)
    old = load_dspark(tmp_path / "base" / "step_3", target=target, prepare=False)
    new = load_dspark(tmp_path / "wide" / "step_1", target=target, prepare=False)
    old_ids, new_ids = old.draft_vocab_ids.tolist(), new.draft_vocab_ids.tolist()
    assert len(old_ids) == 32 and len(new_ids) == 64 and set(old_ids) < set(new_ids) and new_ids == sorted(new_ids)
    rows = torch.tensor([new_ids.index(t) for t in old_ids])  # each old token's row in the widened head

    joining = [t for t in new_ids if t not in old_ids]
    outside = [t for t in range(target.model.args.vocab_size) if t not in new_ids]
    anchors = old_ids[:2] + joining[:2] + outside[:2]
    h = torch.randn(len(anchors), old.block_size, old.config.args.hidden_size, generator=torch.Generator().manual_seed(1))
    seen = {"old": [], "new": []}

    def old_choice(j, logits):
        seen["old"].append(logits)
        return logits.argmax(-1)

    def new_choice(j, logits):
        seen["new"].append(logits[:, rows])
        return rows[logits[:, rows].argmax(-1)]  # the token the old drafter picks, as a widened row

    tokens_old, conf_old = old.propose(h, anchors, old_choice)
    tokens_new, conf_new = new.propose(h, anchors, new_choice)
    assert torch.equal(tokens_old, tokens_new)
    torch.testing.assert_close(conf_new, conf_old, atol=1e-5, rtol=1e-5)
    for a, b in zip(seen["new"], seen["old"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    capsys.readouterr()
    for size, says in (("16", "not narrowed"), ("0", "not to the full vocabulary")):
        wide[vocab_at] = size
        assert main([*wide, "--steps", "1", "--init-from", str(tmp_path / "base" / "step_3"),
                     "--out", str(tmp_path / "refused")]) != 0
        assert says in capsys.readouterr().err


def test_a_warm_restart_deepens_the_drafter_and_refuses_to_drop_layers(features, tmp_path, capsys):
    """`--init-from D --layers N`, N above D's layers, trains a deeper drafter that starts as D
    (tests/test_dspark_families.py checks the function against D's for every family); without
    --layers D's depth is kept, and fewer layers than D's are refused."""
    common = ["dspark", "train", "--features", str(features), *TRAIN, "--holdout", "2"]
    layers_at = common.index("--layers") + 1
    assert main([*common, "--steps", "2", "--save-every", "2", "--lr", "3e-3", "--out", str(tmp_path / "base")]) == 0
    deeper = list(common)
    deeper[layers_at] = "2"
    capsys.readouterr()
    assert main([*deeper, "--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "base" / "step_2"),
                 "--out", str(tmp_path / "deep")]) == 0
    assert "(2 draft layers, deepened from 1, " in capsys.readouterr().err
    config = json.loads((tmp_path / "deep" / "step_1" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2
    base = load_file(str(tmp_path / "base" / "step_2" / "model.safetensors"))
    deep = load_file(str(tmp_path / "deep" / "step_1" / "model.safetensors"))
    assert torch.equal(deep["layers.1.mlp.gate_proj.weight"], base["layers.0.mlp.gate_proj.weight"])
    assert not deep["layers.1.mlp.down_proj.weight"].any()  # lr 0: the zeroed branch as it started
    kept = list(common)
    del kept[layers_at - 1 : layers_at + 1]
    assert main([*kept, "--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "deep" / "step_1"),
                 "--out", str(tmp_path / "kept")]) == 0
    assert "(2 draft layers, draft vocabulary" in capsys.readouterr().err
    shallow = list(common)
    shallow[layers_at] = "1"
    assert main([*shallow, "--steps", "1", "--init-from", str(tmp_path / "deep" / "step_1"),
                 "--out", str(tmp_path / "refused")]) != 0
    assert "not removed" in capsys.readouterr().err


def _decode_one_at_a_time(model, ids: list[int], taps: list[int]):
    """Serving's view of a sequence: one forward per token, the taps and logits of each."""
    from verispec.models.decoder import BatchKV

    seq = model.new_cache().allocate(len(ids) + 1)
    hidden, logits = [], []
    for token in ids:
        out = model(torch.tensor([token]), BatchKV([seq], [1]), taps=taps)
        hidden.append(torch.cat(out.hidden, dim=-1))
        logits.append(out.logits)
    return torch.cat(hidden), torch.cat(logits)


@pytest.mark.parametrize("quant", ["auto", "q8_0"])
def test_served_features_are_the_bits_serving_reads(quant):
    """`dspark features --plan served`: one teacher-forced forward over the sequence gives, at
    every position, the taps the served target hands the drafter when it decodes the same
    tokens one at a time, and the logsumexp of the served head's logits (the kernels are
    batch-invariant). With a q8_0 head (int8 activations), train's served_target_head scores
    the draft-vocabulary rows exactly as the served head does; the float head does not."""
    from verispec.models.loader import load_for_serving
    from verispec.training.dspark.features import sequence_features
    from verispec.training.dspark.train import served_target_head

    loaded = load_for_serving(str(ORACLE / "target"), dtype="bfloat16", quant=quant, progress=False)
    model = loaded.model
    if quant == "q8_0" and not model.lm.kernel.endswith("-i8"):
        pytest.skip("no int8-activation kernel on this CPU")
    assert model.kernel_plan.invariant
    prompt, answer = [5, 9, 14, 22, 31], [7, 1, 60, 33, 12, 90, 45, 8, 19, 27, 3, 55]
    taps = [0, 2, 4]
    f = sequence_features(model, prompt, answer, taps)
    hidden, logits = _decode_one_at_a_time(model, prompt + answer, taps)
    assert torch.equal(f["taps"], hidden.to(torch.bfloat16))
    assert torch.equal(f["lse"][len(prompt):], logits[len(prompt):].logsumexp(-1).float())
    if quant != "q8_0":
        return
    from verispec.models.loader import read_tensors
    from verispec.models.quant import dequantize, quantize

    dense = read_tensors(ORACLE / "target")["lm_head.weight"].float()
    rows = torch.tensor([3, 17, 42, 100, 5, 200, 77, 64, 1, 300, 9, 150, 11, 400, 2, 99, 250])  # a draft vocabulary
    exact = dequantize(quantize(dense, "q8_0"), "q8_0", dense.shape[1])[rows]  # what the served head holds
    head = torch.nn.Linear(exact.shape[1], len(rows), bias=False)
    head.weight.data.copy_(exact)
    served = served_target_head(head, model.lm.kernel)
    last = f["last_hidden"].float()
    assert torch.equal(served(last), logits[:, rows])
    assert not torch.equal(head(last), logits[:, rows])  # the float head is another (nearby) model
    head.weight.data.copy_(dense[rows])  # rows that q8_0 does not hold exactly: refused, not silently rounded
    with pytest.raises(Exception, match="not exact"):
        served_target_head(head, model.lm.kernel)


def test_a_features_folder_holds_one_kind_of_target(features, tmp_path, capsys):
    """The served target's features and PyTorch's are different numbers: a folder of one is
    not continued with the other, and two such folders are not mixed in one training run."""
    answers = str(features.parent / "answers.jsonl")
    common = ["dspark", "features", "-m", str(ORACLE / "target"), "--data", answers, "--taps", "0,2,4",
              "--dtype", "float32", "--quiet"]
    capsys.readouterr()
    assert main([*common, "--out", str(features), "--plan", "dtype"]) != 0
    assert "--plan served" in capsys.readouterr().err
    other = tmp_path / "pytorch-features"
    assert main([*common, "--out", str(other), "--plan", "dtype"]) == 0
    manifest = json.loads((other / "manifest.json").read_text())
    assert manifest["plan"] == "dtype"
    for key in ("plan", "head_kernel", "dtype"):  # a folder made before --plan existed: PyTorch's kernels
        del manifest[key]
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert main([*common, "--out", str(other), "--plan", "dtype"]) == 0  # continued (here: already complete)
    assert main([*common, "--out", str(other)]) != 0  # not with the served target
    assert main(["dspark", "train", "--features", f"{features},{other}", "--out", str(tmp_path / "run"), *TRAIN,
                 "--steps", "1"]) != 0
    assert "recompute one of them" in capsys.readouterr().err
    # a folder of another model's features names that model, so the resume command can be mended
    manifest = json.loads((features / "manifest.json").read_text())
    named = tmp_path / "named-features"
    named.mkdir()
    (named / "manifest.json").write_text(json.dumps({**manifest, "target_name": "gemma3-270m"}))
    assert main([*common, "--out", str(named)]) != 0
    assert "holds features of gemma3-270m" in capsys.readouterr().err


def _shards(folder: Path) -> list[dict]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [load_file(str(folder / s["file"])) for s in manifest["shards"]]


def test_fp8_features_hold_the_bf16_features_within_e4m3s_half_step(features, tmp_path, capsys):
    """`features` in its default store, fp8: oracle, the bf16 features of the same records: every tap
    element within e4m3's half step of its own value (2^-4 relative; 2^-10 of the row's scale
    where e4m3 runs out of exponent) plus bf16's rounding on reading; the final hidden state
    (the teacher), ids, masks and logsumexps bit-equal; under 70% of the bytes."""
    from verispec.training.dspark.features import FeatureCache

    answers = str(features.parent / "answers.jsonl")
    fp8 = tmp_path / "fp8"
    assert main(["dspark", "features", "-m", str(ORACLE / "target"), "--data", answers, "--out", str(fp8),
                 "--taps", "0,2,4", "--shard-size", "6", "--dtype", "float32", "--quiet"]) == 0  # no --store
    assert "as fp8" in capsys.readouterr().err
    assert json.loads((fp8 / "manifest.json").read_text())["store"] == "fp8"
    exact, stored = FeatureCache([features]), FeatureCache([fp8])
    assert len(exact) == len(stored) > 0
    for i in range(len(exact)):
        a, b = exact[i], stored[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.lse, b.lse) and torch.equal(a.last_hidden, b.last_hidden)
        x, y = a.taps.float(), b.taps
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        rows = x.view(x.shape[0], 3, -1)
        scale = rows.abs().amax(-1, keepdim=True) / 448
        bound = rows.abs() * (2**-4 + 2**-8) + scale * 2**-10
        err = (y.float().view_as(rows) - rows).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        assert float(err.max()) > 0  # it is rounded: the test sees the store, not the bf16 folder twice
    sizes = [json.loads((f / "manifest.json").read_text())["bytes"] for f in (features, fp8)]
    assert sizes[1] < 0.7 * sizes[0], sizes
    # a folder keeps its store: resuming it with the other one is refused, with the way out named
    assert main(["dspark", "features", "-m", str(ORACLE / "target"), "--data", answers, "--out", str(fp8),
                 "--taps", "0,2,4", "--dtype", "float32", "--quiet", "--store", "bf16"]) != 0
    assert "stores its features as fp8" in capsys.readouterr().err
    # training reads either store, and both mixed
    assert main(["dspark", "train", "--features", f"{fp8},{features}", "--out", str(tmp_path / "run"), *TRAIN,
                 "--steps", "2", "--save-every", "2"]) == 0
    assert (tmp_path / "run" / "step_2" / "model.safetensors").is_file()


def test_fp8_features_recast_from_a_bf16_folder_equal_those_computed_directly(features, tmp_path):
    """`features --from-features BF16 --store fp8`: no target forward, and the same bytes as
    `--store fp8` from the records (oracle: the direct run); an interrupted recast resumes."""
    answers = str(features.parent / "answers.jsonl")
    direct, recast = tmp_path / "direct", tmp_path / "recast"
    assert main(["dspark", "features", "-m", str(ORACLE / "target"), "--data", answers, "--out", str(direct),
                 "--taps", "0,2,4", "--shard-size", "6", "--dtype", "float32", "--quiet", "--store", "fp8"]) == 0
    assert main(["dspark", "features", "--from-features", str(features), "--out", str(recast), "--store", "fp8",
                 "--quiet"]) == 0
    manifest = json.loads((recast / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["complete"]
    # interrupted after its first shard: the rerun writes the rest
    cut = {**manifest, "shards": manifest["shards"][:1], "records": manifest["shards"][0]["records"],
           "tokens": manifest["shards"][0]["tokens"], "complete": False}
    (recast / "manifest.json").write_text(json.dumps(cut))
    assert main(["dspark", "features", "--from-features", str(features), "--out", str(recast), "--quiet"]) == 0
    assert json.loads((recast / "manifest.json").read_text())["records"] == manifest["records"]
    for a, b in zip(_shards(direct), _shards(recast), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert main(["dspark", "features", "--from-features", str(features), "--out", str(features), "--quiet"]) != 0


def test_newest_and_replayed_features_are_the_whole_folders_samples(features, tmp_path, capsys):
    """`features --newest N --replay M` over a pack: oracle, the folder of every record (the
    fixture, same target and store): its samples are that folder's samples of the M drawn older
    records, in order, then of the last N, bit for bit; so `train --holdout` on it holds out new
    answers only. A resumed folder keeps its choice; --replay alone, and a JSONL, are refused."""
    from verispec.training.dspark.features import FeatureCache, read_records

    answers = features.parent / "answers.jsonl"
    pack = tmp_path / "answers.pack.xz"
    assert main(["dspark", "pack", "--data", str(answers), "--out", str(pack), "--vocab-size", "512"]) == 0
    records = read_records(pack)
    assert len(records) == len(read_records(answers)) >= 8
    out = tmp_path / "incremental"
    common = ["dspark", "features", "-m", str(ORACLE / "target"), "--data", str(pack), "--taps", "0,2,4",
              "--dtype", "float32", "--quiet", "--store", "bf16", "--shard-size", "3"]
    assert main([*common, "--out", str(out), "--newest", "3", "--replay", "4", "--seed", "5"]) == 0
    whole, part = FeatureCache([features]), FeatureCache([out])
    assert len(part) == 7
    position = {tuple(whole[i].input_ids.tolist()): i for i in range(len(whole))}
    chosen = [position[tuple(part[i].input_ids.tolist())] for i in range(len(part))]
    n = len(whole)
    assert chosen[4:] == [n - 3, n - 2, n - 1], "the last three records, last"
    assert chosen[:4] == sorted(chosen[:4]) and all(i < n - 3 for i in chosen[:4]), "four older ones, in order"
    for i, j in enumerate(chosen):
        a, b = part[i], whole[j]
        for field in ("input_ids", "loss_mask", "lse", "last_hidden", "taps"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
    # the same seed draws the same records
    again = tmp_path / "again"
    assert main([*common, "--out", str(again), "--newest", "3", "--replay", "4", "--seed", "5"]) == 0
    assert [FeatureCache([again])[i].input_ids.tolist() for i in range(7)] == [part[i].input_ids.tolist() for i in range(7)]
    capsys.readouterr()
    assert main([*common, "--out", str(out), "--newest", "3", "--replay", "4", "--seed", "6"]) != 0
    assert "resume it with the same choice" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "x"), "--replay", "2"]) != 0
    assert "give --newest" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "y"), "--newest", str(n + 1)]) != 0
    assert f"holds {n} records" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "y"), "--newest", "0"]) != 0
    assert "--newest 0" in capsys.readouterr().err
    assert main([*common[:5], str(answers), *common[6:], "--out", str(tmp_path / "z"), "--newest", "2"]) != 0
    assert "a pack's records" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "xyz"), "a refused call leaves no folder"


def test_the_walked_validation_tau_is_what_live_greedy_decoding_keeps(features, trained):
    """train's `tau_walk_greedy` (training/dspark/walk.py) against its oracle, live T=0 decoding
    with full blocks every round: the held-out sequences are the target's own greedy answers,
    so each teacher-forced block is the block live decoding drafts at that anchor."""
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.engine.request import GenerationRequest
    from verispec.engine.sampling import SamplingParams
    from verispec.models.loader import load_model
    from verispec.training.dspark.features import TargetFeatures
    from verispec.training.dspark.live import make_engine
    from verispec.training.dspark.train import validate

    target = load_model(str(ORACLE / "target"), dtype=torch.float32)
    drafter = load_dspark(trained / (trained / "latest").read_text().strip(), target=target)
    engine = make_engine(target, DSparkProvider(drafter), adaptive=False, num_draft_tokens=drafter.block_size,
                         verify_schedule="cost")
    records, emitted, rounds = [], 0.0, 0
    for line in (features.parent / "answers.jsonl").read_text().splitlines()[:8]:
        prompt_ids = json.loads(line)["prompt_ids"]
        result = engine.generate(GenerationRequest(prompt_ids, 40, SamplingParams(temperature=0.0)))
        answer = [t for t in result.token_ids if t not in target.stop_ids]
        records.append({"prompt_ids": prompt_ids, "answer_ids": answer})
        spec = result.speculation
        emitted += spec["mean_accepted_length"] * spec["rounds"]
        rounds += spec["rounds"]
    live = emitted / rounds
    samples = TargetFeatures([records], target, [0, 2, 4], "float32")
    val = validate(drafter, samples, range(len(records)), None, 16, None, 0)
    assert live > 1.3, "the trained drafter keeps drafts: the comparison has something to compare"
    assert abs(val["tau_walk_greedy"] - live) < 0.01 * live, (val, live)  # 2.0957 against 2.0956 when written
    # validation drafts the blocks in chunks of anchors: the same walk as all of them at once
    from verispec.training.dspark.train import _walk

    assert _walk(drafter, samples[0], None, None, chunk=5) == pytest.approx(
        _walk(drafter, samples[0], None, None, chunk=10_000), rel=1e-5)
