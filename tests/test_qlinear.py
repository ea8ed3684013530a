"""verispec's CPU kernels (kernels/qlinear.cpp) and weight formats (models/quant.py).

Oracles: float64 products of the dequantized weights (each kernel within float32 or, for
the int8-activation VNNI kernels, int8 rounding error of it); numpy round trips of the
block formats, and GGUF's own q4_1 / q8_0 bytes dequantized by models/gguf/dequant.py;
float64 softmax attention. Batch invariance, the property the kernels exist for, is
checked bit for bit: a row computed alone equals the same row inside calls of every other
row count (1..33, and beside unrelated rows), for every kernel and head size; the float
kernels give the same bits on every ISA path (scalar, AVX2, AVX-512).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from verispec import kernels
from verispec.models.quant import (
    deinterleave4,
    deinterleave16_bf16,
    deinterleave_amx,
    dequantize,
    interleave4,
    interleave16_blocks,
    interleave16_bf16,
    interleave_amx,
    quantize,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="verispec's kernels could not be built here")

SHAPES = [(96, 64), (130, 96), (64, 320)]  # N not a multiple of 4 included (padded tiles)


@pytest.fixture(scope="module")
def mod():
    return kernels.load()


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _rows(m, k, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[::3, ::5] = 0.0  # zeros too: a ReLU-like input is where a library kernel's row count showed
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_block_formats_round_trip_and_match_gguf(fmt):
    w = _weights(40, 128)
    blocks = quantize(w, fmt)
    deq = dequantize(blocks, fmt, 128)
    step = (w.reshape(40, -1, 32).amax(-1) - w.reshape(40, -1, 32).amin(-1)).max() / (15 if fmt == "q4_1" else 127)
    assert (deq - w).abs().max() <= step  # within one quantization step
    assert torch.equal(dequantize(quantize(deq, fmt), fmt, 128), deq)  # requantizing dequantized blocks is exact
    # the bytes are GGUF's: models/gguf/dequant.py reads them as a tensor of that type
    from gguf import GGMLQuantizationType

    from verispec.models.gguf.dequant import dequantize as gguf_dequantize

    qtype = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[fmt]
    theirs = gguf_dequantize(blocks.numpy().reshape(-1), qtype, (40, 128))
    assert torch.equal(torch.as_tensor(np.asarray(theirs)).reshape(40, 128).float(), deq)


def test_interleaved_layouts_hold_the_same_rows():
    w = _weights(130, 96).to(torch.bfloat16)
    assert torch.equal(deinterleave4(interleave4(w), 130, 96), w.float())
    assert torch.equal(deinterleave_amx(interleave_amx(w), 130, 96), w.float())
    assert torch.equal(deinterleave16_bf16(interleave16_bf16(w), 130, 96), w.float())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "bf16"])
def test_float_kernels_equal_a_float64_product_and_agree_across_isas(mod, n, k, fmt):
    w = _weights(n, k)
    blocks = quantize(w, fmt)
    x = _rows(7, k)
    ref = x.double() @ dequantize(blocks, fmt, k).double().T
    ys = [mod.qlinear(x, blocks, None, kernels.FORMATS[fmt], n, isa) for isa in range(mod.isa() + 1)]
    for y in ys:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(y, ys[0]), "every ISA path computes the same operations"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_int8_kernels_are_the_int8_activation_product(mod, n, k, fmt):
    if not mod.int8dot():
        pytest.skip("no AVX-512 VNNI or AVX2 on this CPU")
    w = _weights(n, k)
    blocks = quantize(w, fmt)
    x = _rows(7, k)
    tiles = interleave16_blocks(blocks, fmt)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    y = mod.qlinear16(x, tiles, bias, kernels.FORMATS[fmt], n)
    # the oracle: x rounded to int8 per 32-block (absmax / 127), times the dequantized weights
    xb = x.double().reshape(7, -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = (torch.where(d > 0, xb / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127) * d).reshape(7, k)
    ref = xq @ dequantize(blocks, fmt, k).double().T + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
    # the AVX2 path gives the VNNI path's bits (exact integer dots, the same float operations)
    assert torch.equal(mod.qlinear16(x, tiles, bias, kernels.FORMATS[fmt], n, 1), y)
    if mod.vnni():  # and the row-major VNNI kernel computes the same model
        torch.testing.assert_close(mod.qlinear(x, blocks, bias, kernels.FORMATS[fmt], n, 3), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_int8_kernels_amx_path_gives_the_vnni_paths_bits(mod, fmt):
    """AMX-INT8 tiles compute the same exact integer dots as vpdpbusd and the same float
    epilogue, so every output bit equals the VNNI path's (the engine switches paths by row
    count: the model must not change), at every row count, past 16-row chunks, with and
    without bias, on widths that are not whole tiles."""
    if not mod.amx_int8():
        pytest.skip("no AMX-INT8 on this CPU (or no tile permission from its kernel)")
    for n, k in ((130, 96), (49, 640), (1000, 576)):
        tiles = interleave16_blocks(quantize(_weights(n, k), fmt), fmt)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
        for m in (1, 2, 5, 9, 16, 17, 33):
            x = _rows(m, k) * 3
            for b in (None, bias):
                vnni = mod.qlinear16(x, tiles, b, kernels.FORMATS[fmt], n, 3)
                # every 16-row chunk on tiles, then only chunks of 4 / 9 rows or more (the rest by VNNI)
                for amx_rows in (1, 4, 9):
                    amx = mod.qlinear16(x, tiles, b, kernels.FORMATS[fmt], n, 4, amx_rows)
                    assert torch.equal(amx, vnni), (n, k, m, amx_rows)


def test_bf16_kernel_is_a_bf16_product_with_float32_sums(mod):
    if not mod.bf16dot():
        pytest.skip("no AVX512-BF16 on this CPU")
    w = _weights(130, 96).to(torch.bfloat16)
    x = _rows(9, 96, dtype=torch.bfloat16)
    bias = torch.randn(130)
    y = mod.bf16_linear(x, interleave4(w), bias, 130, True)
    ref = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(mod.bf16_linear(x, interleave4(w), bias, 130, False), y.to(torch.bfloat16))


def test_amx_kernel_is_a_bf16_product_with_float32_sums(mod):
    if not mod.bf16amx():
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused the tile state)")
    for n, k, m in [(130, 96, 9), (64, 320, 1), (200, 64, 17)]:  # padded groups, one row, two row tiles
        w = _weights(n, k).to(torch.bfloat16)
        x = _rows(m, k, dtype=torch.bfloat16)
        bias = torch.randn(n)
        y = mod.bf16amx_linear(x, interleave_amx(w), bias, n, True)
        ref = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(mod.bf16amx_linear(x, interleave_amx(w), bias, n, False), y.to(torch.bfloat16))


def test_column_tile_kernel_is_a_bf16_product_summed_in_k_order(mod):
    """bf16cols: exact bf16 x float32 products, one float32 sum per output in k order.
    Oracle: float64 products (within float32 summation error), and the same k-order sum
    written out in torch (one fused multiply-add per k is not what torch does, so within a
    few float32 ulps, not bit-equal); bf16 output = the float32 output rounded by torch."""
    if mod.isa() < 1:
        pytest.skip("bf16cols needs AVX2 (this CPU has none)")
    for n, k, m in [(130, 96, 9), (64, 320, 1), (200, 64, 17), (1536, 640, 4)]:  # a partial tile, chunks of 9 (6 on AVX2)
        w = _weights(n, k).to(torch.bfloat16)
        x = _rows(m, k)
        bias = torch.randn(n)
        tiles = interleave16_bf16(w)
        y = mod.bf16cols_linear(x, tiles, bias, n, True)
        ref = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        seq = torch.zeros(m, n)
        for j in range(k):
            seq = seq + x[:, j : j + 1] * w[:, j].float()[None, :]
        torch.testing.assert_close(y, seq + bias, rtol=1e-5, atol=1e-5)
        if mod.isa() >= 2:  # the AVX2 path, 8 lanes a register and 6 rows a pass: the same bits
            assert torch.equal(mod.bf16cols_linear(x, tiles, bias, n, True, 1), y)
        xb = x.to(torch.bfloat16)
        assert torch.equal(mod.bf16cols_linear(xb, tiles, bias, n, False),
                           mod.bf16cols_linear(xb.float(), tiles, bias, n, True).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="16-column tiles"):
        mod.bf16cols_linear(torch.zeros(1, 96), tiles[:-2], None, n, True)


def _kernel_calls(mod):
    calls = {}
    for fmt in ("q4_1", "q8_0", "bf16"):
        calls[f"{fmt}-float"] = (torch.float32, lambda x, w, fmt=fmt: mod.qlinear(x, quantize(w, fmt), None,
                                                                                   kernels.FORMATS[fmt], w.shape[0], -1))
    for isa in {mod.int8dot(), 1} if mod.int8dot() else ():  # VNNI where it runs, and AVX2
        for fmt in ("q4_1", "q8_0"):
            calls[f"{fmt}-i8-isa{isa}"] = (torch.float32, lambda x, w, fmt=fmt, isa=isa: mod.qlinear16(
                x, interleave16_blocks(quantize(w, fmt), fmt), None, kernels.FORMATS[fmt], w.shape[0], isa))
    if mod.bf16dot():
        calls["bf16dot"] = (torch.bfloat16, lambda x, w: mod.bf16_linear(x, interleave4(w), None, w.shape[0], False))
    if mod.bf16amx():
        calls["bf16amx"] = (torch.bfloat16, lambda x, w: mod.bf16amx_linear(x, interleave_amx(w), None, w.shape[0], False))
    for isa in range(1, mod.isa() + 1):  # AVX2, and AVX-512 where it runs
        calls[f"bf16cols-isa{isa}"] = (torch.bfloat16, lambda x, w, isa=isa: mod.bf16cols_linear(
            x, interleave16_bf16(w), None, w.shape[0], False, isa))
    return calls


@pytest.mark.parametrize("n,k", [(130, 96), (64, 320)])
def test_every_kernel_is_batch_invariant_bit_for_bit(mod, n, k):
    """Row r alone == row r inside calls of 2..33 rows == row r among unrelated rows."""
    w = _weights(n, k)
    others = _rows(40, k, seed=9)
    for name, (dtype, call) in _kernel_calls(mod).items():
        x = _rows(33, k).to(dtype)
        alone = torch.cat([call(x[r : r + 1].contiguous(), w) for r in range(33)])
        for m in list(range(2, 34)):
            assert torch.equal(call(x[:m].contiguous(), w), alone[:m]), f"{name}: {m} rows changed a row"
        mixed = torch.cat([others[:5].to(dtype), x[10:20], others[5:31].to(dtype)])
        assert torch.equal(call(mixed, w)[5:15], alone[10:20]), f"{name}: unrelated rows changed a row"


def test_every_kernel_gives_the_same_bits_on_one_thread_and_on_several(mod):
    """The kernels split a call's output columns (and attention's heads) over torch's
    threads; a split must not change a bit, or a served model would depend on its thread
    count. Oracle: the same call on one thread. A wide N so every thread gets columns."""
    w = _weights(1040, 96)
    x = _rows(9, 96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {name: call(x.to(dtype), w) for name, (dtype, call) in _kernel_calls(mod).items()}
        q, k, v = torch.randn(9, 8, 64), torch.randn(2, 40, 64), torch.randn(2, 40, 64)
        att_one = mod.attention(q, k, v, None, 0.125)
        torch.set_num_threads(4)
        for name, (dtype, call) in _kernel_calls(mod).items():
            assert torch.equal(call(x.to(dtype), w), one[name]), f"{name}: the thread count changed the bits"
        assert torch.equal(mod.attention(q, k, v, None, 0.125), att_one)
    finally:
        torch.set_num_threads(threads)


def test_kernels_use_torchs_threads_where_openmp_builds():
    """A serial build went unnoticed for 20 stages (at::parallel_for is inline and runs on one
    thread unless the extension is compiled with OpenMP). Oracle: the compiler itself, asked
    to build an OpenMP program; where it can, the loaded kernels must be the threaded build,
    sharing torch's one OpenMP runtime."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to ask")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "omp.cpp"
        src.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        built = subprocess.run([cxx, "-fopenmp", str(src), "-o", str(Path(tmp) / "omp")], capture_output=True)
    if built.returncode != 0:
        pytest.skip("this compiler cannot build OpenMP: the kernels run on one thread here")
    assert kernels.threaded(), "the compiler builds OpenMP but the kernels were built without it"
    # (other wheels bundle their own, renamed, libgomp: sentencepiece does; libgomp.so.1 is the
    # soname both torch and the kernels link)
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith("/libgomp.so.1")}
    assert len(runtimes) <= 1, f"the kernels and torch load two OpenMP runtimes: {runtimes}"


def test_a_failed_openmp_build_is_remembered_only_when_the_serial_build_works(monkeypatch, tmp_path, capsys):
    """A compiler that cannot link OpenMP would otherwise recompile (~30 s) and fail at every
    start before falling back. Oracle: the calls the builder receives. The builder is faked
    (no compiling here): the OpenMP build raises, the serial one works, then both raise."""
    import torch.utils.cpp_extension as cpp_extension

    calls = []
    serial_works = True

    def fake_build(name, **kwargs):
        calls.append(name)
        if name.endswith("_openmp") or not serial_works:
            raise RuntimeError("cannot find -lgomp")
        return object()

    def fresh_start():
        for attr, value in (("_module", None), ("_build", None), ("_error", None)):
            monkeypatch.setattr(kernels, attr, value)

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VERISPEC_SERIAL_KERNELS", raising=False)
    fresh_start()
    kernels.load()
    assert calls == ["verispec_qlinear_openmp", "verispec_qlinear_serial"] and not kernels.threaded()
    assert "cannot find -lgomp" in capsys.readouterr().err
    fresh_start()
    kernels.load()  # the next start: straight to the serial build, saying why
    assert calls[2:] == ["verispec_qlinear_serial"]
    assert "remembered" in capsys.readouterr().err

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "other"))
    serial_works = False
    fresh_start()
    with pytest.raises(kernels.KernelUnavailable, match="cannot find -lgomp"):
        kernels.load()
    assert not list((tmp_path / "other").rglob(kernels.FAILED)), "nothing built: nothing may be remembered"


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_attention_is_softmax_attention_and_batch_invariant(mod, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, keys, n = 6, 2, 70, 9
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(kv_heads, keys, head_dim, generator=g)
    v = torch.randn(kv_heads, keys, head_dim, generator=g)
    start = keys - n
    mask = torch.arange(keys)[None, :] <= torch.arange(start, keys)[:, None]
    out = mod.attention(q, k, v, mask, head_dim**-0.5)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), k[None].double(), v[None].double(),
                                         attn_mask=mask, scale=head_dim**-0.5, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for i in range(n):
        # a decode step: one query over exactly its keys, no mask -- the same bits as in the block
        alone = mod.attention(q[i : i + 1], k[:, : start + i + 1], v[:, : start + i + 1], None, head_dim**-0.5)
        assert torch.equal(alone[0], out[i])


def test_cache_write_and_attention_in_one_op(mod):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, D, slots = 4, 2, 64, 16
    cache_k = torch.randn(kv_heads, slots, D, generator=g)
    cache_v = torch.randn(kv_heads, slots, D, generator=g)
    q = torch.randn(3, heads, D, generator=g)
    k_new = torch.randn(3, kv_heads, D, generator=g)
    v_new = torch.randn(3, kv_heads, D, generator=g)
    mask = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    ref_k[:, 5:8], ref_v[:, 5:8] = k_new.transpose(0, 1), v_new.transpose(0, 1)
    expected = mod.attention(q, ref_k[:, :8], ref_v[:, :8], mask, 0.125)
    out = mod.attend_cached(q, k_new, v_new, cache_k, cache_v, 5, 8, mask, 0.125)
    assert torch.equal(cache_k, ref_k) and torch.equal(cache_v, ref_v)
    assert torch.equal(out, expected)
    # a ring: position p goes to slot p % slots
    mod.attend_cached(q[:1], k_new[:1], v_new[:1], cache_k, cache_v, slots + 2, slots, None, 0.125)
    assert torch.equal(cache_k[:, 2], k_new[0])


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_attention_over_bf16_keys_and_values_gives_the_float32_bits(mod, head_dim):
    # the oracle: the same kernel over float32 K/V holding the same (bf16) numbers, which
    # test_attention_is_softmax_attention_and_batch_invariant checks against SDPA
    g = torch.Generator().manual_seed(7 + head_dim)
    heads, kv_heads, keys, n = 4, 2, 45, 5
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(kv_heads, keys, head_dim, generator=g).bfloat16()
    v = torch.randn(kv_heads, keys, head_dim, generator=g).bfloat16()
    mask = torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
    for m in (mask, None):
        wide = mod.attention(q, k.float(), v.float(), m, head_dim**-0.5)
        assert torch.equal(mod.attention(q, k, v, m, head_dim**-0.5), wide)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        mod.attention(q, k, v.float(), None, 1.0)


def test_cache_write_and_attention_over_a_bf16_cache(mod):
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, D, slots = 4, 1, 256, 12
    cache_k = torch.randn(kv_heads, slots, D, generator=g).bfloat16()
    cache_v = torch.randn(kv_heads, slots, D, generator=g).bfloat16()
    wide_k, wide_v = cache_k.float(), cache_v.float()
    q = torch.randn(3, heads, D, generator=g).bfloat16()
    k_new = torch.randn(3, kv_heads, D, generator=g).bfloat16()
    v_new = torch.randn(3, kv_heads, D, generator=g).bfloat16()
    mask = torch.arange(9)[None, :] <= torch.arange(6, 9)[:, None]
    expected = mod.attend_cached(q, k_new, v_new, wide_k, wide_v, 6, 9, mask, 0.0625)
    out = mod.attend_cached(q, k_new, v_new, cache_k, cache_v, 6, 9, mask, 0.0625)
    assert cache_k.dtype == torch.bfloat16 and torch.equal(cache_k.float(), wide_k) and torch.equal(cache_v.float(), wide_v)
    assert torch.equal(out, expected)
    # a ring write of bf16 rows into the bf16 cache
    mod.attend_cached(q[:1], k_new[1:2], v_new[1:2], cache_k, cache_v, slots + 3, slots, None, 0.0625)
    assert torch.equal(cache_k[:, 3], k_new[1]) and torch.equal(cache_v[:, 3], v_new[1])


def test_rope_and_silu_mul_helpers(mod):
    from verispec.models.config import RopeArgs
    from verispec.models.decoder import RotaryTable, apply_rope

    table = RotaryTable(RopeArgs(theta=10000.0), 64, torch.float32, "cpu")
    positions = torch.tensor([0, 5, 17])
    cos, sin = table.lookup(positions)
    qkv = torch.randn(3, 5 * 64 + 64)
    expected = apply_rope(qkv[:, : 5 * 64].view(3, 5, 64), cos, sin)
    mod.rope_qk_(qkv, 5, 64, cos.view(3, 64), sin.view(3, 64))
    torch.testing.assert_close(qkv[:, : 5 * 64].view(3, 5, 64), expected, rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(4, 2 * 48)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(mod.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_gelu_mul_is_gelu_tanh_times_up_with_the_same_bits_in_vector_lanes_and_tail(mod):
    """Gemma's activation: gelu_tanh(gate) * up (transformers' formula as the oracle), one
    element's bits the same whether a 16-lane vector or the scalar tail computed it."""
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(3, 2 * 53, generator=gen) * 3
    gate_up[:, 48:53] = gate_up[:, 0:5]  # the tail (48..52) repeats lanes 0..4, gate and up alike
    gate_up[:, 53 + 48 : 53 + 53] = gate_up[:, 53 : 53 + 5]
    gate, up = gate_up.chunk(2, dim=-1)
    out = mod.gelu_mul(gate_up)
    torch.testing.assert_close(out.double(), F.gelu(gate.double(), approximate="tanh") * up.double(),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(out[:, 48:53], out[:, 0:5])
    bf = mod.gelu_mul(gate_up.to(torch.bfloat16))  # computed in float32 from the bf16 inputs, rounded once
    g16, u16 = gate_up.to(torch.bfloat16).float().chunk(2, dim=-1)
    torch.testing.assert_close(bf.float(), (F.gelu(g16, approximate="tanh") * u16).to(torch.bfloat16).float(),
                               rtol=1e-2, atol=1e-2)


def test_rmsnorm_and_gelu_mul_rows_keep_their_bits_in_any_call(mod):
    """The many-row calls split their rows over the threads (a verify block, a features
    sequence): every row's bits must be those of the same row computed alone. RMSNorm against
    a float64 oracle of decoder.py's formula (gemma's offset weight in float32, the residual
    sum rounded to bf16 first), and both kernels row by row against 1-row calls."""
    gen = torch.Generator().manual_seed(5)
    n, H = 37, 640
    x, res = (torch.randn(n, H, generator=gen) * 4).bfloat16(), torch.randn(n, H, generator=gen).bfloat16()
    w = torch.randn(H, generator=gen)
    out, total = mod.rmsnorm(x, w, 1e-6, True, res)
    s = (x.float() + res.float()).bfloat16()
    assert torch.equal(total, s)
    d = s.double()
    expected = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    gate_up = (torch.randn(n, 2 * 2048, generator=gen) * 3).bfloat16()
    many = mod.gelu_mul(gate_up)
    for i in (0, 5, 17, n - 1):
        assert torch.equal(mod.rmsnorm(x[i : i + 1], w, 1e-6, True, res[i : i + 1])[0], out[i : i + 1])
        assert torch.equal(mod.gelu_mul(gate_up[i : i + 1]), many[i : i + 1])
