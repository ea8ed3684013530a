"""`verispec dspark features`: the target's features for training, computed once, on disk.

For every datagen record (prompt + answer), one teacher-forced target forward gives per
position what the DSpark loss needs (dspark-spec.md §6.1's target cache, scaled down):

    taps         bf16 [T, m*H]   raw outputs of target_layer_ids, concatenated (-1 = embeddings)
    last_hidden  bf16 [T, H]     the final-normed hidden state (target logits = lm_head of it)
    lse          fp32 [T]        logsumexp of the target's logits at answer positions, 0 on the
                                 prompt (ours: lets a drafter with a draft-vocabulary subset get
                                 exact target log-probs on it)
    input_ids    int32 [T], loss_mask uint8 [T] (1 on answer tokens, the final stop token included)

`--store fp8` (the default for a new folder since campaign stage 28) keeps the taps as float8
e4m3 with a float32 scale per row of each tap (`taps_scale`), in 59% of the disk; reading gives
bf16 either way, and the teacher's last_hidden stays bf16 (feature_store.py: why e4m3, why not
the teacher). `--store bf16` keeps the taps as computed: what `train --data` (on the fly) trains
on bit for bit. `--from-features` recasts a folder's shards.

Shards of `--shard-size` records are written atomically as safetensors files
(`shard-00000.safetensors`: the fields above concatenated, plus `offsets` [n+1]) and listed
in `manifest.json` after each one, so an interrupted run continues from the next shard.
Training reads slices through safetensors' memory map.

`--newest N --replay M` keeps a pack's last N records and M drawn at random (`--seed`) from
those before, the drawn ones first: the data of a warm restart (`train --init-from`) on a
machine that lacks the features of everything the drafter already saw. A new answer costs its
features once, and the replayed ones keep the old data in each batch; `--holdout` then takes
new answers only. Campaign stage 30 measured it against computing the whole pack's features.

Which target computes them (`--plan`): by default `served`, the target exactly as `verispec
serve` loads it on this machine (its measured kernel plan and weight formats). Its kernels are
batch-invariant, so a sequence's teacher-forced forward gives the same bits per position as
serving's decode steps: the drafter trains on the very features it reads when it drafts, and
the logsumexp is the served head's (a q8_0 head with int8 activations, where that is what
serves; `dspark train` then scores the draft vocabulary with the same kernel, train.py
`served_target_head`). `--plan dtype` is PyTorch's kernels in `--dtype`, the tool before
2026-12-06. Why: on a CPU without bf16 arithmetic `--dtype auto` is float32 for these tools
while gemma3 serves bf16 activations, and the float32 taps differed from the served ones by
0.8-8% (relative norm over a sequence), the logsumexp by 0.10-0.12 on average (max 0.96-7.5);
the served plan also ran a 400-token sequence in 1.06 s against float32's 1.16 (a throwaway
probe, three sequences, Intel Xeon without AVX512-BF16). Campaign stage 22.

Why a cache rather than target forwards during training: measured on this machine (README,
"Training a drafter"), the target's teacher-forced forward per sequence costs a large
share of a drafter training step, and training makes several passes over the data; the
cache is computed once and costs ~7 KiB per token on disk (SmolLM2, 5 taps). That grows
with the data (10k sequences: tens of GB), so `TargetFeatures` computes the same samples on
the fly instead (`dspark train --data`): one target forward per sequence per epoch, nothing on
disk. Both give bit-identical samples (the same `sequence_features`), so a run trains to the
same weights either way (tests/test_dspark_train.py).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.errors import UserError
from verispec.training.dspark.feature_store import STORES, decode, encode, read_rows, store_of

MANIFEST = "manifest.json"
VERSION = 1
PLANS = ("served", "dtype")
DEFAULT_STORE = "fp8"  # a new folder without --store: same held-out tau as bf16 in 59% of the disk (campaign stage 28)


def load_target(model: str | None, dtype: str, plan: str = "served"):
    """The target the features come from: `served` = what `verispec serve` loads here (the
    kernel plan measured for this machine; `dtype` as serve's --dtype), `dtype` = PyTorch's
    kernels in that dtype."""
    from verispec.models.loader import load_for_serving, load_model, resolve_dtype
    from verispec.models.registry import DEFAULT_MODEL

    if plan not in PLANS:
        raise UserError(f"--plan must be one of {', '.join(PLANS)}, not {plan!r}")
    if plan == "served":
        return load_for_serving(model or DEFAULT_MODEL, dtype=dtype)
    return load_model(model or DEFAULT_MODEL, dtype=resolve_dtype(dtype))


def head_kernel(loaded) -> str:
    """The kernel of the target's lm_head as loaded ("aten" for PyTorch's)."""
    lm = getattr(loaded.model, "lm", None)
    return "aten" if lm is None else lm.kernel


def default_taps(num_layers: int, count: int = 5) -> list[int]:
    """DeepSpec's spacing (Qwen3-4B's 36 layers -> 1, 9, 17, 25, 33): from layer 1 in equal
    strides, never the last layer."""
    stride = max(1, (num_layers - 2) // (count - 1))
    return [min(1 + i * stride, num_layers - 2) for i in range(count)]


def read_records(path: Path, min_loss_tokens: int = 14, select: dict | None = None) -> list[dict]:
    """Datagen's records (its JSONL, or a pack: training/dspark/pack.py) whose answers have at
    least `min_loss_tokens` tokens (DeepSpec's min_loss_tokens); with `select` (select_records'
    newest, replay and seed), only its choice among them."""
    from verispec.training.dspark.pack import is_pack, read_pack

    if is_pack(path):
        records = read_pack(path)[1]
        if select:
            records = select_records(records, **select)
        return [r for r in records if len(r["answer_ids"]) >= min_loss_tokens]
    if select:
        raise UserError(f"{path}: --newest / --replay choose among a pack's records (`verispec dspark pack` first)")
    records = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a line torn by an interrupted datagen; it reruns that prompt
                break
            raise UserError(f"{path}:{number}: not a datagen record") from None
        if len(r.get("answer_ids", [])) >= min_loss_tokens:  # DeepSpec's min_loss_tokens
            records.append(r)
    return records


def select_records(records: list[dict], newest: int, replay: int = 0, seed: int = 0) -> list[dict]:
    """`replay` records drawn at random (seeded) from all but the last `newest`, in their order,
    then the last `newest`: the data of a warm restart that adds new answers without the
    features of every old one (a training run's --holdout then takes only new answers)."""
    if newest < 1 or newest > len(records):
        raise UserError(f"--newest {newest}: the data holds {len(records)} records")
    older = len(records) - newest
    if replay < 0 or replay > older:
        raise UserError(f"--replay {replay}: {older} records come before the newest {newest}")
    drawn = sorted(random.Random(seed).sample(range(older), replay))
    return [records[i] for i in drawn] + records[older:]


@torch.inference_mode()
def sequence_features(model, prompt_ids: list[int], answer_ids: list[int], taps: list[int]) -> dict:
    from verispec.models.decoder import BatchKV

    ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long, device=model.device)
    n, first = len(ids), len(prompt_ids)
    last = model.args.num_layers - 1
    seq = model.new_cache().allocate(n)
    want = sorted(set(taps) | {last})
    # a drafter's targets are the target's distributions at answer positions only (its anchors
    # are answer tokens), so the full-vocabulary logits are computed there alone
    out = model(ids, BatchKV([seq], [n]), logits_at=torch.arange(first, n, device=model.device), taps=want)
    hidden = dict(zip(want, out.hidden))
    last_hidden = model._norm(hidden[last], model.final_norm)
    loss_mask = torch.zeros(n, dtype=torch.uint8)
    loss_mask[first:] = 1
    lse = torch.zeros(n, dtype=torch.float32)
    lse[first:] = out.logits.logsumexp(dim=-1).float().cpu()
    return {
        "input_ids": ids.to(torch.int32).cpu(),
        "loss_mask": loss_mask,
        "taps": torch.cat([hidden[t] for t in taps], dim=-1).to(torch.bfloat16).cpu(),
        "last_hidden": last_hidden.to(torch.bfloat16).cpu(),
        "lse": lse,
    }


def load_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, folder / MANIFEST)


def chosen_store(args, manifest: dict | None, out: Path) -> str:
    """--store, else the folder's own (a resumed folder keeps its store), else the default."""
    asked = getattr(args, "store", None)
    if asked is not None and asked not in STORES:
        raise UserError(f"--store must be one of {', '.join(STORES)}, not {asked!r}")
    if manifest is not None and asked is not None and store_of(manifest) != asked:
        raise UserError(f"{out} stores its features as {store_of(manifest)}, not {asked}: a folder holds one store; "
                        f"resume it without --store, or use a new --out folder")
    return store_of(manifest) if manifest is not None else asked or DEFAULT_STORE


def save_shard(out: Path, manifest: dict, tensors: dict, records: int) -> None:
    """Writes the next shard atomically and lists it in the manifest (written after it)."""
    name = f"shard-{len(manifest['shards']):05d}.safetensors"
    save_file(tensors, str(out / (name + ".partial")))
    os.replace(out / (name + ".partial"), out / name)
    tokens = int(tensors["offsets"][-1])
    manifest["shards"].append({"file": name, "records": records, "tokens": tokens})
    manifest["records"] += records
    manifest["tokens"] += tokens
    manifest["bytes"] += (out / name).stat().st_size
    write_manifest(out, manifest)


def run_features(args) -> int:
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    existing = load_manifest(out)
    store = chosen_store(args, existing, out)
    if getattr(args, "from_features", None):
        return recast_folder(Path(args.from_features), out, store, existing, args.quiet)
    if not args.data:
        raise UserError("dspark features needs --data (datagen records), or --from-features (a folder to recast)")
    newest, replay, seed = getattr(args, "newest", None), getattr(args, "replay", 0), getattr(args, "seed", 0)
    if replay and newest is None:
        raise UserError("--replay draws from the records before --newest N: give --newest")
    select = {"newest": newest, "replay": replay, "seed": seed} if newest is not None else None
    if existing and existing.get("select") != select:
        raise UserError(f"{out} holds features of the records chosen by {existing.get('select') or 'no --newest'}, "
                        f"not {select or 'no --newest'}: resume it with the same choice, or use a new --out folder")
    records = read_records(Path(args.data), select=select)
    if not records:
        raise UserError(f"{args.data}: no datagen records with answers (run `verispec dspark datagen` first)")
    out.mkdir(parents=True, exist_ok=True)
    plan = getattr(args, "plan", "served")
    loaded = load_target(args.model, args.dtype, plan)
    args_m = loaded.model.args
    taps = [int(t) for t in args.taps.split(",")] if args.taps else default_taps(args_m.num_layers)
    kind = {"plan": plan, "head_kernel": head_kernel(loaded), "dtype": str(loaded.model.dtype).removeprefix("torch.")}
    manifest = existing or {**kind,
        "version": VERSION, "target": str(loaded.folder), "target_name": loaded.name, "target_layer_ids": taps,
        "hidden_size": args_m.hidden_size, "num_target_layers": args_m.num_layers, "vocab_size": args_m.vocab_size,
        "data": str(Path(args.data).resolve()), "shard_size": args.shard_size, "shards": [], "records": 0,
        "tokens": 0, "bytes": 0, "complete": False, "store": store,
        **({"select": select} if select else {}),
    }
    if manifest.get("target_name") and manifest["target_name"] != loaded.name:
        raise UserError(f"{out} holds features of {manifest['target_name']}, not {loaded.name}: to resume it, "
                        f"-m {manifest['target_name']}; for {loaded.name}, a new --out folder")
    if manifest["target_layer_ids"] != taps or manifest["hidden_size"] != args_m.hidden_size:
        raise UserError(f"{out} holds features for taps {manifest['target_layer_ids']} of another target or tap set; "
                        "use a new --out folder")
    if _target_as(manifest) != _target_as(kind):
        raise UserError(f"{out} holds features of the target as {_target_as(manifest)}, not {_target_as(kind)}: "
                        f"a folder holds one kind; use a new --out folder or --plan {_target_as(manifest)[0]}")
    start = manifest["records"]
    todo = records[start:]
    print(f"features: {start} of {len(records)} records already in {out}; taps {taps}", file=sys.stderr)
    t0 = time.perf_counter()
    with tqdm(total=len(records), initial=start, unit="seq", desc="features", file=sys.stderr,
              disable=args.quiet) as bar:
        for shard_start in range(0, len(todo), manifest["shard_size"]):
            batch = todo[shard_start : shard_start + manifest["shard_size"]]
            parts = []
            for record in batch:
                parts.append(sequence_features(loaded.model, record["prompt_ids"], record["answer_ids"], taps))
                bar.update(1)
            tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            tensors["offsets"] = torch.tensor([0] + [len(p["input_ids"]) for p in parts]).cumsum(0)
            save_shard(out, manifest, encode(tensors, store, len(taps)), len(batch))
    manifest["complete"] = manifest["records"] == len(records)
    write_manifest(out, manifest)
    _report(manifest, t0, out)
    return 0


def _report(manifest: dict, t0: float, out: Path) -> None:
    print(f"features: {manifest['records']} sequences, {manifest['tokens']} tokens, "
          f"{manifest['bytes'] / 2**30:.2f} GiB on disk as {store_of(manifest)} "
          f"({manifest['bytes'] / max(1, manifest['tokens']) / 1024:.1f} KiB per token), "
          f"{time.perf_counter() - t0:.0f} s this run -> {out}", file=sys.stderr)


def recast_folder(source: Path, out: Path, store: str, manifest: dict | None, quiet: bool = False) -> int:
    """`dspark features --from-features SOURCE --out OUT --store S`: SOURCE's shards rewritten in
    another store, shard by shard and resumable, with no target forward (bf16 -> fp8 halves
    the disk; fp8 -> bf16 gives the dequantized values, not the original bits). `manifest`: OUT's,
    where a recast into it has begun."""
    from tqdm.auto import tqdm
    from safetensors import safe_open

    manifest_in = load_manifest(source)
    if manifest_in is None:
        raise UserError(f"{source}: no {MANIFEST} (run `verispec dspark features` first)")
    if source.resolve() == out.resolve():
        raise UserError("--from-features and --out are the same folder: recast into a new one")
    out.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {**manifest_in, "shards": [], "records": 0, "tokens": 0, "bytes": 0, "complete": False,
                    "store": store, "recast_from": str(source.resolve())}
    elif manifest.get("recast_from") != str(source.resolve()):
        raise UserError(f"{out} holds features that were not recast from {source}; use a new --out folder")
    num_taps = len(manifest_in["target_layer_ids"])
    t0 = time.perf_counter()
    todo = manifest_in["shards"][len(manifest["shards"]):]
    with tqdm(total=len(manifest_in["shards"]), initial=len(manifest["shards"]), unit="shard", desc="recast",
              file=sys.stderr, disable=quiet) as bar:
        for shard in todo:
            with safe_open(str(source / shard["file"]), "pt") as f:
                tensors = decode(f)
            save_shard(out, manifest, encode(tensors, store, num_taps), shard["records"])
            bar.update(1)
    manifest["complete"] = manifest_in.get("complete", False) and len(manifest["shards"]) == len(manifest_in["shards"])
    write_manifest(out, manifest)
    _report(manifest, t0, out)
    return 0


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # float [T]
    taps: torch.Tensor  # bf16 [T, m*H]
    last_hidden: torch.Tensor  # bf16 [T, H]
    lse: torch.Tensor  # fp32 [T]


class TargetFeatures:
    """The samples a FeatureCache of `records` would hold, computed when asked for: a
    teacher-forced target forward per access, nothing on disk. Same interface as FeatureCache
    (len, [i], answer_tokens, manifest, folder_ranges); several record lists are mixed in order."""

    def __init__(self, record_lists: list[list[dict]], loaded, taps: list[int], plan: str):
        args_m = loaded.model.args
        self.model, self.taps = loaded.model, taps
        self.records = [r for records in record_lists for r in records]
        self.folder_ranges, start = [], 0
        for records in record_lists:
            self.folder_ranges.append((start, start + len(records)))
            start += len(records)
        self.manifest = {"version": VERSION, "target": str(loaded.folder), "target_name": loaded.name,
                         "target_layer_ids": taps, "hidden_size": args_m.hidden_size,
                         "num_target_layers": args_m.num_layers, "vocab_size": args_m.vocab_size,
                         "records": len(self.records), "on_the_fly": True, "plan": plan,
                         "head_kernel": head_kernel(loaded)}

    def __len__(self) -> int:
        return len(self.records)

    def answer_tokens(self, i: int) -> list[int]:
        return list(self.records[i]["answer_ids"])

    def __getitem__(self, i: int) -> Sample:
        r = self.records[i]
        f = sequence_features(self.model, r["prompt_ids"], r["answer_ids"], self.taps)
        # clones outside inference mode: autograd may save them for the drafter's backward
        return Sample(input_ids=f["input_ids"].long(), loss_mask=f["loss_mask"].float(), taps=f["taps"].clone(),
                      last_hidden=f["last_hidden"].clone(), lse=f["lse"].clone())


def target_features(data: str, model: str | None, dtype: str, taps: str | None, plan: str = "served") -> TargetFeatures:
    """`dspark train --data`: datagen files or packs (comma-separated, mixed in order) with the
    target loaded as `dspark features` loads it, tapped at `taps` (default: DeepSpec's spacing)."""
    lists = []
    for path in data.split(","):
        records = read_records(Path(path))
        if not records:
            raise UserError(f"{path}: no datagen records with answers (run `verispec dspark datagen` first)")
        lists.append(records)
    loaded = load_target(model, dtype, plan)
    chosen = [int(t) for t in taps.split(",")] if taps else default_taps(loaded.model.args.num_layers)
    return TargetFeatures(lists, loaded, chosen, plan)


def _target_as(manifest: dict) -> tuple[str, str]:
    """(plan, head) a features folder was computed with: the served head's kernel, or "float"
    for PyTorch's kernels (folders made before --plan are those)."""
    plan = manifest.get("plan", "dtype")
    return plan, manifest.get("head_kernel", "aten") if plan == "served" else "float"


class FeatureCache:
    """Random access to the samples of one or more features folders (memory-mapped shards;
    several folders must hold features of the same target and taps, and are mixed)."""

    def __init__(self, folders):
        folders = [Path(f) for f in (folders if isinstance(folders, (list, tuple)) else [folders])]
        self.index = []  # (shard path, start, end)
        self.folder_ranges = []  # [start, end) of each folder's samples in the index
        self._files = {}
        self.manifest = None
        for folder in folders:
            manifest = load_manifest(folder)
            if manifest is None:
                raise UserError(f"{folder}: no {MANIFEST} (run `verispec dspark features` first)")
            if self.manifest is not None and (manifest["target_layer_ids"] != self.manifest["target_layer_ids"]
                                              or manifest["target"] != self.manifest["target"]):
                raise UserError(f"{folder} holds features of another target or other taps than {folders[0]}")
            if self.manifest is not None and _target_as(manifest) != _target_as(self.manifest):
                raise UserError(f"{folder} holds features of the target as {_target_as(manifest)}, {folders[0]} as "
                                f"{_target_as(self.manifest)}: recompute one of them with the other's --plan")
            self.manifest = self.manifest or manifest
            first = len(self.index)
            for shard in manifest["shards"]:
                with safe_open(str(folder / shard["file"]), "pt") as f:
                    offsets = f.get_tensor("offsets").tolist()
                self.index.extend((folder / shard["file"], a, b) for a, b in zip(offsets, offsets[1:]))
            self.folder_ranges.append((first, len(self.index)))

    def __len__(self) -> int:
        return len(self.index)

    def answer_tokens(self, i: int) -> list[int]:
        name, a, b = self.index[i]
        f = self._open(name)
        ids, mask = f.get_slice("input_ids")[a:b], f.get_slice("loss_mask")[a:b]
        return ids[mask > 0].tolist()

    def _open(self, path: Path):
        handle = self._files.get(path)
        if handle is None:
            handle = self._files[path] = safe_open(str(path), "pt")
        return handle

    def __getitem__(self, i: int) -> Sample:
        name, a, b = self.index[i]
        f = self._open(name)
        return Sample(
            input_ids=f.get_slice("input_ids")[a:b].long(),
            loss_mask=f.get_slice("loss_mask")[a:b].float(),
            taps=read_rows(f, "taps", a, b),
            last_hidden=read_rows(f, "last_hidden", a, b),
            lse=f.get_slice("lse")[a:b],
        )
