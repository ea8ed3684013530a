"""`verispec dspark train`: DeepSpec's recipe (dspark-spec.md §6.2), scaled down to one CPU box.

* The drafter is built from the target's config (DSparkConfig.from_target) and initialized
  as DeepSpec's trainer does: normal(0, initializer_range) weights, zero biases, unit
  norms; the embedding and the output head are frozen copies of the target's (the head's
  rows of the draft vocabulary, when the drafter has one: the `--draft-vocab` most frequent
  answer tokens of the training data).
* Each sequence contributes up to `--anchors` random anchor blocks (only where the anchor
  and its first label are answer tokens); the loss is 0.1 CE + 0.9 L1 + 1.0 BCE with
  exp(-j/4) position weights (loss.py), as weighted means over the whole global batch.
* AdamW (lr 2e-3 by default, no weight decay), linear warm-up over 4% of the steps then cosine to 0,
  gradient clipping at 1.0, float32 master weights, the forward under bf16 autocast where the
  CPU measures it faster (`--precision`, training/dspark/precision.py: 1.8 s against 3.6 s a
  step on an AVX512-BF16 host, 50 s against 2.4 s on an AVX2-only one, where it is emulated).
  DeepSpec's 6e-4 is tuned for 512-sequence batches over 24k steps; with 16-sequence
  batches and ~2k steps, 2e-3 learned faster here (training acceptance at step 100,
  slots 1-4: 0.18/0.13/0.13/0.11 against 0.17/0.09/0.09/0.08 at 6e-4; README).
* Data order: a permutation per epoch (seed + epoch); a global batch of `--batch`
  sequences is split across ranks (rank r takes every world-size-th) and processed one
  sequence per micro-step. Anchors depend only on (seed, epoch, sample), and every
  micro-step's loss is divided by the global batch's weight sums (computed from the data
  before the forward and all-reduced), so 1 process and N processes take the same steps.
* Under `torchrun` it runs DistributedDataParallel (gloo on CPU, nccl on GPU).
* Checkpoints every `--save-every` steps and at the end: `step_<n>/` in DeepSpec's format
  (config.json + model.safetensors, frozen copies left out) plus the trainer state
  (`trainer/`: float32 weights, AdamW moments, step; safetensors + JSON, never pickles); `latest`
  names the newest. Rerunning the same command resumes from it. A metrics log
  (metrics.jsonl) and PNG curves (curves.png) are written alongside.

* The target's features come from a cache (`--features`, `verispec dspark features`) or are
  computed on the fly from datagen's records (`--data`: a target forward per sequence per
  epoch, no disk; features.TargetFeatures), the same samples either way.

* Validation (held-out sequences, `--holdout`): the uniform teacher-forced acceptance DeepSpec
  reports, and the same answers walked as live decoding walks them (walk.py: a block at every
  anchor, each round starting after what the last kept), which is what live tau follows.

* `--init-from` starts a run from a drafter's weights (warm_start): a fresh optimizer and
  schedule over them, validated at step 0, so a committed drafter is the campaign's state
  between sessions.

Checked by tests/test_dspark_train.py: the loss goes down on a small cache, a resumed
run continues exactly where it stopped, a warm restart starts from the drafter's exact
weights and refuses a drafter that reads other taps, 2 processes under torchrun end with the same
weights as 1 process with the same global batch, training on the fly ends with the
weights of training on the cache, and the walked greedy tau of the target's own greedy answers
is the tau live T=0 decoding keeps on them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec.errors import UserError
from verispec.training.dspark import walk
from verispec.training.dspark.forward import block_labels, sample_anchors, train_forward
from verispec.training.dspark.loss import dspark_loss, weight_sums
from verispec.training.dspark.precision import training_precision

DEFAULT_DRAFT_VOCAB = 16384  # a fresh run's draft head rows (`--draft-vocab`)
WIDEN_BELOW = 0.97  # a warm drafter whose vocabulary covers less of the data is told it can be widened
STATE = "trainer/state.safetensors"  # a subfolder: the model folder itself holds only the model


def answer_token_counts(cache) -> Counter:
    counts = Counter()
    for i in range(len(cache)):
        counts.update(cache.answer_tokens(i))
    return counts


def vocabulary_coverage(counts: Counter, ids) -> float:
    """The share of the counted answer tokens that `ids` hold."""
    return sum(counts[int(t)] for t in ids) / max(1, sum(counts.values()))


def draft_vocabulary(cache, size: int, always=()) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens of the cache (and `always`), sorted ids, and
    the share of answer tokens they cover."""
    counts = answer_token_counts(cache)
    must = {int(t) for t in always}
    chosen = [t for t, _ in counts.most_common(size) if t not in must][: size - len(must)]
    ids = sorted(set(chosen) | must)
    return torch.tensor(ids, dtype=torch.long), vocabulary_coverage(counts, ids)


def init_drafter(drafter, target_folder: Path, std: float, seed: int) -> None:
    """DeepSpec's init: normal(0, std) weights, zero biases, unit norms (gemma's (1 + w)
    norms start at w = 0); embedding and head copied from the target and frozen. Seeded:
    every rank, and every rerun, starts from the same weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(0.0 if drafter.config.args.norm_offset else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    copy_frozen(drafter, target_folder)


def warm_start(source: str, manifest: dict, target_folder: Path):
    """The drafter `--init-from` names (a drafter folder, a train run folder: its newest
    checkpoint, or a bundled model's name: its shipped drafter), checked against the
    features' target and taps. Training continues from its weights with a fresh optimizer
    and a fresh warm-up + cosine schedule: a warm restart, which is how a committed drafter
    carries a campaign to the next session without a trainer state in the repository."""
    from types import SimpleNamespace

    from verispec.drafting.dspark.checkpoint import check_compatible, draft_kind, load_dspark
    from verispec.drafting.dspark.config import DraftCheckpointError
    from verispec.drafting.factory import named_drafter
    from verispec.models.config import from_hf_config, read_config

    folder = named_drafter(source, "--init-from")
    target = SimpleNamespace(folder=target_folder, model=SimpleNamespace(args=from_hf_config(read_config(target_folder))))
    try:
        if draft_kind(folder) != "dspark":
            raise DraftCheckpointError(f"{folder} is not a DSpark drafter")
        drafter = load_dspark(folder, target=target, prepare=False)
        check_compatible(drafter.config, target.model.args)
    except DraftCheckpointError as e:
        raise UserError(f"--init-from {source}: {e}") from None
    if list(drafter.config.target_layer_ids) != list(manifest["target_layer_ids"]):
        raise UserError(f"--init-from {source}: the drafter reads target layers {list(drafter.config.target_layer_ids)}, "
                        f"the features hold {manifest['target_layer_ids']}")
    return drafter


def _widens(args, warm) -> bool:
    """Whether `--draft-vocab` asks to widen the warm drafter's draft vocabulary (refused: narrowing
    it, or widening it to the full vocabulary, which is another head layout)."""
    size = getattr(args, "draft_vocab", None)
    if size is None or warm.draft_vocab_ids is None:
        return False
    have = len(warm.draft_vocab_ids)
    if size == 0 or size >= warm.config.args.vocab_size:
        raise UserError(f"--init-from {args.init_from}: its draft vocabulary has {have} tokens; it can be widened to "
                        f"a larger subset (--draft-vocab N, N < {warm.config.args.vocab_size}), not to the full vocabulary")
    if size < have:
        raise UserError(f"--init-from {args.init_from}: its draft vocabulary has {have} tokens; --draft-vocab {size} "
                        "would drop some of them (it can be kept or widened, not narrowed)")
    return size > have


def widen_vocabulary(warm, vocab: torch.Tensor):
    """A drafter like `warm` whose draft vocabulary is `vocab` (sorted target ids, a superset of
    warm's). Every tensor over the draft vocabulary keeps each old token's row: the Markov head's
    previous-token rows (a joining token takes the row it shared as an outside token, so it
    embeds as before) and its output rows (a joining token starts at their mean). Head rows are
    the target's, copied by `copy_frozen`. On the old tokens' rows the widened drafter computes
    what `warm` did (tests/test_dspark_train.py checks it)."""
    from verispec.drafting.dspark.config import DSparkConfig
    from verispec.drafting.dspark.model import DSparkDrafter

    old = warm.draft_vocab_ids.tolist()
    where = {t: i for i, t in enumerate(old)}
    source = torch.tensor([where.get(int(t), -1) for t in vocab.tolist()])
    kept = source >= 0
    if int(kept.sum()) != len(old):
        raise ValueError("a widened draft vocabulary must hold every token of the old one")
    drafter = DSparkDrafter(DSparkConfig.from_dict({**warm.config.raw, "draft_vocab_size": len(vocab)}))
    state = warm.state_dict()
    with torch.no_grad():
        for name, new in drafter.state_dict().items():
            w = state[name].to(new.dtype)
            if name == "draft_vocab_ids":
                new.copy_(vocab)
            elif w.shape == new.shape:
                new.copy_(w)
            elif w.shape[1:] == new.shape[1:] and w.shape[0] == len(old) + 1 and new.shape[0] == len(vocab) + 1:
                body = new[:-1]  # previous-token rows: the last is shared by every token outside
                body[kept] = w[source[kept]]
                body[~kept] = w[-1]
                new[-1] = w[-1]
            elif w.shape[1:] == new.shape[1:] and w.shape[0] == len(old) and new.shape[0] == len(vocab):
                new[kept] = w[source[kept]]
                new[~kept] = w.mean(dim=0)
            else:
                raise ValueError(f"{name}: no rule to widen {tuple(w.shape)} to {tuple(new.shape)}")
    return drafter


def _deepens(args, warm) -> bool:
    """Whether `--layers` asks to deepen the warm drafter (refused: fewer layers than it has,
    which would drop what it learnt)."""
    layers, have = getattr(args, "layers", None), warm.config.args.num_layers
    if layers is None or layers == have:
        return False
    if layers < have:
        raise UserError(f"--init-from {args.init_from}: it has {have} draft layers; --layers {layers} would drop some "
                        "of them (they can be kept or deepened, not removed)")
    return True


def deepen(warm, layers: int):
    """A drafter like `warm` with `layers` draft layers: warm's own, then copies of its last
    whose residual branches start at zero, so that it computes what `warm` did and training
    starts from there (the question a deeper warm restart answers is whether capacity limits
    the drafter, not whether a fresh layer can catch up). A branch is zeroed where its output
    enters the residual stream: the attention's and the MLP's output projections, or, on a
    family with sandwich norms (gemma), the norms that scale those outputs (an RMSNorm of a zero
    vector has an unbounded gradient; a zero scale has a plain one). A copied gemma4 layer's
    stored output scale is 1. tests/test_dspark_families.py checks the slot logits, confidences
    and block hidden states against `warm`'s own for every family; tests/test_dspark_train.py
    the CLI."""
    from verispec.drafting.dspark.config import DSparkConfig
    from verispec.drafting.dspark.model import DSparkDrafter

    have = warm.config.args.num_layers
    drafter = DSparkDrafter(DSparkConfig.from_dict(
        {**warm.config.raw, "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers}))
    state = warm.state_dict()
    with torch.no_grad():
        for name, new in drafter.state_dict().items():
            if not name.startswith("layers."):
                new.copy_(state[name])
                continue
            _, index, rest = name.split(".", 2)
            new.copy_(state[f"layers.{min(int(index), have - 1)}.{rest}"])
        for layer in drafter.layers[have:]:
            if layer.sandwich:
                for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                    norm.weight.fill_(-norm.offset if norm.offset else 0.0)
            else:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
            if layer.scaled:
                layer.layer_scalar.fill_(1.0)
    return drafter


def copy_frozen(drafter, target_folder: Path) -> None:
    """The frozen embedding and head: the target's (head rows of the draft vocabulary)."""
    from types import SimpleNamespace

    from verispec.models.config import from_hf_config
    from verispec.models.config import read_config
    from verispec.drafting.dspark.checkpoint import frozen_from_target

    args = from_hf_config(read_config(target_folder))  # the target's own: does it tie its head?
    target = SimpleNamespace(folder=target_folder, model=SimpleNamespace(args=args))
    tensors = {} if drafter.draft_vocab_ids is None else {"draft_vocab_ids": drafter.draft_vocab_ids}
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(frozen_from_target(target, "embed_tokens.weight", tensors))
        drafter.lm_head.weight.copy_(frozen_from_target(target, "lm_head.weight", tensors))
    drafter.embed_tokens.requires_grad_(False)
    drafter.lm_head.requires_grad_(False)


class Distributed:
    """torchrun's environment, or a single process."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1:
            import torch.distributed as dist

            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
            self.dist = dist
        else:
            self.dist = None

    def all_sum(self, values: list[float]) -> list[float]:
        if self.dist is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.dist is not None:
            self.dist.barrier()

    def close(self):
        """Tear the group down with every rank at the same point and nothing still holding
        it: a DDP reducer that outlives the group is destroyed at interpreter exit, where
        gloo's joinable threads abort the process ("terminate called without an active
        exception", seen in CI on one run of tests/test_dspark_train.py in ~10)."""
        if self.dist is None:
            return
        gc.collect()
        self.dist.barrier()
        self.dist.destroy_process_group()


def limited(train_ids: list[int], folder_ranges: list[tuple[int, int]], limit: int) -> list[int]:
    """The first `limit` training sequences, shared evenly between the sources (folders or
    files; the first takes the remainder): nested subsets of one data set for a scaling curve,
    and a mix of two sets in equal parts."""
    sources = [[i for i in train_ids if a <= i < b] for a, b in folder_ranges]
    quota = [limit // len(sources) + (k < limit % len(sources)) for k in range(len(sources))]
    for k, have in enumerate(sources):  # a short source leaves its quota to the others
        if len(have) < quota[k]:
            spare, quota[k] = quota[k] - len(have), len(have)
            for j in range(len(sources)):
                extra = min(spare, len(sources[j]) - quota[j])
                quota[j] += extra
                spare -= extra
    return sorted(i for have, q in zip(sources, quota) for i in have[:q])


def split_ids(folder_ranges: list[tuple[int, int]], holdout: int, train_folders: str | None,
              limit: int | None) -> tuple[list[int], list[int]]:
    """(held-out ids, training ids): the last `holdout` of the first folder are held out whatever
    is trained on; training takes the `train_folders` (all by default), at most `limit` of them."""
    end_first = folder_ranges[0][1]
    held = list(range(end_first - holdout, end_first)) if holdout else []
    ranges = training_folders(folder_ranges, train_folders)
    skip = set(held)
    train_ids = [i for a, b in ranges for i in range(a, b) if i not in skip]
    if limit:
        train_ids = limited(train_ids, ranges, limit)
    return held, train_ids


def training_folders(folder_ranges: list[tuple[int, int]], spec: str | None) -> list[tuple[int, int]]:
    """The [start, end) ranges of the folders `--train-folders` names (1-based, comma-separated;
    None: all of them)."""
    if not spec:
        return list(folder_ranges)
    try:
        picks = sorted({int(k) for k in spec.split(",")})
    except ValueError:
        raise UserError(f"--train-folders takes 1-based folder numbers, comma-separated, not {spec!r}") from None
    if not picks or picks[0] < 1 or picks[-1] > len(folder_ranges):
        raise UserError(f"--train-folders {spec}: there are {len(folder_ranges)} --features folders (1 to "
                        f"{len(folder_ranges)})")
    return [folder_ranges[k - 1] for k in picks]


def lr_at(step: int, total: int, peak: float, warmup_ratio: float = 0.04) -> float:
    """DeepSpec's CosineAnnealingWarmupLR: lr (t+1)/W for W = int(0.04 total) steps, then cosine to 0."""
    warmup = int(warmup_ratio * total)
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@dataclass
class TrainRun:
    """Everything one training run holds between steps."""

    args: object
    world: Distributed
    cache: object  # FeatureCache
    out: Path
    config: object  # DSparkConfig
    drafter: torch.nn.Module
    view: torch.nn.Module  # what a micro-step calls: the TrainingView, under DDP when distributed
    target_head: torch.nn.Linear
    optimizer: torch.optim.Optimizer
    params: list
    holdout: list[int]
    train_ids: list[int]
    steps_per_epoch: int
    total: int
    step: int
    deadline: float | None
    precision: str = "bf16"  # the forward's: "bf16" (autocast) or "fp32"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"


def setup(args) -> TrainRun:
    """The drafter (fresh, or resumed from the run's newest checkpoint), its optimizer and
    the data split."""
    from verispec.drafting.dspark.config import DSparkConfig
    from verispec.drafting.dspark.model import DSparkDrafter
    from verispec.models.config import read_config
    from verispec.training.dspark.features import FeatureCache, target_features
    from verispec.training.dspark.forward import TrainingView

    if args.threads:
        torch.set_num_threads(args.threads)
    world = Distributed()
    if bool(args.features) == bool(getattr(args, "data", None)):
        raise UserError("give --data (target features computed on the fly) or --features (a features cache), not both")
    if args.features:
        cache = FeatureCache([Path(f) for f in args.features.split(",")])
    else:
        cache = target_features(args.data, args.model, args.dtype, args.taps, getattr(args, "plan", "served"))
    manifest = cache.manifest
    out = Path(args.out)
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    world.barrier()
    target_folder = Path(manifest["target"])
    target_config = read_config(target_folder)
    latest = _latest(out)
    warm = None if latest is not None or not getattr(args, "init_from", None) else warm_start(
        args.init_from, manifest, target_folder)
    if latest is not None:
        config = DSparkConfig.from_dict(json.loads((latest / "config.json").read_text()))
    elif warm is not None:
        note = ""
        if _widens(args, warm):
            vocab, covered = draft_vocabulary(cache, args.draft_vocab, always=warm.draft_vocab_ids.tolist())
            warm = widen_vocabulary(warm, vocab)
            note = f", widened: it covers {covered:.1%} of the answer tokens"
        elif warm.draft_vocab_ids is not None:
            covered = vocabulary_coverage(answer_token_counts(cache), warm.draft_vocab_ids.tolist())
            note = f", covering {covered:.1%} of the answer tokens"
            if covered < WIDEN_BELOW:  # a token outside the draft vocabulary can never be drafted
                note += " (a larger --draft-vocab widens it)"
        deepened = ""
        if _deepens(args, warm):
            deepened = f", deepened from {warm.config.args.num_layers}"
            warm = deepen(warm, args.layers)
        config = warm.config
        if world.main:
            print(f"train: starting from the weights of {args.init_from} ({config.args.num_layers} draft layers{deepened}, "
                  f"draft vocabulary {config.draft_vocab_size or 'full'}{note}"
                  "; its head options, not this command's), a fresh optimizer and schedule", file=sys.stderr)
    else:
        vocab = None
        args.draft_vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
        if args.draft_vocab and args.draft_vocab < manifest["vocab_size"]:
            eos = target_config.get("eos_token_id")
            vocab, coverage = draft_vocabulary(cache, args.draft_vocab,
                                               always=[eos] if isinstance(eos, int) else (eos or []))
            if world.main:
                print(f"train: draft vocabulary of {len(vocab)} tokens covers {coverage:.1%} of the answer tokens",
                      file=sys.stderr)
        config = DSparkConfig.from_target(
            target_config, num_draft_layers=args.layers or 1, block_size=args.block_size,
            target_layer_ids=manifest["target_layer_ids"], mask_token_id=args.mask_token_id,
            markov_rank=args.markov_rank, markov_head_type=args.head, enable_confidence_head=args.markov_rank > 0,
            confidence_head_with_markov=args.markov_rank > 0, num_anchors=args.anchors,
            draft_vocab_size=None if vocab is None else len(vocab),
            markov_vocab=getattr(args, "markov_vocab", "full"))
    drafter = DSparkDrafter(config)
    if warm is not None:
        with torch.no_grad():
            drafter.load_state_dict(warm.state_dict(), strict=True)
        copy_frozen(drafter, target_folder)
    elif latest is None:
        if drafter.draft_vocab_ids is not None:
            drafter.draft_vocab_ids.copy_(vocab)
        init_drafter(drafter, target_folder, float(target_config.get("initializer_range", 0.02)), args.seed)
    else:
        _load_state_into(drafter, latest, target_folder)
    drafter.train()
    target_head = torch.nn.Linear(config.args.hidden_size, drafter.lm_head.out_features, bias=False)
    target_head.weight.data.copy_(drafter.lm_head.weight)  # the target's own (frozen) head rows
    target_head.requires_grad_(False)
    target_head = served_target_head(target_head, manifest.get("head_kernel", "aten"))

    view = TrainingView(drafter)
    if world.dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        view = DistributedDataParallel(view)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    # held-out sequences: the last of the FIRST features folder (the regenerated answers, what
    # the drafter meets when serving), whatever else is mixed in
    holdout, train_ids = split_ids(cache.folder_ranges, args.holdout, getattr(args, "train_folders", None),
                                   getattr(args, "limit", None))
    steps_per_epoch = len(train_ids) // args.batch
    if steps_per_epoch == 0:
        raise UserError(f"{len(cache)} sequences do not make one global batch of {args.batch}")
    total = args.steps or steps_per_epoch * args.epochs
    step = _load_optimizer(optimizer, params, drafter, latest) if latest is not None else 0
    precision, why = training_precision("fp32" if getattr(args, "fp32", False) else getattr(args, "precision", "auto"), drafter.device)
    if world.all_sum([float(precision == "bf16")])[0] not in (0.0, world.world):
        precision, why = "fp32", "the ranks measured differently"  # every rank computes alike
    if world.main:
        print(f"train: {len(cache)} sequences, {total} steps of {args.batch} (world {world.world}), "
              f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, starting at step {step}; "
              f"forward in {precision} ({why})", file=sys.stderr)
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else None
    return TrainRun(args, world, cache, out, config, drafter, view, target_head, optimizer, params, holdout,
                    train_ids, steps_per_epoch, total, step, deadline, precision)


def train_step(run: TrainRun) -> dict:
    """One global batch: this rank's sequences one micro-step each, gradients synced on
    the last, one optimizer step. Returns the step's metrics record."""
    args, world, vocab_ids = run.args, run.world, run.drafter.draft_vocab_ids
    epoch, within = divmod(run.step, run.steps_per_epoch)
    order = [run.train_ids[i] for i in
             torch.randperm(len(run.train_ids), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()]
    batch = order[within * args.batch : (within + 1) * args.batch]
    mine = batch[world.rank :: world.world]
    t0 = time.perf_counter()
    prepared = []
    local = {"ce": 0.0, "other": 0.0}
    for index in mine:
        sample = run.cache[index]
        g = torch.Generator().manual_seed(hash((args.seed, epoch, index)) % (2**63))
        anchors, keep = sample_anchors(sample.loss_mask, args.anchors, g)
        ids, mask = sample.input_ids[None], sample.loss_mask[None]
        target_ids, eval_mask, _ = block_labels(ids, mask, anchors[None], keep[None], run.config.block_size)
        sums = weight_sums(eval_mask, target_ids, draft_vocab_ids=vocab_ids)
        local = {k: local[k] + sums[k] for k in local}
        prepared.append((sample, anchors, keep))
    dens = dict(zip(local, world.all_sum([local["ce"], local["other"]])))
    lr = lr_at(run.step, run.total, args.lr)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    autocast = (torch.autocast(run.drafter.device.type, dtype=torch.bfloat16) if run.precision == "bf16"
                else contextlib.nullcontext())
    totals = Counter()
    tokens = 0
    for i, (sample, anchors, keep) in enumerate(prepared):
        sync = world.dist is None or i == len(prepared) - 1
        with contextlib.nullcontext() if sync else run.view.no_sync():
            with autocast:
                out = run.view(sample.input_ids[None], sample.taps[None], sample.loss_mask[None], anchors[None],
                               keep[None], sample.last_hidden[None], run.target_head, sample.lse[None])
            terms = dspark_loss(out, draft_vocab_ids=vocab_ids, denominators=dens, world_size=world.world)
            terms.loss.backward()
        share = {"ce": terms.ce, "l1": terms.l1, "confidence": terms.confidence}
        weight = float(terms.weight_mask.sum())
        for k, v in share.items():
            totals[k] += v * weight
        for j, a in enumerate(terms.accept_rate_by_position):
            totals[f"accept@{j}"] += a * weight
        totals["weight"] += weight
        tokens += len(sample.input_ids)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, args.clip))
    run.optimizer.step()
    run.step += 1
    record = _record(run.step, epoch, lr, grad_norm, totals, world, tokens, time.perf_counter() - t0)
    if world.main:
        with run.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def checkpoint(run: TrainRun) -> None:
    """Save the step (DeepSpec format + trainer state), validate on the held-out
    sequences, redraw the curves; every rank waits for it."""
    if run.world.main:
        _save(run.drafter, run.optimizer, run.params, run.out, run.step)
        validate_holdout(run)
        _plot(run.metrics_path, run.out / "curves.png")
    run.world.barrier()


def validate_holdout(run: TrainRun) -> None:
    """Append the held-out teacher-forced acceptance at this step to validation.jsonl."""
    if not run.holdout:
        return
    val = validate(run.drafter, run.cache, run.holdout, run.target_head, run.args.anchors,
                   run.drafter.draft_vocab_ids, run.args.seed)
    with (run.out / "validation.jsonl").open("a") as f:
        f.write(json.dumps({"step": run.step, **val}) + "\n")
    print(f"validation at step {run.step}: teacher-forced acceptance {val['accept_by_position']} "
          f"tau {val['tau_probabilistic']:.3f}; walked as live decoding walks: tau {val['tau_walk']:.3f} "
          f"(T=1), {val['tau_walk_greedy']:.3f} (T=0)", file=sys.stderr, flush=True)


def run_train(args) -> int:
    run = setup(args)
    args, world = run.args, run.world
    if run.step == 0 and getattr(args, "init_from", None) and world.main:
        validate_holdout(run)  # where the warm restart starts: step 0 of validation.jsonl
    while run.step < run.total:
        record = train_step(run)
        if world.main and (run.step % args.log_every == 0 or run.step == run.total):
            print(f"step {run.step}/{run.total} loss {record['loss']:.4f} (ce {record['ce']:.3f} l1 {record['l1']:.3f} "
                  f"bce {record['confidence']:.3f}) accept {record['accept_by_position'][:4]} lr {record['lr']:.2e} "
                  f"{record['seconds']:.1f}s", file=sys.stderr, flush=True)
        # stop early (resumable) at --stop-at or when the time budget is spent; ranks agree
        stop = run.step == args.stop_at or (
            run.deadline is not None and world.all_sum([float(time.monotonic() > run.deadline)])[0] > 0)
        if run.step % args.save_every == 0 or run.step == run.total or stop:
            checkpoint(run)
        if stop:
            if world.main:
                print(f"train: stopped at step {run.step} of {run.total}; rerun the same command to continue",
                      file=sys.stderr)
            break
    run.view = None  # the DDP reducer holds the process group
    world.close()
    return 0


@torch.no_grad()
def validate(drafter, cache, indices, target_head, anchors: int, vocab_ids, seed: int) -> dict:
    """Teacher-forced acceptance on held-out sequences (fixed anchors): mean c* per slot and
    tau_probabilistic, the loss module's analytic acceptance at temperature 1; and tau_walk /
    tau_walk_greedy, the same sequences walked as live decoding walks them at T=1 and T=0
    (walk.py; tokens over rounds, summed over the sequences)."""
    was_training = drafter.training
    drafter.eval()
    accept, weight, taus, walk_sums = None, 0.0, [], None
    for index in indices:
        sample = cache[index]
        a, keep = sample_anchors(sample.loss_mask, anchors, torch.Generator().manual_seed(seed + index))
        out = train_forward(drafter, sample.input_ids[None], sample.taps[None], sample.loss_mask[None], a[None],
                                    keep[None], sample.last_hidden[None], target_head, sample.lse[None])
        terms = dspark_loss(out, draft_vocab_ids=vocab_ids)
        n = float(out.eval_mask.sum())
        rates = torch.tensor(terms.accept_rate_by_position)
        accept = rates * n if accept is None else accept + rates * n
        weight += n
        if terms.tau_probabilistic == terms.tau_probabilistic:
            taus.append(terms.tau_probabilistic)
        walked = _walk(drafter, sample, target_head, vocab_ids)
        walk_sums = walked if walk_sums is None else [x + y for x, y in zip(walk_sums, walked)]
    drafter.train(was_training)
    tokens, rounds, greedy_rounds = walk_sums or (0.0, 0.0, 0.0)
    return {"accept_by_position": [round(float(x), 4) for x in accept / max(weight, 1)],
            "tau_probabilistic": sum(taus) / max(len(taus), 1), "sequences": len(indices),
            "tau_walk": tokens / rounds if rounds else math.nan,
            "tau_walk_greedy": tokens / greedy_rounds if greedy_rounds else math.nan}


def _walk(drafter, sample, target_head, vocab_ids, chunk: int = 128) -> list[float]:
    """(tokens, expected rounds at T=1, rounds at T=0) of walk.py's live-like walk over every
    anchor of one held-out sequence. A block sees only the context before its anchor, so the
    anchors go through in chunks (`chunk` blocks of vocabulary-wide logits at a time) with
    the same values as all at once."""
    anchors, keep = walk.all_anchors(sample.loss_mask)
    if not len(anchors):
        return [0.0, 0.0, 0.0]
    c_star, greedy = [], []
    for part, kept in zip(anchors.split(chunk), keep.split(chunk)):
        out = train_forward(drafter, sample.input_ids[None], sample.taps[None], sample.loss_mask[None], part[None],
                            kept[None], sample.last_hidden[None], target_head, sample.lse[None])
        c_star.append((dspark_loss(out, draft_vocab_ids=vocab_ids).per_token["c_star"] * out.eval_mask)[0])
        greedy.append(walk.greedy_matches(out, vocab_ids)[0].float())
    tokens, rounds = walk.walk_tau(torch.cat(c_star), anchors, sample.loss_mask)
    _, greedy_rounds = walk.walk_tau(torch.cat(greedy), anchors, sample.loss_mask)
    return [tokens, rounds, greedy_rounds]


def _record(step, epoch, lr, grad_norm, totals, world, tokens, seconds) -> dict:
    keys = ["ce", "l1", "confidence", "weight", *sorted(k for k in totals if k.startswith("accept@"))]
    summed = dict(zip(keys, world.all_sum([totals[k] for k in keys])))
    w = max(summed["weight"], 1e-9)
    ce, l1, conf = summed["ce"] / w, summed["l1"] / w, summed["confidence"] / w
    accept = [round(summed[k] / w, 4) for k in keys if k.startswith("accept@")]
    return {"step": step, "epoch": epoch, "lr": lr, "loss": 0.1 * ce + 0.9 * l1 + conf, "ce": ce, "l1": l1,
            "confidence": conf, "accept_by_position": accept, "grad_norm": grad_norm, "tokens": tokens,
            "seconds": seconds}


class _Int8Head(torch.nn.Module):
    """The target's head rows in a GGUF block format times int8-rounded activations: the
    served lm_head's kernel (kernels/qlinear.cpp `qlinear16`) on the draft vocabulary's rows.
    Each output column is computed alone, so these are the served logits of those tokens,
    bit for bit, and with the served logsumexp they are the served log-probabilities. Not
    drafting/dspark/packing.py's Int8Linear: that one is q8_0 only and returns the input's
    dtype (bf16 under autocast), which would round these logits."""

    def __init__(self, blocks: torch.Tensor, fmt: str, out_features: int):
        super().__init__()
        self.blocks, self.fmt, self.out_features = blocks, fmt, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from verispec import kernels

        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        with torch.no_grad():
            y = kernels.load().qlinear16(rows, self.blocks, None, kernels.FORMATS[self.fmt], self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


def served_target_head(head: torch.nn.Linear, kernel: str) -> torch.nn.Module:
    """The head that scores the target's draft-vocabulary logits in training: the served
    head's int8 kernel where the features came from a served q8_0 / q4_1 head with int8
    activations (features.py: their logsumexp is that head's), else the float head. The
    weights must be exact in that format (the plan served them so: models/kernel_plan.py)."""
    base = kernel.split(":")[0]
    if not base.endswith("-i8"):
        return head
    from verispec.models.linear import kernel_runs
    from verispec.models.quant import dequantize, interleave16_blocks, quantize

    fmt = base.removesuffix("-i8")
    if not kernel_runs(base, torch.float32):
        raise UserError(f"these features' target head ran {base}, which this CPU cannot run; train where they were "
                        "computed, or recompute them here")
    weight = head.weight.detach().float()
    blocks = quantize(weight, fmt)
    if not torch.equal(dequantize(blocks, fmt, weight.shape[1]), weight):
        raise UserError(f"the target's head rows are not exact in {fmt}, though its served head ran {base}")
    return _Int8Head(interleave16_blocks(blocks, fmt), fmt, head.out_features)


def _latest(out: Path) -> Path | None:
    """The newest checkpoint with a trainer state to resume from."""
    from verispec.drafting.dspark.checkpoint import latest_in_run

    folder = latest_in_run(out)
    return folder if folder is not None and (folder / STATE).is_file() else None


def _save(drafter, optimizer, params, out: Path, step: int) -> None:
    from verispec.drafting.dspark.checkpoint import save_dspark

    folder = out / f"step_{step}"
    save_dspark(drafter, folder, include_frozen=False)
    names = {id(p): n for n, p in drafter.named_parameters()}
    state = {f"param.{n}": p.detach().float().contiguous() for n, p in drafter.named_parameters() if p.requires_grad}
    meta = {"step": step}
    for p in params:
        s = optimizer.state.get(p)
        if s:
            state[f"exp_avg.{names[id(p)]}"] = s["exp_avg"].contiguous()
            state[f"exp_avg_sq.{names[id(p)]}"] = s["exp_avg_sq"].contiguous()
            meta["adam_step"] = float(s["step"])
    if drafter.draft_vocab_ids is not None:
        state["draft_vocab_ids"] = drafter.draft_vocab_ids.contiguous()
    (folder / STATE).parent.mkdir(exist_ok=True)
    save_file(state, str(folder / (STATE + ".partial")))
    os.replace(folder / (STATE + ".partial"), folder / STATE)
    (folder / "trainer" / "state.json").write_text(json.dumps(meta))
    (out / "latest.partial").write_text(folder.name)
    os.replace(out / "latest.partial", out / "latest")


def _load_state_into(drafter, folder: Path, target_folder: Path) -> None:
    """Resume: the float32 weights of the trainer state; the frozen copies from the target."""
    state = load_file(str(folder / STATE))
    with torch.no_grad():
        params = dict(drafter.named_parameters())
        for key, value in state.items():
            if key.startswith("param."):
                params[key[len("param."):]].copy_(value)
        if drafter.draft_vocab_ids is not None:
            drafter.draft_vocab_ids.copy_(state["draft_vocab_ids"])
    copy_frozen(drafter, target_folder)


def _load_optimizer(optimizer, params, drafter, folder: Path) -> int:
    state = load_file(str(folder / STATE))
    meta = json.loads((folder / "trainer" / "state.json").read_text())
    names = {id(p): n for n, p in drafter.named_parameters()}
    for p in params:
        n = names[id(p)]
        if f"exp_avg.{n}" in state:
            optimizer.state[p] = {"step": torch.tensor(meta["adam_step"]), "exp_avg": state[f"exp_avg.{n}"].clone(),
                                  "exp_avg_sq": state[f"exp_avg_sq.{n}"].clone()}
    return int(meta["step"])


def _plot(metrics_path: Path, png: Path) -> None:
    from verispec.plots import pyplot

    plt = pyplot()
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key in ("loss", "ce", "l1", "confidence"):
        axes[0].plot(steps, [r[key] for r in rows], label=key)
    axes[0].set_title("loss terms")
    axes[0].set_xlabel("step")
    axes[0].legend()
    width = len(rows[-1]["accept_by_position"])
    for j in range(width):
        axes[1].plot(steps, [r["accept_by_position"][j] for r in rows], label=f"slot {j}")
    axes[1].set_title("teacher-forced acceptance c* by slot")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [r["lr"] for r in rows])
    axes[2].set_title("learning rate")
    axes[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
