"""`verispec bench matrix`: every combination of batching, grammar and speculation, per
model and workload, against peers, in one run.

A cell is (model, arm, lane, workload, grammar):

  arm       none (`--no-draft`), ngram (`--speculate ngram`), dspark (`--draft-model`: the
            drafter given, else the one verispec ships for the model), default (what
            `verispec serve -m MODEL` does with no flags; when that is one of the other arms
            its cells are that arm's, measured once and reported under both names), and the
            peers (bench/peers.py: llama.cpp, llama.cpp-lookup, transformers)
  lane      serial (1 streaming client), batch4, batch8 (4 / 8 concurrent streaming clients,
            closed loop: a client sends its next request when one finishes)
  workload  chat, long, json (bench/workloads.py); grammar on only for json, where the
            grammar-off cell is the same prompts unconstrained

verispec arms run in a server this command starts (`verispec serve`, one per arm) or, with
`--url`, in a server already running (its configuration is then the only arm). Each cell
runs `--repeats` times (the arms' servers in turn, so slow drift hits every arm alike) and
reports the median of each metric: aggregate tok/s (all tokens / wall time), per-stream
tok/s (a request's tokens after its first / time after its first; median over requests),
TTFT p50 / p95 at the first SSE content event, tau and drafts verified per row-round
(usage.speculation), schema conformance (grammar cells: every output validated against its
schema with jsonschema; any verispec output that fails stops the run with that output
shown, exit code 1), the server's peak RSS. Ratios: `vs none` against verispec's none cell
of the same model, lane, workload and grammar; `grammar` the cell's tok/s over its own
grammar-off cell. Nothing is compared across runs.

Before anything runs, a preflight looks at the load average and at other processes using
the CPU: on a busy machine it warns and stamps the results "busy" (not quotable).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections import Counter
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from verispec.bench.loadgen import LaneResult, RssSampler, quantile, run_lane_sync, warn
from verispec.bench.peers import PEER_ARMS

ARMS = ("none", "ngram", "dspark", "default")
# why a cell that ran has no measurement (the table shows these; cells never run are listed per arm)
FAILED_PREFIXES = ("the server died on these requests", "every request failed",
                   "the server kept dying before these cells ran")
LANES = {"serial": 1, "batch4": 4, "batch8": 8}
# a server that cannot start (e.g. dspark for a model that ships no drafter and no
# --draft-model) has its cells reported as skipped with the server's own error
SERVER_FLAGS = {"none": ["--no-draft"], "ngram": ["--speculate", "ngram"], "dspark": ["--speculate", "dspark"],
                "default": []}


@dataclass(frozen=True)
class CellKey:
    model: str
    arm: str
    lane: str
    workload: str
    grammar: bool

    @property
    def label(self) -> str:
        return f"{self.workload}{'+grammar' if self.grammar else ''}"


@dataclass
class Cell:
    key: CellKey
    runs: list[LaneResult] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # outputs that failed their schema
    checked: int = 0
    skipped: str | None = None
    same_as: str | None = None  # the arm whose server this arm is
    crashes: int = 0  # times the server died while running this cell

    def metrics(self) -> dict:
        k = self.key
        row = {"model": k.model, "arm": k.arm, "lane": k.lane, "concurrency": LANES[k.lane], "workload": k.workload,
               "grammar": k.grammar}
        if self.skipped:
            return {**row, "skipped": self.skipped}
        runs = [r for r in self.runs if r.requests]
        if not runs:
            why = FAILED_PREFIXES[0] if self.crashes else FAILED_PREFIXES[1]
            return {**row, "skipped": f"{why}: " + "; ".join(e for r in self.runs for e in r.errors)[:300]}

        def med(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        spec = [q.usage.get("speculation") for r in runs for q in r.requests if q.usage and q.usage.get("speculation")]
        rounds = sum(s["rounds"] for s in spec)
        out = {
            **row,
            "repeats": len(runs),
            "requests": len(runs[0].requests),
            "tokens": med([sum(q.tokens for q in r.requests) for r in runs]),
            "agg_tok_s": round(med([r.agg_tok_s for r in runs]), 1),
            "stream_tok_s": _round(med([med([q.stream_tok_s for q in r.requests]) for r in runs])),
            "ttft_p50_ms": _ms(med([quantile([q.ttft for q in r.requests], 0.5) for r in runs])),
            "ttft_p95_ms": _ms(med([quantile([q.ttft for q in r.requests], 0.95) for r in runs])),
            # a peer reports no speculation counters: its tau is unknown, not 1
            "tau": None if k.arm in PEER_ARMS else
            round(sum(s["mean_accepted_length"] * s["rounds"] for s in spec) / rounds, 3) if rounds else 1.0,
            "verify_per_step": None if k.arm in PEER_ARMS else
            round(sum(s["drafted"] for s in spec) / rounds, 3) if rounds else 0.0,
            "peak_rss_mb": round(max(self.peak_rss) / 2**20) if self.peak_rss and max(self.peak_rss) else None,
            "errors": sum(len(r.errors) for r in self.runs),
        }
        if k.grammar:
            out["conformance"] = round(1 - len(self.invalid) / self.checked, 4) if self.checked else None
            if self.invalid:
                out["invalid"] = self.invalid[:3]
        if self.same_as:
            out["same_as"] = self.same_as
        if self.crashes:
            out["server_crashes"] = self.crashes
        return out


def _round(v):
    return None if v is None else round(v, 1)


def _ms(v):
    return None if v is None else round(v * 1000)


@dataclass
class Plan:
    model: str
    lanes: list[str]
    workloads: dict  # name -> Workload
    grammar: list[bool]
    repeats: int
    chat: bool  # chat requests (the model has a chat template) or completions

    def cells(self, arm: str):
        for lane in self.lanes:
            for name, workload in self.workloads.items():
                for grammar in (self.grammar if name == "json" else [False]):
                    key = CellKey(self.model, arm, lane, name, grammar)
                    yield key, workload


def skipped_by_flag(key: CellKey, patterns: set[str]) -> bool:
    """--skip takes arm, lane, workload or 'grammar' names, or 'arm:lane:workload' triples
    (a '*' matches anything)."""
    parts = (key.arm, key.lane, key.label)
    for p in patterns:
        if ":" in p:
            want = p.split(":")
            if len(want) == 3 and all(w in ("*", got) for w, got in zip(want, parts)):
                return True
        elif p in (key.arm, key.lane, key.workload) or (p == "grammar" and key.grammar):
            return True
    return False


def peer_cell_skipped(key: CellKey, peer_batch: bool) -> str | None:
    """Why a peer cannot run a cell (None: it can): transformers' generate serves no concurrent
    clients and no grammar; llama-cpp-python's server answers one request at a time, so its
    batch lanes only measure a queue and run only with --peer-batch."""
    from verispec.bench.peers import LLAMACPP_ARMS

    if key.arm == "transformers" and (key.lane != "serial" or key.grammar):
        return "transformers generate: serial lane, no grammar (no serving, no structured output)"
    if key.arm in LLAMACPP_ARMS and key.lane != "serial" and not peer_batch:
        return "llama-cpp-python's server answers one request at a time: a batch lane measures its queue " \
               "(--peer-batch runs it)"
    return None


def requests_for(workload, lane: str, chat: bool, model_name: str) -> list[dict]:
    count = max(len(workload.prompts), LANES[lane])
    return workload.bodies(model_name, chat, count)


def check_conformance(cell: Cell, bodies: list[dict], result: LaneResult) -> None:
    from verispec.bench.workloads import validate

    for index, req in enumerate(result.requests):
        schema = _schema_of(bodies[req.index if req.index >= 0 else index])
        if schema is None:
            continue
        cell.checked += 1
        why = validate(req.text, schema)
        if why:
            cell.invalid.append(f"{why}; output: {req.text[:400]!r} (finish_reason {req.finish_reason})")


def _schema_of(body: dict) -> dict | None:
    fmt = body.get("response_format")
    return fmt["json_schema"]["schema"] if fmt else None


def run_cell(url: str, served_name: str, plan: Plan, key: CellKey, workload, cell: "Cell", pid: int | None, rep: int,
             count_tokens, body_hook=None) -> None:
    """One repeat of one cell against the server at `url`."""
    bodies = requests_for(workload, key.lane, plan.chat, served_name)
    if not key.grammar:
        bodies = [{k: v for k, v in b.items() if k != "response_format"} for b in bodies]
    sent = [body_hook(b) for b in bodies] if body_hook else bodies
    endpoint = url + ("/v1/chat/completions" if plan.chat else "/v1/completions")
    sampler = RssSampler(pid) if pid else None
    with sampler or contextlib.nullcontext():
        result = run_lane_sync(endpoint, sent, LANES[key.lane], count_tokens)
    cell.runs.append(result)
    cell.peak_rss.append(sampler.peak if sampler else 0)
    if key.grammar:
        check_conformance(cell, bodies, result)
    for e in result.errors[:3]:
        warn(f"  {key.arm} {key.lane} {key.label}: {e}")
    m = cell.metrics()
    warn(f"  [{rep + 1}/{plan.repeats}] {key.arm:<17}{key.lane:<8}{key.label:<13} "
         f"{m.get('agg_tok_s', 0):>7.1f} tok/s  TTFT p50 {m.get('ttft_p50_ms')} ms  tau {m.get('tau')}")


def warm_up(url: str, served_name: str, plan: Plan, count_tokens, body_hook=None) -> None:
    """One short request of each workload (kernel plans, grammar compiles, caches)."""
    endpoint = url + ("/v1/chat/completions" if plan.chat else "/v1/completions")
    bodies = []
    for name, workload in plan.workloads.items():
        body = workload.bodies(served_name, plan.chat, 1)[0]
        bodies.append({**body, "max_tokens": 16} if name != "json" else body)
    if body_hook:
        bodies = [body_hook(b) for b in bodies]
    run_lane_sync(endpoint, bodies, 1, count_tokens)


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class Options:
    models: list[str]
    arms: list[str]
    peers: list[str]
    lanes: list[str]
    workloads: list[str]
    grammar: list[bool]
    repeats: int
    prompts: int
    max_tokens: dict
    threads: int
    draft_model: str | None
    eval_dir: Path
    out: Path
    url: str | None = None
    skip: set[str] = field(default_factory=set)
    serve_args: list[str] = field(default_factory=list)
    plots: bool = True
    dtype: str = "auto"
    settle_s: float = 120.0
    peer_batch: bool = False  # llama.cpp's batch lanes (its server queues them: one request at a time)


def default_arm(model: str) -> str:
    """Which arm `verispec serve -m MODEL` with no flags runs: an embedded model's catalog
    entry says (its speculation was chosen by measurement); any other model, none
    (drafting/factory.py build_drafter)."""
    from verispec.models.catalog import REGISTRY

    entry = REGISTRY.get(model)
    return (entry.speculation if entry is not None else None) or "none"


def run_matrix(opts: Options) -> dict:
    from verispec.bench.preflight import preflight
    from verispec.models.registry import display_name

    started = time.time()
    machine = preflight(opts.threads, opts.settle_s)
    for line in machine["warnings"]:
        warn(f"preflight: {line}")
    opts.out.mkdir(parents=True, exist_ok=True)
    logs = opts.out / "logs"
    logs.mkdir(exist_ok=True)
    cells: dict[CellKey, Cell] = {}
    models_info = {}

    def result_so_far() -> dict:
        rows = [c.metrics() for c in cells.values()]
        _ratios(rows)
        return {"bench": "matrix", "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
                "minutes": round((time.time() - started) / 60, 1), "machine": machine, "models": models_info,
                "repeats": opts.repeats, "rows": rows}

    for i, model in enumerate(opts.models):
        models_info[display_name(model)] = _run_model(model, opts, cells, logs)
        if i < len(opts.models) - 1:  # a run killed later keeps every model that finished
            partial = {**result_so_far(), "partial": f"models done: {', '.join(models_info)}"}
            write_outputs(partial, opts.out, plots=False)
            warn(f"{display_name(model)} done after {partial['minutes']} min; its results are in {opts.out}")
    return result_so_far()


def _run_model(model: str, opts: Options, cells: dict, logs: Path) -> dict:
    run = ModelRun(model, opts, cells, logs)
    for rep in range(opts.repeats):
        for arm in list(run.servers):
            run.run_arm(arm, rep)
    run.copy_aliases()
    return run.info


class ModelRun:
    """One model's part of the matrix: which servers run (arm -> flags, "=arm" for an
    alias, or the reason it cannot run), and each arm's repeats."""

    def __init__(self, model: str, opts: Options, cells: dict, logs: Path):
        from verispec.bench.workloads import build_workloads
        from verispec.models.registry import display_name
        from verispec.models.tokenizer import has_chat_template, load_tokenizer

        self.model, self.opts, self.cells, self.logs = model, opts, cells, logs
        self.folder, self.gguf = _model_files(model)
        self.tokenizer = load_tokenizer(self.folder)
        chat = has_chat_template(self.tokenizer)
        workloads = {k: v for k, v in build_workloads(opts.eval_dir, opts.prompts, opts.max_tokens).items()
                     if k in opts.workloads}
        self.plan = Plan(display_name(model), opts.lanes, workloads, opts.grammar, opts.repeats, chat)
        self.info = {"chat": chat, "folder": self.folder.name, "arms": {}}
        warn(f"{model}: {'chat' if chat else 'completion'} workloads {', '.join(workloads)}; "
             f"lanes {', '.join(opts.lanes)}")
        self.servers = self._servers()
        self._mark_skips()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _servers(self) -> dict[str, list[str] | str]:
        from verispec.bench.peers import LLAMACPP_ARMS, llamacpp_missing, transformers_missing

        opts = self.opts
        if opts.url:
            return {"served": []}
        servers: dict[str, list[str] | str] = {}
        for arm in opts.arms:
            servers[arm] = ["--draft-model", opts.draft_model] if arm == "dspark" and opts.draft_model \
                else SERVER_FLAGS[arm]
        alias = default_arm(self.model) if "default" in servers else None
        if alias == "dspark" and opts.draft_model:  # the dspark arm runs the user's drafter, not the shipped one
            alias = None
        if alias in servers:
            servers["default"] = "=" + alias
        for arm in opts.peers:
            if arm in LLAMACPP_ARMS:
                servers[arm] = llamacpp_missing() or ("no GGUF for this model" if self.gguf is None else ["llama.cpp"])
            elif arm == "transformers":
                servers[arm] = transformers_missing() or ["in-process"]
        return servers

    def _mark_skips(self) -> None:
        from verispec.bench.peers import describe

        for arm, flags in self.servers.items():
            for key, _ in self.plan.cells(arm):
                cell = self.cells.setdefault(key, Cell(key))
                if isinstance(flags, str) and not flags.startswith("="):
                    cell.skipped = flags
                elif skipped_by_flag(key, self.opts.skip):
                    cell.skipped = "skipped by --skip"
                else:
                    cell.skipped = peer_cell_skipped(key, self.opts.peer_batch)
            if isinstance(flags, str):
                self.info["arms"][arm] = flags
            elif arm in PEER_ARMS:
                self.info["arms"][arm] = describe(arm, self.gguf)
            else:
                self.info["arms"][arm] = " ".join(["verispec serve", *flags])

    def _skip_arm(self, arm: str, reason: str) -> None:
        warn(f"{self.model} / {arm}: {reason}")
        self.servers[arm] = self.info["arms"][arm] = reason
        for key, _ in self.plan.cells(arm):
            self.cells[key].skipped = self.cells[key].skipped or reason

    def run_arm(self, arm: str, rep: int) -> None:
        """One repeat of an arm's cells (its time is added to info["minutes"])."""
        flags, plan, opts = self.servers[arm], self.plan, self.opts
        if isinstance(flags, str) or all(c.skipped for k, c in self.cells.items()
                                          if k.model == plan.model and k.arm == arm):
            return
        warn(f"{self.model} / {arm}: repeat {rep + 1} of {opts.repeats}")
        started = time.perf_counter()
        try:
            self._run_arm(arm, flags, rep)
        finally:
            minutes = self.info.setdefault("minutes", {})
            minutes[arm] = round(minutes.get(arm, 0) + (time.perf_counter() - started) / 60, 1)

    def _run_arm(self, arm: str, flags: list[str], rep: int) -> None:
        from verispec.bench.peers import LLAMACPP_ARMS, llamacpp_body, llamacpp_command, run_transformers
        from verispec.server.launch import free_port, server_process, verispec_serve_command

        plan, opts = self.plan, self.opts
        todo = [(key, workload) for key, workload in plan.cells(arm) if not self.cells[key].skipped]
        if arm == "served":
            name = _served_name(opts.url)
            for key, workload in todo:
                run_cell(opts.url, name, plan, key, workload, self.cells[key], None, rep, self.count_tokens)
            return
        if arm == "transformers":
            for key, workload in plan.cells(arm):
                if not self.cells[key].skipped:
                    bodies = requests_for(workload, key.lane, plan.chat, self.model)
                    self.cells[key].runs.append(run_transformers(self.folder, bodies, opts.threads))
                    self.cells[key].peak_rss.append(0)
            return
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if arm in LLAMACPP_ARMS:
            cmd, health, name, hook = (llamacpp_command(arm, self.gguf, port, opts.threads), url + "/v1/models",
                                       str(self.gguf), llamacpp_body)
        else:
            cmd = verispec_serve_command(port, "-m", self.model, "--threads", str(opts.threads), "--dtype", opts.dtype,
                                         "--max-batch", str(max(LANES[lane] for lane in opts.lanes)), *flags,
                                         *opts.serve_args)
            health, name, hook = url + "/health", self.model, None
        warm, idle_starts = True, 0
        while todo:  # a server that dies is started again for the cells after the one that killed it
            if idle_starts == 2:
                for key, _ in todo:
                    self.cells[key].skipped = FAILED_PREFIXES[2]
                return
            left = len(todo)
            server = server_process(cmd, health, timeout=900, log=self.logs / f"{slug(self.model)}-{arm}-{rep}.log")
            try:
                proc = server.__enter__()
            except (RuntimeError, TimeoutError) as e:
                return self._skip_arm(arm, f"the server did not start: {_last_line(str(e))}")
            try:
                if rep == 0 and arm not in LLAMACPP_ARMS:
                    self.info["arms"][arm] = _describe_server(url) or self.info["arms"][arm]
                if warm:
                    warm_up(url, name, plan, self.count_tokens, hook)
                    warm = False
                while todo and proc.poll() is None:
                    key, workload = todo.pop(0)
                    run_cell(url, name, plan, key, workload, self.cells[key], proc.pid, rep, self.count_tokens, hook)
                    if proc.poll() is not None:
                        self.cells[key].crashes += 1
                        warn(f"  {arm}: the server died during {key.lane} {key.label} (exit {proc.returncode}); "
                             f"starting it again")
            finally:
                server.__exit__(None, None, None)
            idle_starts = idle_starts + 1 if len(todo) == left else 0

    def copy_aliases(self) -> None:
        """The default arm, when it is another arm, reports that arm's measurements."""
        for arm, flags in self.servers.items():
            if not (isinstance(flags, str) and flags.startswith("=")):
                continue
            source_arm = flags[1:]
            for key, _ in self.plan.cells(arm):
                source = self.cells.get(CellKey(key.model, source_arm, key.lane, key.workload, key.grammar))
                cell = self.cells[key]
                if source and not cell.skipped:
                    cell.runs, cell.peak_rss, cell.invalid, cell.checked = (source.runs, source.peak_rss,
                                                                             source.invalid, source.checked)
                    cell.skipped, cell.same_as = source.skipped, source_arm
            self.info["arms"][arm] = f"the {source_arm} arm (verispec's default for {self.model})"


def _ratios(rows: list[dict]) -> None:
    by = {(r["model"], r["arm"], r["lane"], r["workload"], r["grammar"]): r for r in rows if "agg_tok_s" in r}
    for r in rows:
        if "agg_tok_s" not in r:
            continue
        base = by.get((r["model"], "none", r["lane"], r["workload"], r["grammar"]))
        r["vs_none"] = round(r["agg_tok_s"] / base["agg_tok_s"], 3) if base and base["agg_tok_s"] else None
        if r["grammar"]:
            off = by.get((r["model"], r["arm"], r["lane"], r["workload"], False))
            r["grammar_ratio"] = round(r["agg_tok_s"] / off["agg_tok_s"], 3) if off and off["agg_tok_s"] else None


def _model_files(model: str):
    """(HF folder, GGUF path or None) of a model name, folder or file."""
    from verispec.models.registry import REGISTRY, model_gguf_path, resolve_model

    folder = Path(resolve_model(model))
    gguf = None
    if model in REGISTRY:
        gguf = model_gguf_path(model)
    elif model.endswith(".gguf"):
        gguf = Path(model)
    return folder, gguf


def _last_line(text: str) -> str:
    """The last line of a failed start's message: the server's own error, without the
    command line that server_process puts before it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else text
    if "exited with" in last and ": " in last:
        last = last.split(": ", 1)[1]
    return last[:300]


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _describe_server(url: str) -> str | None:
    import httpx

    try:
        spec = httpx.get(url + "/stats", timeout=10).json().get("speculation")
    except Exception:  # noqa: BLE001 - a description only
        return None
    if not spec:
        return "no speculation"
    return f"{spec.get('provider')}, verify schedule {spec.get('verify_schedule')}"


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in Path(text).name)


# -- the report ---------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# verispec bench matrix — {result['started']} ({result['minutes']} min)", "",
             f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; "
             f"load average before the run {m['loadavg']:.2f}."
             + (" **BUSY MACHINE: these numbers are not quotable** (" + "; ".join(m["warnings"]) + ")."
                if m["busy"] else "")
             + (f" **Partial: {result['partial']}.**" if result.get("partial") else ""),
             f"Median of {result['repeats']} repeats per cell; greedy; `vs none` = this cell's aggregate tok/s over "
             f"verispec's none cell (same model, lane, workload, grammar); `grammar` = over the same arm's "
             f"grammar-off cell.", ""]
    for model, info in result["models"].items():
        lines += [f"## {model} ({'chat' if info['chat'] else 'completion'} workloads)", ""]
        rows = [r for r in result["rows"] if r["model"] == model]
        for arm, desc in info["arms"].items():  # cells an arm cannot run are said once, here
            minutes = info.get("minutes", {}).get(arm)
            lines.append(f"- **{arm}**: {desc}" + (f" ({minutes} min)" if minutes else ""))
            reasons = Counter(r["skipped"] for r in rows if r["arm"] == arm and _not_run(r))
            lines += [f"  - {n} cells not run: {why}" for why, n in reasons.items() if why != desc]
        lines += ["", *pivot(rows), "", "Every cell:"]
        lines += ["", "| lane | workload | arm | agg tok/s | vs none | stream tok/s | TTFT p50 / p95 ms | tau | "
                      "verify/step | grammar | conform | peak RSS MB |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        order = {a: i for i, a in enumerate(dict.fromkeys(r["arm"] for r in rows))}
        rows.sort(key=lambda r: (list(LANES).index(r["lane"]), r["workload"], r["grammar"], order[r["arm"]]))
        for r in rows:
            label = r["workload"] + (" +grammar" if r["grammar"] else "")
            if "skipped" in r:  # cells that ran and failed stay in the table
                if not _not_run(r):
                    lines.append(f"| {r['lane']} | {label} | {r['arm']} | failed: {r['skipped'][:160]} |||||||||")
                continue
            notes = [f"= {r['same_as']}"] if r.get("same_as") else []
            notes += [f"{r['errors']} failed requests"] if r.get("errors") else []
            notes += [f"server died x{r['server_crashes']}"] if r.get("server_crashes") else []
            lines.append(
                f"| {r['lane']} | {label} | {r['arm']}{' (' + '; '.join(notes) + ')' if notes else ''} | "
                f"{r['agg_tok_s']:.1f} | {_x(r.get('vs_none'))} | {_f(r['stream_tok_s'])} | "
                f"{r['ttft_p50_ms']} / {r['ttft_p95_ms']} | {_f(r['tau'], 2)} | {_f(r['verify_per_step'], 2)} | "
                f"{_x(r.get('grammar_ratio'))} | {_pct(r.get('conformance'))} | {r['peak_rss_mb'] or '-'} |")
        lines.append("")
    return "\n".join(lines)


def pivot(rows: list[dict]) -> list[str]:
    """One model's aggregate tok/s as lane x workload rows and one column per arm, each with
    its ratio to the none cell: the table a reader wants first."""
    measured = [r for r in rows if "agg_tok_s" in r]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["lane"], r["workload"], r["grammar"], r["arm"]): r for r in measured}
    keys = sorted({(r["lane"], r["workload"], r["grammar"]) for r in rows},
                  key=lambda k: (list(LANES).index(k[0]), k[1], k[2]))
    out = ["| lane | workload | " + " | ".join(arms) + " |", "|---|---|" + "---:|" * len(arms)]
    for lane, workload, grammar in keys:
        cells = []
        for arm in arms:
            r = by.get((lane, workload, grammar, arm))
            cells.append("-" if r is None else
                         f"{r['agg_tok_s']:.1f} ({_x(r.get('vs_none'))}){' !' if r.get('errors') else ''}")
        out.append(f"| {lane} | {workload}{' +grammar' if grammar else ''} | " + " | ".join(cells) + " |")
    if any(r.get("errors") for r in measured):
        out.append("\n! some requests of the cell failed (see every cell below); `-`: the cell did not run or none of "
                   "its requests succeeded")
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _not_run(row: dict) -> bool:
    """A skipped cell that never ran (the arm cannot, or --skip), not one whose requests failed."""
    return "skipped" in row and not row["skipped"].startswith(FAILED_PREFIXES)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def write_outputs(result: dict, out: Path, plots: bool = True) -> list[Path]:
    written = [out / "matrix.md", out / "cells.jsonl"]
    (out / "matrix.md").write_text(markdown(result) + "\n")
    with open(out / "cells.jsonl", "w") as f:
        for row in result["rows"]:
            f.write(json.dumps(row) + "\n")
    (out / "matrix.json").write_text(json.dumps(result, indent=1) + "\n")
    written.append(out / "matrix.json")
    if plots:
        from verispec.bench.plots import bars, heatmap

        written += heatmap(result, out) + bars(result, out)
    return written


def conformance_failures(result: dict) -> list[dict]:
    """verispec cells below 100% schema conformance (peers are reported, not gated)."""
    from verispec.bench.peers import LLAMACPP_ARMS

    return [r for r in result["rows"] if r.get("conformance") is not None and r["conformance"] < 1
            and r["arm"] not in LLAMACPP_ARMS]


def default_out() -> Path:
    return Path(tempfile.gettempdir()) / f"verispec-matrix-{time.strftime('%Y%m%d-%H%M%S')}"


