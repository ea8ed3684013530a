"""The same datagen work on two builds of verispec, timed in one run, answers compared id for id.

A change to the datagen step (a kernel, the sampler, the allocator) is worth what it saves on
the same work and nothing if it changes the answers. Each build is a git revision (`.` is this
checkout as it stands); its `src/` is exported once to work/builds/<commit> (`git archive`),
and every arm runs `verispec dspark datagen` from it in a fresh interpreter, on the same
prompts (`--skip`, `--limit`), with DeepSpec's sampling settings (each prompt's draws are
seeded by its id, so two builds that compute the same logits write the same answers).

Timing: per build, one run that submits nothing first (it compiles that build's kernels and
measures its plan when the cache has none), then per round one more such run (model load,
plan, prompt scan) and the timed run; the timed run's seconds less the empty run's are the
build's. Rounds alternate the builds (A B, A B, ...) so drift on a shared host falls on both.
The machine should be otherwise idle: two processes of two threads on two cores halve both.

    .venv/bin/python bench/datagen_builds.py --builds 869c534,. -m gemma3-270m --batch 64 --limit 128
    .venv/bin/python bench/datagen_builds.py --builds HEAD~1,. --limit 32 --rounds 2   # quick

Prints a table (seconds and tok/s per build and round, the speedup of the last build over the
first), whether every answer was token-identical across builds, one JSON line, and the CPU.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def resolve(rev: str) -> str:
    if rev == ".":
        return "."
    out = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"not a git revision of this repository: {rev!r}")
    return out.stdout.strip()


def export(commit: str) -> Path:
    """The build's source tree: this checkout for '.', else its src/ exported once under work/builds."""
    if commit == ".":
        return ROOT / "src"
    folder = ROOT / "work" / "builds" / commit[:12]
    if not (folder / "src" / "verispec" / "__init__.py").is_file():
        archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
    return folder / "src"


def datagen(src: Path, argv: list[str], threads: int) -> float:
    """One `verispec dspark datagen` run from `src` in a fresh interpreter; its wall seconds."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads))
    code = "import sys; from verispec.cli import main; sys.exit(main(sys.argv[1:]))"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "dspark", "datagen", *argv, "--threads", str(threads), "--quiet"],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"datagen failed on {src} ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def answers(path: Path) -> dict[str, list[int]]:
    """Each answered record's token ids by id (datagen's own reader: lines end at "\n" only, as
    an answer may hold U+2028; a left-out record has no answer)."""
    from verispec.training.dspark.features import read_records

    return {r["id"]: r["answer_ids"] for r in read_records(path, min_loss_tokens=0) if "answer_ids" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", required=True,
                    help="comma-separated git revisions, '.' for this checkout as it stands (e.g. 869c534,.)")
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64, help="rows decoded together (default 64)")
    ap.add_argument("--kernels", default="fastest", help="datagen's --kernels (default fastest)")
    ap.add_argument("--limit", type=int, default=64, help="prompts per arm (default 64)")
    ap.add_argument("--skip", type=int, default=20000,
                    help="skip this many prompts first (default 20000: past the committed packs' answers)")
    ap.add_argument("--max-tokens", type=int, default=384, help="longest answer (datagen's default 384)")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per build, alternating builds (default 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    if args.limit < 1 or args.rounds < 1:
        raise SystemExit("--limit and --rounds must be at least 1")
    sys.path.insert(0, str(ROOT / "src"))
    from verispec.models.kernel_plan import cpu_name

    revs = [r.strip() for r in args.builds.split(",") if r.strip()]
    if len(revs) < 2:
        raise SystemExit("--builds needs at least two revisions to compare")
    commits = [resolve(r) for r in revs]
    sources = [export(c) for c in commits]
    common = ["-m", args.model, "--skip", str(args.skip), "--limit", str(args.limit), "--max-tokens",
              str(args.max_tokens), "--kernels", args.kernels, "--batch", str(args.batch)]
    scratch = ROOT / "work" / "builds" / f"runs-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)

    def empty_run(i: int) -> float:
        return datagen(sources[i], [*common, "--out", str(scratch / f"empty-{i}.jsonl"), "--max-minutes", "1e-9"],
                       args.threads)

    for i, rev in enumerate(revs):  # compile and plan once per build, untimed
        print(f"  preparing {rev} ...", file=sys.stderr)
        empty_run(i)
    runs: list[list[dict]] = [[] for _ in revs]
    outputs: list[dict[str, list[int]]] = [{} for _ in revs]
    for round_ in range(args.rounds):
        for i, rev in enumerate(revs):
            load = empty_run(i)
            out = scratch / f"build{i}-round{round_}.jsonl"
            out.unlink(missing_ok=True)
            seconds = datagen(sources[i], [*common, "--out", str(out)], args.threads) - load
            got = answers(out)
            tokens = sum(len(a) for a in got.values())
            if round_ == 0:
                outputs[i] = got
            elif got != outputs[i]:
                raise SystemExit(f"{rev}: round {round_ + 1} wrote other answers than round 1 (not deterministic)")
            runs[i].append({"seconds": round(seconds, 1), "answers": len(got), "tokens": tokens,
                            "tok_s": round(tokens / seconds, 1)})
            print(f"  {rev} round {round_ + 1}: {len(got)} answers, {seconds:.0f} s, {tokens / seconds:.1f} tok/s",
                  file=sys.stderr)

    base = outputs[0]
    same = [sum(1 for k, v in o.items() if base.get(k) == v) for o in outputs]
    ids_match = all(set(o) == set(base) for o in outputs)
    medians = [statistics.median(r["seconds"] for r in rs) for rs in runs]
    builds = [{"build": rev, "commit": c, "runs": rs, "median_seconds": m, "speedup_vs_first": round(medians[0] / m, 3),
               "answers_identical_to_first": s}
              for rev, c, rs, m, s in zip(revs, commits, runs, medians, same)]
    result = {"bench": "datagen_builds", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
              "batch": args.batch, "kernels": args.kernels, "skip": args.skip, "limit": args.limit,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "builds": builds,
              "all_answers_identical": ids_match and all(s == len(base) for s in same)}
    if not args.json:
        print(f"{args.model}, {cpu_name()}, {args.threads} threads, batch {args.batch}, kernels {args.kernels}, "
              f"prompts {args.skip}..{args.skip + args.limit}, max {args.max_tokens} tokens, "
              f"temperature 0.7 / top-p 0.8 / top-k 20, load time subtracted")
        print(f"{'build':<14}{'round':>6}{'answers':>9}{'tokens':>9}{'s':>8}{'tok/s':>8}")
        for b in builds:
            for n, r in enumerate(b["runs"], 1):
                print(f"{b['build'][:13]:<14}{n:>6}{r['answers']:>9}{r['tokens']:>9}{r['seconds']:>8.0f}{r['tok_s']:>8.1f}")
        for b in builds[1:]:
            print(f"{b['build']} against {revs[0]}: {b['speedup_vs_first']:.2f}x (median seconds), "
                  f"{b['answers_identical_to_first']} of {len(base)} answers token-identical")
    print(json.dumps(result))
    return 0 if result["all_answers_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
