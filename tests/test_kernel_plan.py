"""Kernel plans (models/kernel_plan.py) and the decoder under verispec's kernels.

Oracles: transformers' own implementation of every tiny family (logits under the
batch-invariant bf16 plan within bf16's tolerance of the float32 truth, as transformers'
own bf16 is); bit equality of a row's logits decoded one token at a time, as a verify
block, and beside another row's prefill (the invariance the plan promises, for every
family, sliding-window rings included); exact requantization for the lossless formats;
and the cache file for plan reuse.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import build_reference, family_configs, reference_logits
from verispec import kernels
from verispec.models import kernel_plan
from verispec.models.decoder import BatchKV
from verispec.models.loader import load_folder

pytestmark = pytest.mark.skipif(not kernels.available(), reason="verispec's kernels could not be built here")

FAMILIES = [name for name in family_configs() if name != "gemma4-shared-moe"]
UNPLANNED = "gemma4-shared-moe"  # per-layer embeddings and routed experts: matrices outside the plan's roles


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-families")
    out = {}
    for name, config in family_configs().items():
        reference = build_reference(config, root / name)
        out[name] = (root / name, reference)
    return out


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))


def _bf16_invariant(folder):
    # bf16dot where AVX512-BF16 runs, else bf16rows (float32 sums over bf16 rows): both invariant
    return load_folder(folder, dtype=torch.bfloat16, kernels="invariant", quant="none")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_invariant_plan_decodes_like_transformers(folders, family):
    folder, reference = folders[family]
    model = _bf16_invariant(folder)
    assert model.kernel_plan.invariant and model.attention_kernel == "invariant"
    _assert_close_to_transformers(model, folder, reference)


def _assert_close_to_transformers(model, folder, reference):
    """The model's logits as close to transformers' float32 as transformers' own bf16 is."""
    ids = [3, 17, 42, 5, 88, 13, 2, 61, 9, 30, 77, 4]
    truth = reference_logits(reference, ids)
    ours = model(torch.tensor(ids), BatchKV([model.new_cache().allocate(32)], [len(ids)]),
                 logits_at=torch.arange(len(ids))).logits
    legacy = load_folder(folder, dtype=torch.bfloat16)  # PyTorch's kernels, bf16: what bf16 costs anyway
    theirs = legacy(torch.tensor(ids), BatchKV([legacy.new_cache().allocate(32)], [len(ids)]),
                    logits_at=torch.arange(len(ids))).logits
    ours_err = (ours - truth).abs().max().item()
    bf16_err = (theirs - truth).abs().max().item()
    assert ours_err <= max(2.5 * bf16_err, 0.05), (ours_err, bf16_err)
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.9


def test_logits_leave_the_lm_head_kernel_in_float32(folders):
    """The lm_head's kernels sum in float32; the logits keep those sums instead of a round trip
    through bf16 (~3 significant digits, and ~1 ms of copies per 8-row verify of a 262k
    vocabulary). Oracle: the final hidden state times the bf16 head in float64."""
    folder, reference = folders["llama"]  # an untied head, no softcap
    model = _bf16_invariant(folder)
    assert model.lm.kernel != "aten"
    ids = torch.tensor([3, 17, 42, 5, 88, 13, 2, 61])
    out = model(ids, BatchKV([model.new_cache().allocate(16)], [len(ids)]), logits_at=torch.arange(len(ids)),
                taps=(model.args.num_layers - 1,))
    last = model._norm(out.hidden[0], model.final_norm)
    head = reference.get_output_embeddings().weight.detach().to(torch.bfloat16).double()
    truth = last.double() @ head.T
    assert out.logits.dtype == torch.float32
    err = (out.logits.double() - truth).abs().max().item()
    assert err <= 1e-5 * truth.abs().max().item(), err  # bf16 logits would be off by ~4e-3 of the scale


def test_a_model_with_matrices_outside_the_plan_is_never_called_invariant(folders):
    """gemma4's per-layer embeddings and experts multiply outside the planned roles (experts on
    batch-dependent token subsets): auto falls back to the fastest plan, invariant is refused."""
    folder, reference = folders[UNPLANNED]
    model = load_folder(folder, dtype=torch.bfloat16, kernels="auto", quant="none")
    assert not model.kernel_plan.invariant
    ids = [3, 17, 42, 5, 88, 13, 2, 61]
    ours = model(torch.tensor(ids), BatchKV([model.new_cache().allocate(16)], [len(ids)]),
                 logits_at=torch.arange(len(ids))).logits
    assert (ours.argmax(-1) == reference_logits(reference, ids).argmax(-1)).float().mean() >= 0.75
    from verispec.errors import UserError

    with pytest.raises(UserError, match="batch-invariant"):
        _bf16_invariant(folder)


def _logits_of(model, prompt, cont, chunks, beside=None):
    cache = model.new_cache()
    seq = cache.allocate(64)
    model(torch.tensor(prompt), BatchKV([seq], [len(prompt)]))
    out, at = [], 0
    for n in chunks:
        if beside is not None and at == 0:  # another row's prefill chunk in the same forward
            other = cache.allocate(64)
            ids = torch.tensor(cont[:n] + beside)
            logits = model(ids, BatchKV([seq, other], [n, len(beside)]),
                           logits_at=torch.arange(n)).logits
        else:
            logits = model(torch.tensor(cont[at : at + n]), BatchKV([seq], [n]), logits_at=torch.arange(n)).logits
        out.append(logits)
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_logits_do_not_depend_on_the_batch(folders, family):
    """Past the sliding window (8) too: gemma's rings wrap inside this continuation."""
    _assert_batch_invariant(_bf16_invariant(folders[family][0]))


def _assert_batch_invariant(model):
    """A row's logits one token at a time == in verify blocks == beside another row's prefill."""
    prompt = [5, 9, 14, 22, 31, 40]
    cont = [7, 1, 60, 33, 12, 90, 45, 8, 19, 27, 3, 55]
    single = _logits_of(model, prompt, cont, [1] * 12)
    for chunks in ([9, 3], [4, 4, 4], [12], [2, 5, 5]):
        assert torch.equal(_logits_of(model, prompt, cont, chunks), single), chunks
    assert torch.equal(_logits_of(model, prompt, cont, [3, 9], beside=[2, 4, 6, 8, 10, 12, 14]), single)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_cache_gives_the_float32_caches_logits(folders, family):
    """A bf16 model on verispec's attention keeps its KV cache in bf16 (half the bytes), with the
    bits the float32 cache gave (the oracle: that cache, which the tests above hold to
    transformers): one token at a time, in verify blocks, beside another row's prefill, and
    past gemma's sliding window, where a long chunk reads the ring's older slots."""
    model = _bf16_invariant(folders[family][0])
    assert model.kv_dtype() == torch.bfloat16 and model.new_cache().allocate(8).keys[0].dtype == torch.bfloat16
    prompt = [5, 9, 14, 22, 31, 40]
    cont = [7, 1, 60, 33, 12, 90, 45, 8, 19, 27, 3, 55]
    new_cache = model.new_cache

    def logits(rollback):  # rollback 2: gemma's rings of 8 + 2 slots, which a 12-token chunk outgrows
        model.new_cache = lambda: new_cache(max_rollback=rollback)
        out = [_logits_of(model, prompt, cont, c) for c in ([1] * 12, [9, 3], [12], [2, 5, 5])]
        return out + [_logits_of(model, prompt, cont, [3, 9], beside=[2, 4, 6, 8, 10, 12, 14])]

    narrow = logits(64) + logits(2)
    model.kv_dtype = lambda: torch.float32  # what every CPU cache was before
    assert new_cache().allocate(8).keys[0].dtype == torch.float32
    wide = logits(64) + logits(2)
    for a, b in zip(narrow, wide):
        assert torch.equal(a, b)


FORCED_BF16 = {
    "bf16amx": lambda mod: mod.bf16amx() or "no AMX-BF16 on this CPU (or the OS refused the tile state)",
    "bf16cols": lambda mod: mod.isa() >= 1 or "bf16cols needs AVX2 or AVX-512F (this CPU has neither)",
    "bf16rows": lambda mod: True,
}


@pytest.mark.parametrize("kernel", sorted(FORCED_BF16))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_bf16_kernel_decodes_like_transformers_and_batch_invariantly(folders, family, kernel, monkeypatch):
    """One bf16 kernel for every matrix, whatever the timings would choose here: the
    transformers oracle as above, and a row's logits bit-equal one token at a time, as
    verify blocks, and beside another row's prefill."""
    runs = FORCED_BF16[kernel](kernels.load())
    if runs is not True:
        pytest.skip(runs)
    real = kernel_plan.candidates
    monkeypatch.setattr(kernel_plan, "candidates",
                        lambda dtype, fmt: [kernel] if fmt is None and dtype == torch.bfloat16 else real(dtype, fmt))
    folder, reference = folders[family]
    model = _bf16_invariant(folder)
    assert set(model.kernel_plan.linear.values()) == {kernel} and model.kernel_plan.invariant
    _assert_close_to_transformers(model, folder, reference)
    _assert_batch_invariant(model)


def test_int8_roles_on_amx_tiles_change_no_logit(folders, monkeypatch, tmp_path):
    """A q8_0 plan whose int8 calls run on AMX-INT8 tiles from 2 rows (whatever the timings
    say here): the same logits, bit for bit, as the plan that never uses the tiles (the
    oracle: the VNNI path), a row's logits still independent of the batch, and the plan
    names the switch."""
    if not kernels.load().amx_int8():
        pytest.skip("no AMX-INT8 on this CPU (or the OS refused the tile state)")
    folder = folders["qwen3"][0]
    prompt, cont = [5, 9, 14, 22, 31, 40], [7, 1, 60, 33, 12, 90, 45, 8, 19, 27, 3, 55]
    logits = {}
    for start in (0, 2):
        monkeypatch.setattr(kernel_plan, "amx_threshold", lambda timings, start=start: start)
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / f"cache-{start}"))  # a plan of its own, not the cached one
        model = load_folder(folder, dtype=torch.float32, kernels="invariant", quant="q8_0")
        int8 = {r: k for r, k in model.kernel_plan.linear.items() if k.partition(":")[0].endswith("-i8")}
        assert int8 and all(k.endswith(":2") == bool(start) for k in int8.values()), int8
        assert all(layer.amx_from == start for r in int8 for layer in model.linears()[r])
        logits[start] = _logits_of(model, prompt, cont, [8, 1, 3])  # 8-row and 3-row calls on tiles, 1-row not
        if start:
            _assert_batch_invariant(model)
    assert torch.equal(logits[2], logits[0])


def test_amx_threshold_is_where_the_tiles_stay_faster():
    assert kernel_plan.amx_threshold({"1": [10, 12], "2": [10, 11], "4": [16, 13], "9": [20, 15], "16": [27, 21]}) == 4
    assert kernel_plan.amx_threshold({"1": [10, 9], "2": [10, 11], "4": [16, 13], "16": [27, 21]}) == 4  # not from 1
    assert kernel_plan.amx_threshold({"1": [10, 12], "4": [16, 13], "16": [27, 28]}) == 0  # slower at the largest
    assert kernel_plan.amx_threshold({"1": [10, 9], "16": [27, 21]}) == 1


def test_a_plan_is_measured_once_and_reused_until_its_key_changes(folders, monkeypatch):
    folder = folders["llama"][0]
    calls = []
    real = kernel_plan.measure_plan

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(kernel_plan, "measure_plan", counting)
    first = load_folder(folder, dtype=torch.float32, kernels="auto", quant="none")
    second = load_folder(folder, dtype=torch.float32, kernels="auto", quant="none")
    assert len(calls) == 1 and second.kernel_plan.linear == first.kernel_plan.linear
    path = kernel_plan.profile_path(first.kernel_plan.key)
    saved = json.loads(path.read_text())
    assert saved["linear"] == first.kernel_plan.linear and saved["key"]["cpu"] == kernel_plan.cpu_name()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        load_folder(folder, dtype=torch.float32, kernels="auto", quant="none")
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2, "another thread count is another machine"


def test_forced_modes(folders):
    folder = folders["qwen3"][0]
    onednn = load_folder(folder, dtype=torch.float32, kernels="onednn", quant="none")
    assert set(onednn.kernel_plan.linear.values()) <= {"onednn", "aten"} and onednn.attention_kernel == "sdpa"
    assert not onednn.kernel_plan.invariant
    for quant in ("auto", "q8_0"):  # PyTorch's kernels take no quantized weights: the dtype's, whatever --quant says
        plan = load_folder(folder, dtype=torch.float32, kernels="onednn", quant=quant).kernel_plan
        assert set(plan.linear.values()) <= {"onednn", "aten"} and set(plan.formats.values()) <= {"float32"}
    quant = load_folder(folder, dtype=torch.float32, kernels="invariant", quant="q8_0")
    assert all(k.startswith("q8_0") for k in quant.kernel_plan.linear.values()) and quant.kernel_plan.invariant
    from types import SimpleNamespace

    from verispec.serve_cli import plan_summary

    # what serve and `dspark measure` print names the plan as forced, not as chosen for speed
    assert plan_summary(SimpleNamespace(model=onednn)) == "weights float32, PyTorch-only (--kernels onednn) kernels"
    assert plan_summary(SimpleNamespace(model=quant)) == "weights q8_0, batch-invariant kernels"
    from verispec.errors import UserError

    with pytest.raises(UserError, match="no batch-invariant kernel"):
        load_folder(folder, dtype=torch.float32, kernels="invariant", quant="none")  # no invariant float32 kernel


def test_lossless_formats_are_found_exactly_where_requantizing_is_exact(folders):
    from verispec.models.quant import dequantize, quantize

    folder = folders["llama"][0]
    model = load_folder(folder, dtype=torch.float32, pack=False)
    model.ensure_lm()
    assert kernel_plan.lossless_formats(model) == {}  # random weights: nothing is exact
    with torch.no_grad():
        for layer in model.linears()["gate_up"]:
            layer.weight.copy_(dequantize(quantize(layer.weight, "q4_1"), "q4_1", layer.in_features))
        for layer in model.linears()["down"]:
            layer.weight.copy_(dequantize(quantize(layer.weight, "q8_0"), "q8_0", layer.in_features))
    assert kernel_plan.lossless_formats(model) == {"gate_up": "q4_1", "down": "q8_0"}


def test_profile_prints_the_plan(folders, capsys):
    from verispec.cli import main

    assert main(["profile", "-m", str(folders["llama"][0]), "--dtype", "float32", "--quant", "q4_1"]) == 0
    out = capsys.readouterr().out
    assert "qkv" in out and "lm_head" in out and "attention" in out and "cached in" in out
    # then the SPS table of that plan, one line per measured token count, and the row effect
    from verispec.engine.step_costs import SIZES

    sps = out[out.index("SPS table"):].splitlines()
    header = next(i for i, line in enumerate(sps) if line.split()[:1] == ["tokens"])  # after a busy machine's note
    assert [int(line.split()[0]) for line in sps[header + 1 : header + 1 + len(SIZES)]] == list(SIZES)
    assert "as 8 rows of 1" in out


def test_auto_takes_the_invariant_plan_whatever_it_costs(folders, monkeypatch):
    """Lossless first: an Intel AMX host measured the invariant attention +6.2% over SDPA
    at 9 rows, the old 5% budget took SDPA, and greedy speculation changed tokens there.
    Here the invariant attention is made 10x slower than SDPA: auto still takes it."""
    real = kernel_plan.time_attention

    def slow_invariant(model, kernel, *args, **kwargs):
        t = real(model, kernel, *args, **kwargs)
        return {k: v * 10 for k, v in t.items()} if kernel == "invariant" else t

    monkeypatch.setattr(kernel_plan, "time_attention", slow_invariant)
    model = load_folder(folders["llama"][0], dtype=torch.float32, kernels="auto", quant="q8_0")
    plan = model.kernel_plan
    assert plan.invariant and plan.attention == "invariant", plan.note
    assert "against the fastest" in plan.note
    fastest = load_folder(folders["llama"][0], dtype=torch.float32, kernels="fastest", quant="q8_0").kernel_plan
    assert fastest.attention == "sdpa" and not fastest.invariant


def test_dtype_auto_prefers_an_invariant_plan_then_the_faster():
    from types import SimpleNamespace as Plan

    fast_variant, slow_invariant = Plan(invariant=False, step_us=10.0), Plan(invariant=True, step_us=30.0)
    assert kernel_plan.preferred_dtype({torch.float32: fast_variant, torch.bfloat16: slow_invariant}) == torch.bfloat16
    both = {torch.float32: Plan(invariant=True, step_us=20.0), torch.bfloat16: Plan(invariant=True, step_us=25.0)}
    assert kernel_plan.preferred_dtype(both) == torch.float32
    neither = {torch.float32: Plan(invariant=False, step_us=20.0), torch.bfloat16: Plan(invariant=False, step_us=15.0)}
    assert kernel_plan.preferred_dtype(neither) == torch.bfloat16
