// Weight-only linear kernels for CPU decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// W is stored in one of GGUF's block formats (the bytes llama.cpp reads), or bf16:
//   q4_1: per 32 weights along K: fp16 d, fp16 m, 16 bytes of nibbles (element j in the low
//         nibble of byte j, element j + 16 in its high nibble); w = d * q + m    (5 bits/weight)
//   q8_0: per 32 weights: fp16 d, 32 int8; w = d * q                          (8.5 bits/weight)
//   bf16: plain bfloat16 rows                                                (16 bits/weight)
// x is float32 and every product is accumulated in float32.
//
// Batch invariance, by construction: every output element y[m, n] is the same sequence of
// float operations whatever M is and whichever other rows share the call. The K loop runs
// in block order into one 16-lane accumulator per (m, n) (two FMAs per 32-weight block, low
// half then high half), and the accumulator is reduced by one fixed tree. Rows are tiled
// (ROW_TILE at a time, up to nine on the AVX-512 float path, reusing each dequantized block
// from registers) and output columns are split across threads, but neither changes the
// order of any element's sum. So a row decoded alone, beside other rows, or as one position
// of a verify block gives bit-equal logits, which is what makes speculative decoding
// token-identical in these formats.
//
// bf16 weights have two kernels: bf16dot (AVX512-BF16 dot instructions) and bf16amx (AMX
// tiles, where the CPU has them), each batch-invariant on its own (their sections say how).
//
// ISA dispatch at run time: an AVX-512 path (AVX512F + AVX512BW, F16C) and an AVX2 + FMA
// path are compiled into the same object with target attributes; `best_isa()` picks one by
// __builtin_cpu_supports. Both compute the same operations per element (the AVX2 path keeps
// two 8-lane accumulators, reduced in the same lane order), so the ISA does not change a
// result's invariance, only its speed. Checked by tests/test_qlinear.py against a float64
// reference of the dequantized weights, and for bit-equality across M and row tilings.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int BLOCK = 32;
constexpr int ROW_TILE = 4;
constexpr int PREFETCH_TILES = 2;
constexpr int Q4_1_BYTES = 20;
constexpr int Q8_0_BYTES = 34;

enum Format { Q4_1 = 0, Q8_0 = 1, BF16 = 2 };

inline float fp16_to_float(uint16_t h) {
  // IEEE half -> float without F16C, exact (subnormals included)
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; exp--; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---------------------------------------------------------------------------- AVX-512

__attribute__((target("avx512f,avx512bw,fma,f16c")))
inline float hsum512(__m512 v) {
  // fixed tree: 16 -> 8 -> 4 -> 2 -> 1
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x55));
  return _mm_cvtss_f32(s1);
}

template <int FMT>
__attribute__((target("avx512f,avx512bw,fma,f16c")))
inline void load_block_512(const uint8_t* w, int64_t b, __m512& lo, __m512& hi) {
  if constexpr (FMT == Q4_1) {
    const uint8_t* blk = w + b * Q4_1_BYTES;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    __m512 m = _mm512_set1_ps(_cvtsh_ss(mh));
    __m128i q = _mm_loadu_si128((const __m128i*)(blk + 4));
    __m128i qlo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    __m128i qhi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qlo)), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qhi)), d, m);
  } else if constexpr (FMT == Q8_0) {
    const uint8_t* blk = w + b * Q8_0_BYTES;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    __m128i q0 = _mm_loadu_si128((const __m128i*)(blk + 2));
    __m128i q1 = _mm_loadu_si128((const __m128i*)(blk + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
  } else {
    const uint16_t* row = (const uint16_t*)w + b * BLOCK;
    __m256i r0 = _mm256_loadu_si256((const __m256i*)row);
    __m256i r1 = _mm256_loadu_si256((const __m256i*)(row + 16));
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r0), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16));
  }
}

// MT rows of one output column: each block is dequantized once into registers and used by
// all MT rows; every row's own sum runs over the blocks in order whatever MT is, so the
// tiling changes no bit (and the AVX2 / scalar paths, which tile by ROW_TILE, agree).
template <int FMT, int MT>
__attribute__((target("avx512f,avx512bw,fma,f16c")))
inline void column_rows_512(const float* x, const uint8_t* wn, float b, float* y, int64_t N, int64_t K, int64_t m0,
                            int64_t n) {
  const int64_t nb = K / BLOCK;
  __m512 acc[MT];
#pragma GCC unroll 9
  for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; blk++) {
    __m512 lo, hi;
    load_block_512<FMT>(wn, blk, lo, hi);
#pragma GCC unroll 9
    for (int t = 0; t < MT; t++) {
      const float* xr = x + (m0 + t) * K + blk * BLOCK;
      acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[t]);
      acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[t]);
    }
  }
#pragma GCC unroll 9
  for (int t = 0; t < MT; t++) y[(m0 + t) * N + n] = hsum512(acc[t]) + b;
}

template <int FMT>
__attribute__((target("avx512f,avx512bw,fma,f16c")))
void kernel_512(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * row_bytes;
    const float b = bias ? bias[n] : 0.0f;
    // up to nine rows (a verify block of 8 drafts + 1) in one pass over the column's blocks
    int64_t m0 = 0;
    for (; M - m0 >= 9; m0 += 9) column_rows_512<FMT, 9>(x, wn, b, y, N, K, m0, n);
    switch (M - m0) {
      case 8: column_rows_512<FMT, 8>(x, wn, b, y, N, K, m0, n); break;
      case 7: column_rows_512<FMT, 7>(x, wn, b, y, N, K, m0, n); break;
      case 6: column_rows_512<FMT, 6>(x, wn, b, y, N, K, m0, n); break;
      case 5: column_rows_512<FMT, 5>(x, wn, b, y, N, K, m0, n); break;
      case 4: column_rows_512<FMT, 4>(x, wn, b, y, N, K, m0, n); break;
      case 3: column_rows_512<FMT, 3>(x, wn, b, y, N, K, m0, n); break;
      case 2: column_rows_512<FMT, 2>(x, wn, b, y, N, K, m0, n); break;
      case 1: column_rows_512<FMT, 1>(x, wn, b, y, N, K, m0, n); break;
      default: break;
    }
  }
}


// ---------------------------------------------------------------------------- AVX-512 VNNI
//
// The fast path where the CPU has VNNI: x is quantized per row and per 32-block to int8
// (dx = absmax / 127, xq = round(x / dx): llama.cpp's q8 activations), each block's dot
// product is an exact integer sum (vpdpbusd), and only the per-block scaling is float:
//   q4_1: y += d * dx * sum(q * xq) + m * dx * sum(xq)      q8_0: y += d * dx * sum(q * xq)
// Integer sums do not depend on order; the float accumulation runs in block order into
// one 8-lane accumulator per output (and, for q4_1, one scalar for the m terms), reduced
// by a fixed tree: invariant to M and to the row tiling, like the float kernels. This is
// a different model from the float kernels (activations rounded to 8 bits, as llama.cpp
// computes these formats), so an engine uses one kernel per weight for all its forwards.

struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K/32]
  std::vector<float> qsum;   // [M, K/32]: scale * sum(q) of the block (q4_1's m term)
  std::vector<int32_t> isum; // [M, K/32]: sum(q) of the block (q8_0's offset in kernel_qx16)
};

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / BLOCK;
  out.q.resize(M * K);
  out.scale.resize(M * nb);
  out.qsum.resize(M * nb);
  out.isum.resize(M * nb);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + m * K + b * BLOCK;
      float amax = 0.0f;
      for (int j = 0; j < BLOCK; j++) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      int8_t* qb = out.q.data() + m * K + b * BLOCK;
      for (int j = 0; j < BLOCK; j++) {
        int v = (int)std::nearbyint(xb[j] * inv);
        v = std::min(127, std::max(-127, v));
        qb[j] = (int8_t)v;
        sum += v;
      }
      out.scale[m * nb + b] = d;
      out.qsum[m * nb + b] = d * (float)sum;
      out.isum[m * nb + b] = sum;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline float hsum256(__m256 v) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x55));
  return _mm_cvtss_f32(s1);
}

template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void kernel_vnni(const QuantizedRows& xq, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  const int64_t nb = K / BLOCK;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * row_bytes;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int mt = (int)std::min<int64_t>(ROW_TILE, M - m0);
      __m256 acc[ROW_TILE];
      float macc[ROW_TILE];
      for (int t = 0; t < ROW_TILE; t++) { acc[t] = _mm256_setzero_ps(); macc[t] = 0.0f; }
      for (int64_t blk = 0; blk < nb; blk++) {
        float d, mn = 0.0f;
        __m256i wq, wsign;
        if constexpr (FMT == Q4_1) {
          const uint8_t* p = wn + blk * Q4_1_BYTES;
          uint16_t dh, mh;
          std::memcpy(&dh, p, 2);
          std::memcpy(&mh, p + 2, 2);
          d = _cvtsh_ss(dh);
          mn = _cvtsh_ss(mh);
          __m128i q = _mm_loadu_si128((const __m128i*)(p + 4));
          __m128i lo = _mm_and_si128(q, low4);
          __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
          wq = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);  // elements 0..31, unsigned
        } else {
          const uint8_t* p = wn + blk * Q8_0_BYTES;
          uint16_t dh;
          std::memcpy(&dh, p, 2);
          d = _cvtsh_ss(dh);
          __m256i q = _mm256_loadu_si256((const __m256i*)(p + 2));
          wq = _mm256_abs_epi8(q);  // |w| as unsigned, its sign moved onto x below
          wsign = q;
        }
        for (int t = 0; t < mt; t++) {
          const int64_t r = m0 + t;
          __m256i xv = _mm256_loadu_si256((const __m256i*)(xq.q.data() + r * K + blk * BLOCK));
          if constexpr (FMT == Q8_0) xv = _mm256_sign_epi8(xv, wsign);
          __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv);  // exact
          const float s = d * xq.scale[r * nb + blk];
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s), acc[t]);
          if constexpr (FMT == Q4_1) macc[t] = std::fma(mn, xq.qsum[r * nb + blk], macc[t]);
        }
      }
      for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = (hsum256(acc[t]) + macc[t]) + b;
    }
  }
}


// ---------------------------------------------------------------------------- AVX512-BF16
//
// bf16 weights and bf16 activations (what a bf16 model computes), products summed in
// float32 by vdpbf16ps: per 32-element block one instruction per row, each of its 16
// lanes adding one pair of products to its float accumulator. The same instruction
// sequence for every output element whatever M is: batch-invariant, like the others.
// Output float32 or bf16 (round to nearest even, as torch's .to(bfloat16)).


inline uint16_t float_to_bf16_rne(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

// Four accumulators -> their four sums, by exactly hsum512's tree for each (lane j +
// lane j+8, then j + j+4, j + j+2, j + j+1), done for all four at once with shuffles.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
inline __m128 reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u, u, 0x44), _mm512_shuffle_ps(u, u, 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w, w, 0x00), _mm512_shuffle_ps(w, w, 0x55));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), z));
}

// 16 floats -> bf16, round to nearest even (NaN kept a NaN), as float_to_bf16_rne
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m256i bf16_rne16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, nan));
}

// four floats -> bf16 in the low 64 bits, by the same operations (the other lanes unused)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
inline __m128i bf16_rne4(__m128 v) {
  return _mm256_castsi256_si128(bf16_rne16(_mm512_castps128_ps512(v)));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
inline void store_out(void* y, bool y_bf16, int64_t idx, float v) {
  if (y_bf16) ((uint16_t*)y)[idx] = float_to_bf16_rne(v);
  else ((float*)y)[idx] = v;
}

// Weights in "4-interleaved" rows: columns 4t..4t+3 stored block by block, [c0 b0][c1 b0]
// [c2 b0][c3 b0][c0 b1]..., so four columns are computed at once (independent accumulators
// hide the dot instruction's latency, each x load serves four columns) while the weights
// are still read strictly in memory order (reading four plain rows side by side halved
// the DRAM throughput of the 49152 x 576 lm_head here). MT rows at a time, compile-time
// tile sizes, so the accumulators live in registers. Neither tiling changes any element's
// own sequence of operations.
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
inline void bf16dot_tile(const uint16_t* x, const uint16_t* w4, const float* bias, void* y, bool y_bf16, int64_t N,
                         int64_t K, int64_t m0, int64_t n) {
  const int64_t nb = K / BLOCK;
  __m512 acc[MT][4];
#pragma GCC unroll 16
  for (int t = 0; t < MT; t++)
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
  const uint16_t* wt = w4 + n * K;  // the tile of columns n..n+3
  const char* ahead = (const char*)(wt + PREFETCH_TILES * 4 * K);  // a later tile, streamed in ahead
  for (int64_t blk = 0; blk < nb; blk++) {
    for (int c = 0; c < 4; c++) _mm_prefetch(ahead + (blk * 4 + c) * BLOCK * 2, _MM_HINT_T0);
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void*)(wt + (blk * 4 + c) * BLOCK));
#pragma GCC unroll 16
    for (int t = 0; t < MT; t++) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + (m0 + t) * K + blk * BLOCK));
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], wv[c], xv);
    }
  }
  const bool full = n + 4 <= N;
  const __m128 bv = bias && full ? _mm_loadu_ps(bias + n) : _mm_setzero_ps();
  for (int t = 0; t < MT; t++) {
    if (!full) {  // the padded last tile: one column at a time, the same tree
      for (int c = 0; c < 4 && n + c < N; c++)
        store_out(y, y_bf16, (m0 + t) * N + n + c, hsum512(acc[t][c]) + (bias ? bias[n + c] : 0.0f));
      continue;
    }
    __m128 r = _mm_add_ps(reduce4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]), bv);
    const int64_t at = (m0 + t) * N + n;
    if (y_bf16) _mm_storel_epi64((__m128i*)((uint16_t*)y + at), bf16_rne4(r));
    else _mm_storeu_ps((float*)y + at, r);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
void kernel_bf16dot(const uint16_t* x, const uint8_t* w, const float* bias, void* y, bool y_bf16, int64_t M,
                    int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const uint16_t* w4 = (const uint16_t*)w;
  for (int64_t n = n0; n < n1; n += 4) {
    int64_t m0 = 0;
    for (; M - m0 >= 6; m0 += 6) bf16dot_tile<6>(x, w4, bias, y, y_bf16, N, K, m0, n);
    switch (M - m0) {
      case 5: bf16dot_tile<3>(x, w4, bias, y, y_bf16, N, K, m0, n);
              bf16dot_tile<2>(x, w4, bias, y, y_bf16, N, K, m0 + 3, n); break;
      case 4: bf16dot_tile<4>(x, w4, bias, y, y_bf16, N, K, m0, n); break;
      case 3: bf16dot_tile<3>(x, w4, bias, y, y_bf16, N, K, m0, n); break;
      case 2: bf16dot_tile<2>(x, w4, bias, y, y_bf16, N, K, m0, n); break;
      case 1: bf16dot_tile<1>(x, w4, bias, y, y_bf16, N, K, m0, n); break;
      default: break;
    }
  }
}

bool has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// AVX-512 VNNI with what the int8 kernels' epilogue needs (the VNNI path, and AMX-INT8's)
bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}


// ---------------------------------------------------------------------------- AMX-BF16
//
// The same model as bf16dot (bf16 weights and activations, float32 sums), computed by
// Intel AMX tiles where the CPU has them: TDPBF16PS multiplies a 16-row tile of x by a
// 16-column tile of weights, 32 values of K at a time, adding each element's 32 products
// pairwise into its float32 accumulator, in K order. A tile instruction costs the same for
// 1 row as for 16, so a 9-token verify block reads the weights once at nearly a 1-row
// price (bf16dot's cost grows with the rows: one dot instruction per row per block).
//
// Batch-invariant by construction: x is copied into zero-padded 16-row tiles, so every
// call runs with one tile configuration (16 rows), and each output element is the same
// chain of tile instructions over its K blocks in order, whatever M is and whichever rows
// share its tile (a tile row's sums never mix with another row's). Its sums associate
// differently from bf16dot's (pairs in K order, not 16 lanes and a tree), so it is a
// kernel of its own: a plan uses one of the two for every forward.
//
// Weights (quant.py interleave_amx): columns in groups of 64 (N padded with zero rows),
// each group stored K block by K block as four 1 KB tiles, one per 16 columns, in AMX's
// pair layout (tile row p holds, for each of its 16 columns, the values at 2p and 2p + 1
// of the block), so a group is read strictly in memory order.

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int AMX_ROWS = 16;
constexpr int AMX_GROUP = 64;  // output columns per group: four 16-column tiles
constexpr int AMX_TILE_BYTES = 1024;
constexpr int AMX_PREFETCH = 2;  // K blocks ahead of the tiles being read

int amx_state = -1;  // -1 unknown, 0 no, 1 ready

// AMX-TILE and one AMX compute feature (CPUID leaf 7, EDX bit 24 and `bit`), and the
// kernel's permission to use the tile state (Linux asks each process to request it:
// arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
bool amx_tiles_ready(int bit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> bit) & 1)) return false;
#ifdef SYS_arch_prctl
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return false;
#endif
}

// AMX-BF16 (bit 22) and AVX512-BF16 for the epilogue
bool has_amx_bf16() {
  if (amx_state < 0) amx_state = has_avx512bf16() && amx_tiles_ready(22);
  return amx_state == 1;
}

// one K block of a group: x's tile into tmm4, the four weight tiles through the three
// registers named (one register is reused; which one rotates over three blocks, so a load
// never waits on the instruction just issued)
#define AMX_BLOCK(kb, r0, r1, r2, r3)                                                                 \
  {                                                                                                   \
    const uint8_t* wt = wg + (kb) * 4 * AMX_TILE_BYTES;                                               \
    for (int l = 0; l < 4 * AMX_TILE_BYTES / 64; l++)                                                 \
      _mm_prefetch((const char*)wt + AMX_PREFETCH * 4 * AMX_TILE_BYTES + l * 64, _MM_HINT_T0);       \
    _tile_loadd(4, xt + (kb) * BLOCK, K * 2);                                                         \
    _tile_loadd(r0, wt, 64);                                                                          \
    _tile_dpbf16ps(0, 4, r0);                                                                         \
    _tile_loadd(r1, wt + AMX_TILE_BYTES, 64);                                                         \
    _tile_dpbf16ps(1, 4, r1);                                                                         \
    _tile_loadd(r2, wt + 2 * AMX_TILE_BYTES, 64);                                                     \
    _tile_dpbf16ps(2, 4, r2);                                                                         \
    _tile_loadd(r3, wt + 3 * AMX_TILE_BYTES, 64);                                                     \
    _tile_dpbf16ps(3, 4, r3);                                                                         \
  }

// groups g0..g1 of the output columns, for every 16-row tile of the padded x [MP, K]
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
void kernel_bf16amx(const uint16_t* xpad, int64_t MP, const uint8_t* w, const float* bias, void* y, bool y_bf16,
                    int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t KB = K / BLOCK;
  alignas(64) TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = AMX_ROWS;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float out[4][AMX_ROWS][16];
  for (int64_t g = g0; g < g1; g++) {
    const uint8_t* wg = w + g * KB * 4 * AMX_TILE_BYTES;
    for (int64_t m0 = 0; m0 < MP; m0 += AMX_ROWS) {
      const uint16_t* xt = xpad + m0 * K;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      int64_t kb = 0;
      for (; kb + 3 <= KB; kb += 3) {
        AMX_BLOCK(kb, 5, 6, 7, 5)
        AMX_BLOCK(kb + 1, 6, 7, 5, 6)
        AMX_BLOCK(kb + 2, 7, 5, 6, 7)
      }
      for (; kb < KB; kb++) AMX_BLOCK(kb, 5, 6, 7, 5)
      _tile_stored(0, out[0], 64);
      _tile_stored(1, out[1], 64);
      _tile_stored(2, out[2], 64);
      _tile_stored(3, out[3], 64);
      const int64_t rows = std::min<int64_t>(AMX_ROWS, M - m0);
      for (int c = 0; c < 4; c++) {
        const int64_t n = g * AMX_GROUP + c * 16;
        if (n >= N) break;
        const __mmask16 valid = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(valid, bias + n) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
          const __m512 v = _mm512_add_ps(_mm512_load_ps(out[c][r]), bv);
          const int64_t at = (m0 + r) * N + n;
          if (y_bf16) _mm256_mask_storeu_epi16((uint16_t*)y + at, valid, bf16_rne16(v));
          else _mm512_mask_storeu_ps((float*)y + at, valid, v);
        }
      }
    }
  }
  _tile_release();
}
#undef AMX_BLOCK


// ---------------------------------------------------------------------------- attention
//
// out[i, h] = softmax(scale * q[i, h] . K[g]^T over the keys mask[i] allows) @ V[g], g the
// KV head of query head h. Every (query, head) is computed alone, by the same steps in
// the same order whatever else is in the call: the scores of its allowed keys in slot
// order (each a 16-lane dot over head_dim with a fixed reduction tree), their maximum,
// then exp(score - max) summed in slot order and used to weight V in slot order, and one
// division. So a query gives bit-equal output decoded alone, inside a verify block or a
// prefill chunk, which the fused attention kernels do not promise (PyTorch's CPU flash
// attention changed float32 outputs by ~1e-7 between a 1-query and a 9-query call).
// exp is a fixed polynomial (Cephes' expf: range reduction to [-ln2/2, ln2/2] and a
// degree-5 polynomial, ~1 ulp), vectorized over 16 keys; the scalar tail uses the same
// polynomial so lanes and tails agree.

inline float exp_poly(float x) {
  x = std::min(88.3762626647949f, std::max(-88.3762626647949f, x));
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = std::fma(fx, -0.693359375f, x);
  r = std::fma(fx, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  float rr = r * r;
  p = std::fma(p, rr, r);
  p = p + 1.0f;
  int32_t e = (int32_t)fx + 127;
  uint32_t bits = (uint32_t)e << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

__attribute__((target("avx512f,avx512bw,fma")))
inline __m512 exp_poly512(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), x));
  // floor(x * log2e + 0.5) as the scalar code: mul then add, not fused
  __m512 fx = _mm512_floor_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)));
  __m512 r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 rr = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, rr, r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

__attribute__((target("avx512f,avx512bw,fma")))
inline float dot512(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return hsum512(acc);
}

// hsum512's tree for four vectors at once (as reduce4 for the bf16 kernel)
__attribute__((target("avx512f,avx512bw,fma")))
inline __m128 reduce4f(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u, u, 0x44), _mm512_shuffle_ps(u, u, 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w, w, 0x00), _mm512_shuffle_ps(w, w, 0x55));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), z));
}

// K / V elements of the attention kernels: float32, or bfloat16 bits (uint16_t) widened on
// load. A bf16 value widens to float32 exactly, so a bf16 cache holding a bf16 model's K/V
// gives the same bits as a float32 cache holding the same numbers, at half the bytes read.
template <typename KV>
inline float kv_load1(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) return *p;
  else { uint32_t b = (uint32_t)*p << 16; float f; std::memcpy(&f, &b, 4); return f; }
}

template <typename KV>
__attribute__((target("avx512f,avx512bw,fma")))
inline __m512 kv_load16(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) return _mm512_loadu_ps(p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <typename KV>
__attribute__((target("avx2,fma")))
inline __m256 kv_load8(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) return _mm256_loadu_ps(p);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// DV = head_dim / 16 vectors: q and the output accumulator stay in registers
template <int DV, typename KV>
__attribute__((target("avx512f,avx512bw,fma")))
void attend_one_512(const float* q, const KV* K, const KV* V, const bool* allow, int64_t S, float scale,
                    float* scores, float* out) {
  constexpr int64_t D = DV * 16;
  __m512 qv[DV];
#pragma GCC unroll 16
  for (int d = 0; d < DV; d++) qv[d] = _mm512_loadu_ps(q + d * 16);
  // scores of every key (masked ones too: they are skipped below), four keys per reduction
  int64_t j = 0;
  for (; j + 4 <= S; j += 4) {
    __m512 a[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      a[c] = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int d = 0; d < DV; d++) a[c] = _mm512_fmadd_ps(qv[d], kv_load16(K + (j + c) * D + d * 16), a[c]);
    }
    _mm_storeu_ps(scores + j, _mm_mul_ps(reduce4f(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
  }
  for (; j < S; j++) {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int d = 0; d < DV; d++) a = _mm512_fmadd_ps(qv[d], kv_load16(K + j * D + d * 16), a);
    scores[j] = hsum512(a) * scale;
  }
  float mx = -INFINITY;
  for (int64_t jj = 0; jj < S; jj++)
    if (!allow || allow[jj]) mx = std::max(mx, scores[jj]);
  // weights, 16 keys at a time; masked keys get 0 and are skipped in the sums
  const __m512 vmx = _mm512_set1_ps(mx);
  j = 0;
  for (; j + 16 <= S; j += 16)
    _mm512_storeu_ps(scores + j, exp_poly512(_mm512_sub_ps(_mm512_loadu_ps(scores + j), vmx)));
  for (; j < S; j++) scores[j] = exp_poly(scores[j] - mx);
  float sum = 0.0f;
  __m512 acc[DV];
#pragma GCC unroll 16
  for (int d = 0; d < DV; d++) acc[d] = _mm512_setzero_ps();
  for (int64_t jj = 0; jj < S; jj++) {
    if (allow && !allow[jj]) continue;
    const float w = scores[jj];
    sum += w;
    const __m512 vw = _mm512_set1_ps(w);
#pragma GCC unroll 16
    for (int d = 0; d < DV; d++) acc[d] = _mm512_fmadd_ps(vw, kv_load16(V + jj * D + d * 16), acc[d]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
#pragma GCC unroll 16
  for (int d = 0; d < DV; d++) _mm512_storeu_ps(out + d * 16, _mm512_mul_ps(acc[d], inv));
}

template <typename KV>
void attend_one_scalar(const float* q, const KV* K, const KV* V, const bool* allow, int64_t S, int64_t D,
                       float scale, float* scores, float* out) {
  // the AVX-512 path's operations, one lane at a time (D a multiple of 16)
  for (int64_t j = 0; j < S; j++) {
    float acc[16] = {0};
    for (int64_t d = 0; d < D; d += 16)
      for (int l = 0; l < 16; l++) acc[l] = std::fma(q[d + l], kv_load1(K + j * D + d + l), acc[l]);
    float s8[8], s4[4], s2[2];
    for (int l = 0; l < 8; l++) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
    scores[j] = (s2[0] + s2[1]) * scale;
  }
  float mx = -INFINITY;
  for (int64_t j = 0; j < S; j++)
    if (!allow || allow[j]) mx = std::max(mx, scores[j]);
  for (int64_t j = 0; j < S; j++) scores[j] = exp_poly(scores[j] - mx);
  float sum = 0.0f;
  for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
  for (int64_t j = 0; j < S; j++) {
    if (allow && !allow[j]) continue;
    sum += scores[j];
    for (int64_t d = 0; d < D; d++) out[d] = std::fma(scores[j], kv_load1(V + j * D + d), out[d]);
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; d++) out[d] *= inv;
}


// ---------------------------------------------------------------------------- VNNI, 16-interleaved
//
// The q4_1 / q8_0 kernels proper (kernel_vnni above, row-major, is the reference the tests
// check these against), with one output column per int32 lane. Weights are repacked
// into tiles of sixteen columns, block by block, so one tile's block is one contiguous run
// and each 64-byte group holds four consecutive weights of each of the 16 columns:
//   q4_1: [16 x fp16 d][16 x fp16 m][g = 0..3: column c's nibble bytes 4g..4g+3, c = 0..15]  = 320 B
//   q8_0: [16 x fp16 d][g = 0..7: column c's weights 4g..4g+3 as unsigned bytes q + 128]     = 544 B
// (q4_1 group g's low nibbles are elements 4g..4g+3, its high nibbles 16 + 4g..; so weight
// register j = 0..7 always meets x[4j..4j+3], broadcast to every lane.) Per row and block,
// eight vpdpbusd give each column's exact integer dot product in its own lane (q8_0 starts
// from -128 * sum(x_q), which cancels the +128 of its weights), then one conversion, one
// multiply (d_c * dx) and one fma accumulate it in float in block order; q4_1's m terms go
// into a second 16-lane accumulator by one fma. Output: (acc + m acc) + bias. Every
// element's operations are the same whatever M is and wherever its tile falls among the
// threads: batch-invariant. The layout it replaced (four columns in 4 lanes each, a
// shuffle-heavy q8_0 path) spent about 4x the vector operations per row, which a verify
// block of 8-9 rows pays for: bench/weight_only.py has the before and after.

constexpr int Q4X16_BYTES = 320;
constexpr int Q8X16_BYTES = 544;

inline uint32_t tile_mask16(int64_t n, int64_t N) { return n + 16 <= N ? 0xFFFFu : (1u << (N - n)) - 1u; }

// One row's block: its exact integer dot into the float accumulators (d_c * dx, one fma;
// q4_1's m term into its own), and a tile's rows out as (acc + m acc) + bias. The VNNI and
// the AMX-INT8 paths both go through these, which is what makes their bits equal.
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline void qx16_accumulate(__m512i dot, __m512 dv, __m512 mv, float scale, float qsum, __m512& acc, __m512& macc) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(scale)), acc);
  if constexpr (FMT == Q4_1) macc = _mm512_fmadd_ps(mv, _mm512_set1_ps(qsum), macc);
}

template <int FMT, int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline void qx16_store(const __m512* acc, const __m512* macc, const float* bias, float* y, int64_t N, int64_t m0,
                       int64_t n) {
  const __mmask16 mask = (__mmask16)tile_mask16(n, N);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int t = 0; t < MT; t++) {
    const __m512 v = FMT == Q4_1 ? _mm512_add_ps(acc[t], macc[t]) : acc[t];
    _mm512_mask_storeu_ps(y + (m0 + t) * N + n, mask, _mm512_add_ps(v, bv));
  }
}

// MT rows share each block's weight registers; per row the eight vpdpbusd run as one
// chain, and the rows' chains overlap out of order (measured here: ~80% of the core's
// vpdpbusd throughput from 8 rows; interleaving the rows by hand was slower, the row
// pointers no longer fit in registers).
template <int FMT, int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline void qx16_tile(const QuantizedRows& xq, const uint8_t* tile, const float* bias, float* y, int64_t N,
                      int64_t K, int64_t m0, int64_t n) {
  const int64_t nb = K / BLOCK;
  constexpr int TB = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  __m512 acc[MT], macc[MT];
#pragma GCC unroll 8
  for (int t = 0; t < MT; t++) { acc[t] = _mm512_setzero_ps(); macc[t] = _mm512_setzero_ps(); }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t blk = 0; blk < nb; blk++) {
    const uint8_t* p = tile + blk * TB;
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    __m512 mv = _mm512_setzero_ps();
    __m512i w[8];
    if constexpr (FMT == Q4_1) {
      mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        const __m512i q = _mm512_loadu_si512((const void*)(p + 64 + 64 * g));
        w[g] = _mm512_and_si512(q, low4);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      }
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void*)(p + 32 + 64 * g));
    }
#pragma GCC unroll 8
    for (int t = 0; t < MT; t++) {
      const int64_t r = m0 + t;
      const int8_t* xr = xq.q.data() + r * K + blk * BLOCK;
      __m512i dot = FMT == Q8_0 ? _mm512_set1_epi32(-128 * xq.isum[r * nb + blk]) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++)  // x's four bytes broadcast by the instruction itself (GCC does not fold it)
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(w[g]), "m"(*(const int32_t*)(xr + 4 * g)));
      qx16_accumulate<FMT>(dot, dv, mv, xq.scale[r * nb + blk], xq.qsum[r * nb + blk], acc[t], macc[t]);
    }
  }
  qx16_store<FMT, MT>(acc, macc, bias, y, N, m0, n);
}

// rows [m0, m1) of one 16-column tile
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline void qx16_rows(const QuantizedRows& xq, const uint8_t* tile, const float* bias, float* y, int64_t N, int64_t K,
                      int64_t m0, int64_t m1, int64_t n) {
  if (m1 - m0 == 9) {  // a full verify block in one pass
    qx16_tile<FMT, 9>(xq, tile, bias, y, N, K, m0, n);
    return;
  }
  for (; m1 - m0 >= 8; m0 += 8) qx16_tile<FMT, 8>(xq, tile, bias, y, N, K, m0, n);
  // the rest in one pass: a lone row's eight vpdpbusd are one dependent chain, so a
  // 2 + 1 split costs about two 2-row passes (the SPS table showed 3 tokens at a
  // 4-token price, 5-7 tokens at two passes' price)
  switch (m1 - m0) {
    case 7: qx16_tile<FMT, 7>(xq, tile, bias, y, N, K, m0, n); break;
    case 6: qx16_tile<FMT, 6>(xq, tile, bias, y, N, K, m0, n); break;
    case 5: qx16_tile<FMT, 5>(xq, tile, bias, y, N, K, m0, n); break;
    case 4: qx16_tile<FMT, 4>(xq, tile, bias, y, N, K, m0, n); break;
    case 3: qx16_tile<FMT, 3>(xq, tile, bias, y, N, K, m0, n); break;
    case 2: qx16_tile<FMT, 2>(xq, tile, bias, y, N, K, m0, n); break;
    case 1: qx16_tile<FMT, 1>(xq, tile, bias, y, N, K, m0, n); break;
    default: break;
  }
}

template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void kernel_qx16(const QuantizedRows& xq, const uint8_t* w16, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, int64_t t0, int64_t t1) {
  constexpr int TB = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  const int64_t nb = K / BLOCK;
  for (int64_t t = t0; t < t1; t++) qx16_rows<FMT>(xq, w16 + t * nb * TB, bias, y, N, K, 0, M, t * 16);
}

// ---------------------------------------------------------------------------- AMX-INT8, 16-interleaved
//
// The same tiles and the same arithmetic as kernel_qx16, with each block's integer dot
// products computed by one AMX tile instruction for up to 16 rows at once instead of eight
// vpdpbusd per row. TDPBSUD multiplies signed bytes (x's rows, block b: a 16 x 32 byte
// tile) by unsigned bytes (the block's 16 columns: q8_0's 8 groups of 64 bytes are
// already AMX's B layout, four consecutive K values of each column per tile row; q4_1's
// nibbles are unpacked into it) into exact int32 sums; q8_0 adds -128 * sum(x_q), as
// kernel_qx16 starts from, so each (row, column, block) gets the same integer. The float
// epilogue is kernel_qx16's, operation for operation (one conversion, d_c * dx, one fma
// per block in block order; q4_1's m terms in their own accumulator; (acc + m acc) +
// bias): the output is bit-equal to kernel_qx16's for any M, so the engine may use either
// at any row count and the model does not change (tests/test_qlinear.py checks the bits).
// Where it pays: the VNNI kernel's work grows with the rows (eight vpdpbusd, a
// conversion and two multiplies per row and block), the tile instruction's does not, so a
// verify block or a step of several rows reads the weights once at nearly a 1-row price;
// the engine picks it by rows (a threshold measured at start: models/linear.py).

int amx_int8_state = -1;  // -1 unknown, 0 no, 1 ready
constexpr int AMX_INT8_PREFETCH = 6;  // blocks ahead of the tile loads

// AMX-INT8 (CPUID leaf 7, EDX bit 25) and AVX-512 VNNI for the epilogue's ISA
bool has_amx_int8() {
  if (amx_int8_state >= 0) return amx_int8_state == 1;
  amx_int8_state = has_vnni() && amx_tiles_ready(25);
  return amx_int8_state == 1;
}

// one block's int32 dots of the configured rows x 16 columns into out (tiles: C in tc, x in ta,
// weights in tb; two sets alternate so one block's tile work overlaps the last's epilogue;
// a macro: the tile intrinsics take their register numbers as literals)
#define AMX_BLOCK_DOTS(tc, ta, tb, x, K, b, out) \
  {                                              \
    _tile_loadd(ta, x, K);                       \
    _tile_loadd(tb, b, 64);                      \
    _tile_zero(tc);                              \
    _tile_dpbsud(tc, ta, tb);                    \
    _tile_stored(tc, out, 64);                   \
  }

// MT rows (of the 16 the x tile holds) of one 16-column tile: first every block's tile
// work, back to back into `dots` (a block's integer dots do not wait on the previous
// block's epilogue, and the epilogue never reads a tile store just issued), then the
// float epilogue over the blocks in order
template <int FMT, int MT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
inline void qx16_tile_amx(const QuantizedRows& xq, const uint8_t* tile, const float* bias, float* y, int64_t N,
                          int64_t K, int64_t m0, int64_t n, int32_t* dots) {
  const int64_t nb = K / BLOCK;
  constexpr int TBYTES = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  constexpr int DOT_INTS = AMX_ROWS * 16;
  const int8_t* x0 = xq.q.data() + m0 * K;
  if constexpr (FMT == Q4_1) {
    alignas(64) uint8_t unpacked[2][8 * 64];
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t blk = 0; blk < nb; blk++) {
      const uint8_t* p = tile + blk * TBYTES;
      uint8_t* u = unpacked[blk & 1];
      const char* ahead = (const char*)p + AMX_INT8_PREFETCH * TBYTES;
#pragma GCC unroll 5
      for (int l = 0; l < TBYTES; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {  // tile row g: elements 4g..4g+3 (low nibbles); row 4 + g: 16 + 4g.. (high)
        const __m512i q = _mm512_loadu_si512((const void*)(p + 64 + 64 * g));
        _mm512_store_si512((void*)(u + 64 * g), _mm512_and_si512(q, low4));
        _mm512_store_si512((void*)(u + 64 * (g + 4)), _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
      }
      if (blk & 1) AMX_BLOCK_DOTS(1, 3, 5, x0 + blk * BLOCK, K, u, dots + blk * DOT_INTS)
      else AMX_BLOCK_DOTS(0, 2, 4, x0 + blk * BLOCK, K, u, dots + blk * DOT_INTS)
    }
  } else {
    int64_t blk = 0;
    for (; blk + 2 <= nb; blk += 2) {
      // tile loads are not followed by the hardware prefetcher as vector loads are: ask
      // for the weights a few blocks ahead (the next tile follows this one in memory)
      const char* ahead = (const char*)tile + (blk + AMX_INT8_PREFETCH) * TBYTES;
#pragma GCC unroll 17
      for (int l = 0; l < 2 * TBYTES; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      AMX_BLOCK_DOTS(0, 2, 4, x0 + blk * BLOCK, K, tile + blk * TBYTES + 32, dots + blk * DOT_INTS)
      AMX_BLOCK_DOTS(1, 3, 5, x0 + (blk + 1) * BLOCK, K, tile + (blk + 1) * TBYTES + 32, dots + (blk + 1) * DOT_INTS)
    }
    if (blk < nb) AMX_BLOCK_DOTS(0, 2, 4, x0 + blk * BLOCK, K, tile + blk * TBYTES + 32, dots + blk * DOT_INTS)
  }
  __m512 acc[MT], macc[MT];
#pragma GCC unroll 16
  for (int t = 0; t < MT; t++) { acc[t] = _mm512_setzero_ps(); macc[t] = _mm512_setzero_ps(); }
  for (int64_t blk = 0; blk < nb; blk++) {
    const uint8_t* p = tile + blk * TBYTES;
    const int32_t* db = dots + blk * DOT_INTS;
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (FMT == Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
#pragma GCC unroll 16
    for (int t = 0; t < MT; t++) {
      const int64_t r = m0 + t;
      __m512i dot = _mm512_load_si512((const void*)(db + t * 16));
      if constexpr (FMT == Q8_0) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(-128 * xq.isum[r * nb + blk]));
      qx16_accumulate<FMT>(dot, dv, mv, xq.scale[r * nb + blk], xq.qsum[r * nb + blk], acc[t], macc[t]);
    }
  }
  qx16_store<FMT, MT>(acc, macc, bias, y, N, m0, n);
}

// tiles 0-1: C (rows x 16 int32), 2-3: x (rows x 32 bytes), 4-5: weights (8 rows x 64 bytes)
__attribute__((target("amx-tile")))
inline void configure_amx_int8(int rows) {
  alignas(64) TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 2; t++) {
    cfg.rows[t] = rows;
    cfg.colsb[t] = 64;
    cfg.rows[2 + t] = rows;
    cfg.colsb[2 + t] = BLOCK;
    cfg.rows[4 + t] = BLOCK / 4;
    cfg.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The rows in chunks of 16, on tiles configured for the chunk's rows: a call of fewer than
// 16 rows when it has at least `amx_rows`, and every whole 16-row chunk of a longer call;
// a longer call's last, partial chunk goes by the VNNI path (a chunk's tile work costs
// about as much for 4 rows as for 16: on Gemma's lm_head 20 rows as 16 + 4 on tiles took
// 33 ms, as 16 on tiles + 4 by VNNI 27.6, all by VNNI 29.7). Bit-equal either way.
template <int FMT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void kernel_qx16_amx(const QuantizedRows& xq, const uint8_t* w16, const float* bias, float* y, int64_t M, int64_t N,
                     int64_t K, int64_t t0, int64_t t1, int64_t amx_rows) {
  constexpr int TBYTES = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  const int64_t nb = K / BLOCK;
  int configured = 0;  // the rows the tiles are configured for (x and C tiles hold only the rows computed)
  thread_local std::vector<int32_t> dots_buffer;  // every block's 16 x 16 int32 dots of one tile
  const int64_t dot_ints = nb * AMX_ROWS * 16 + 16;
  if ((int64_t)dots_buffer.size() < dot_ints) dots_buffer.resize(dot_ints);
  int32_t* dots = (int32_t*)(((uintptr_t)dots_buffer.data() + 63) & ~(uintptr_t)63);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = w16 + t * nb * TBYTES;
    const int64_t n = t * 16;
    for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
      const int rows = (int)std::min<int64_t>(AMX_ROWS, M - m0);
      if (rows < amx_rows || (m0 > 0 && rows < AMX_ROWS)) {
        qx16_rows<FMT>(xq, tile, bias, y, N, K, m0, M, n);
        break;
      }
      if (rows != configured) configure_amx_int8(configured = rows);
      switch (rows) {
#define AMX_ROWS_CASE(R) case R: qx16_tile_amx<FMT, R>(xq, tile, bias, y, N, K, m0, n, dots); break;
        AMX_ROWS_CASE(16) AMX_ROWS_CASE(15) AMX_ROWS_CASE(14) AMX_ROWS_CASE(13) AMX_ROWS_CASE(12) AMX_ROWS_CASE(11)
        AMX_ROWS_CASE(10) AMX_ROWS_CASE(9) AMX_ROWS_CASE(8) AMX_ROWS_CASE(7) AMX_ROWS_CASE(6) AMX_ROWS_CASE(5)
        AMX_ROWS_CASE(4) AMX_ROWS_CASE(3) AMX_ROWS_CASE(2) AMX_ROWS_CASE(1)
#undef AMX_ROWS_CASE
        default: break;
      }
    }
  }
  if (configured) _tile_release();
}
#undef AMX_BLOCK_DOTS

// The same on AVX2 without VNNI: each 16-lane register is two 8-lane halves (columns 0-7,
// 8-15) with the same float operations per lane, and the integer dots are the same exact
// integers by another route (maddubs then madd with ones sums the same four bytes per
// int32 lane; q8_0 goes through |w| and x with w's sign, at most 2 x 128 x 127 per int16,
// since maddubs would saturate on q + 128). So both paths give the same bits.

// One half of a tile (columns 8h..8h+7) for MT rows over all blocks: the rows share each
// group's unpacked weights, and the two halves run one after the other, so the row
// accumulators fit AVX2's sixteen registers.
template <int FMT, int MT>
__attribute__((target("avx2,fma,f16c")))
inline void qx16_half_256(const QuantizedRows& xq, const uint8_t* tile, const float* bias, float* y, int64_t N,
                          int64_t K, int64_t m0, int64_t n, int h) {
  const int64_t nb = K / BLOCK;
  constexpr int TB = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  __m256 acc[MT], macc[MT];
#pragma GCC unroll 4
  for (int t = 0; t < MT; t++) { acc[t] = _mm256_setzero_ps(); macc[t] = _mm256_setzero_ps(); }
  const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int64_t blk = 0; blk < nb; blk++) {
    const uint8_t* p = tile + blk * TB;
    __m256i dot[MT];
#pragma GCC unroll 4
    for (int t = 0; t < MT; t++) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
      __m256i wq;
      if constexpr (FMT == Q4_1) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(p + 64 + 64 * (g & 3) + 32 * h));
        wq = g < 4 ? _mm256_and_si256(q, low4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      } else {
        wq = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32 + 64 * g + 32 * h)), flip);  // signed q
      }
      const __m256i wabs = FMT == Q4_1 ? wq : _mm256_abs_epi8(wq);
#pragma GCC unroll 4
      for (int t = 0; t < MT; t++) {
        int32_t xg;
        std::memcpy(&xg, xq.q.data() + (m0 + t) * K + blk * BLOCK + 4 * g, 4);
        __m256i xv = _mm256_set1_epi32(xg);
        if constexpr (FMT == Q8_0) xv = _mm256_sign_epi8(xv, wq);
        dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones));
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    const __m256 mv = FMT == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * h))) : dv;
#pragma GCC unroll 4
    for (int t = 0; t < MT; t++) {
      const int64_t r = m0 + t;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(dv, _mm256_set1_ps(xq.scale[r * nb + blk])),
                               acc[t]);
      if constexpr (FMT == Q4_1) macc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xq.qsum[r * nb + blk]), macc[t]);
    }
  }
  for (int t = 0; t < MT; t++) {
    float out[8];
    _mm256_storeu_ps(out, FMT == Q4_1 ? _mm256_add_ps(acc[t], macc[t]) : acc[t]);
    for (int c = 0; c < 8 && n + 8 * h + c < N; c++)
      y[(m0 + t) * N + n + 8 * h + c] = out[c] + (bias ? bias[n + 8 * h + c] : 0.0f);
  }
}

template <int FMT>
__attribute__((target("avx2,fma,f16c")))
void kernel_qx16_256(const QuantizedRows& xq, const uint8_t* w16, const float* bias, float* y, int64_t M, int64_t N,
                     int64_t K, int64_t t0, int64_t t1) {
  constexpr int TB = FMT == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  const int64_t nb = K / BLOCK;
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = w16 + t * nb * TB;
    for (int h = 0; h < 2 && t * 16 + 8 * h < N; h++) {
      int64_t m0 = 0;
      for (; M - m0 >= 4; m0 += 4) qx16_half_256<FMT, 4>(xq, tile, bias, y, N, K, m0, t * 16, h);
      for (; M - m0 >= 2; m0 += 2) qx16_half_256<FMT, 2>(xq, tile, bias, y, N, K, m0, t * 16, h);
      for (; m0 < M; m0++) qx16_half_256<FMT, 1>(xq, tile, bias, y, N, K, m0, t * 16, h);
    }
  }
}

// ---------------------------------------------------------------------------- AVX2

__attribute__((target("avx2,fma,f16c")))
inline float hsum_2x256(__m256 a, __m256 b) {
  // the same lane order as hsum512: lanes 0..7 are a, 8..15 are b
  __m256 s8 = _mm256_add_ps(a, b);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x55));
  return _mm_cvtss_f32(s1);
}

__attribute__((target("avx2,fma")))
inline __m256 exp_poly256(__m256 x) {
  // exp_poly512's operations on 8 lanes (and so exp_poly's, lane by lane)
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 rr = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, rr, r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// attend_one_512 on AVX2: each 16-lane vector of that path is a pair of 8-lane halves
// (lanes 0..7, 8..15) reduced by hsum_2x256, the same tree; weights and the V sums are
// per element in slot order as there. So both paths give the same bits.
template <int DV, typename KV>
__attribute__((target("avx2,fma")))
void attend_one_256(const float* q, const KV* K, const KV* V, const bool* allow, int64_t S, float scale,
                    float* scores, float* out) {
  constexpr int64_t D = DV * 16;
  for (int64_t j = 0; j < S; j++) {
    const KV* kj = K + j * D;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int d = 0; d < DV; d++) {
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d * 16), kv_load8(kj + d * 16), lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + d * 16 + 8), kv_load8(kj + d * 16 + 8), hi);
    }
    scores[j] = hsum_2x256(lo, hi) * scale;
  }
  float mx = -INFINITY;
  for (int64_t jj = 0; jj < S; jj++)
    if (!allow || allow[jj]) mx = std::max(mx, scores[jj]);
  const __m256 vmx = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 8 <= S; j += 8)
    _mm256_storeu_ps(scores + j, exp_poly256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmx)));
  for (; j < S; j++) scores[j] = exp_poly(scores[j] - mx);
  float sum = 0.0f;
  __m256 acc[2 * DV];
#pragma GCC unroll 32
  for (int d = 0; d < 2 * DV; d++) acc[d] = _mm256_setzero_ps();
  for (int64_t jj = 0; jj < S; jj++) {
    if (allow && !allow[jj]) continue;
    const float w = scores[jj];
    sum += w;
    const __m256 vw = _mm256_set1_ps(w);
#pragma GCC unroll 32
    for (int d = 0; d < 2 * DV; d++) acc[d] = _mm256_fmadd_ps(vw, kv_load8(V + jj * D + d * 8), acc[d]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
#pragma GCC unroll 32
  for (int d = 0; d < 2 * DV; d++) _mm256_storeu_ps(out + d * 8, _mm256_mul_ps(acc[d], inv));
}

__attribute__((target("avx2,fma")))
inline void silu_mul_row_f32_256(const float* gu, float* out, int64_t I) {
  int64_t j = 0;
  for (; j + 8 <= I; j += 8) {
    __m256 g = _mm256_loadu_ps(gu + j), u = _mm256_loadu_ps(gu + I + j);
    __m256 e = exp_poly256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u));
  }
  for (; j < I; j++) out[j] = gu[j] / (1.0f + exp_poly(-gu[j])) * gu[I + j];
}

template <int FMT>
__attribute__((target("avx2,fma,f16c")))
inline void load_block_256(const uint8_t* w, int64_t b, __m256 out[4]) {
  if constexpr (FMT == Q4_1) {
    const uint8_t* blk = w + b * Q4_1_BYTES;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    __m256 m = _mm256_set1_ps(_cvtsh_ss(mh));
    __m128i q = _mm_loadu_si128((const __m128i*)(blk + 4));
    __m128i qlo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    __m128i qhi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qlo)), d, m);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(qlo, 8))), d, m);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qhi)), d, m);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(qhi, 8))), d, m);
  } else if constexpr (FMT == Q8_0) {
    const uint8_t* blk = w + b * Q8_0_BYTES;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    for (int i = 0; i < 4; i++) {
      __m128i q = _mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * i));
      out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    const uint16_t* row = (const uint16_t*)w + b * BLOCK;
    for (int i = 0; i < 4; i++) {
      __m128i r = _mm_loadu_si128((const __m128i*)(row + 8 * i));
      out[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16));
    }
  }
}

template <int FMT>
__attribute__((target("avx2,fma,f16c")))
void kernel_256(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  // two 8-lane accumulators per row stand for the 16 lanes of the AVX-512 path: lanes
  // 0..7 take elements 0..7 and 16..23 of a block, lanes 8..15 elements 8..15 and 24..31,
  // in the same order as there (low half of the block, then high half)
  const int64_t nb = K / BLOCK;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * row_bytes;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int mt = (int)std::min<int64_t>(ROW_TILE, M - m0);
      __m256 a0[ROW_TILE], a1[ROW_TILE];
      for (int t = 0; t < ROW_TILE; t++) a0[t] = a1[t] = _mm256_setzero_ps();
      for (int64_t blk = 0; blk < nb; blk++) {
        __m256 v[4];
        load_block_256<FMT>(wn, blk, v);
        for (int t = 0; t < mt; t++) {
          const float* xr = x + (m0 + t) * K + blk * BLOCK;
          a0[t] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xr), a0[t]);
          a1[t] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), a1[t]);
          a0[t] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xr + 16), a0[t]);
          a1[t] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), a1[t]);
        }
      }
      for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = hsum_2x256(a0[t], a1[t]) + b;
    }
  }
}

// ---------------------------------------------------------------------------- bf16 column tiles
//
// bf16cols: a bf16 model's weights on an AVX-512 CPU without bf16 arithmetic, with no
// horizontal sum per output. The weights are stored in tiles of 16 columns, k by k
// (quant.py interleave16_bf16): at each k one 32-byte load holds the tile's 16 weights,
// widened exactly to float32, and every row multiplies them by its x[k] broadcast into
// its own 16-lane accumulator, lane j being column 16t + j. So each output is
//     y[m, n] = fma(w[n, K-1], x[m, K-1], ... fma(w[n, 1], x[m, 1], w[n, 0] * x[m, 0]) ...) (+ bias)
// in k order: the same operations whatever M is, whichever rows share the call, however
// many tiles a pass takes and whichever thread has the tile, so it is batch-invariant by
// construction. bf16rows sums each column in 16 lanes and a tree instead (another order),
// so the two are different float32 models of the same exact products, and a plan takes
// one of them per matrix. Why: bf16rows widens each weight once per pass but ends every
// output with a 16-lane reduction and reads one column's row at a time; here a verify
// block of 9 rows costs one widening per 16 weights and nine FMAs, nothing else.

constexpr int COLS_GROUP = 12;  // tiles a thread works through together: every pass width (4, 3, 2, 1) divides it

template <int MT, int T>
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
void bf16cols_pass(const float* x, const uint16_t* w, const float* bias, void* y, bool y_bf16, int64_t N, int64_t K,
                   int64_t m0, int64_t tile) {
  __m512 acc[T][MT];
#pragma GCC unroll 4
  for (int c = 0; c < T; c++)
#pragma GCC unroll 9
    for (int r = 0; r < MT; r++) acc[c][r] = _mm512_setzero_ps();
  const uint16_t* wt = w + tile * K * 16;
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; k++) {
    __m512 wv[T];
#pragma GCC unroll 4
    for (int c = 0; c < T; c++)
      wv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wt + (c * K + k) * 16))), 16));
#pragma GCC unroll 9
    for (int r = 0; r < MT; r++) {
      const __m512 xv = _mm512_set1_ps(xr[r * K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < T; c++) acc[c][r] = _mm512_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < T; c++) {
    const int64_t n = (tile + c) * 16;
    if (n >= N) break;
    const __mmask16 mask = (__mmask16)tile_mask16(n, N);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 9
    for (int r = 0; r < MT; r++) {
      const __m512 v = bias ? _mm512_add_ps(acc[c][r], bv) : acc[c][r];
      const int64_t at = (m0 + r) * N + n;
      if (y_bf16) _mm256_mask_storeu_epi16((uint16_t*)y + at, mask, bf16_rne16(v));
      else _mm512_mask_storeu_ps((float*)y + at, mask, v);
    }
  }
}

using ColsPass = void (*)(const float*, const uint16_t*, const float*, void*, bool, int64_t, int64_t, int64_t, int64_t);

// tiles per pass for MT rows: as many accumulators as the registers hold (T * MT <= 18)
template <int MT>
constexpr int cols_width() { return MT <= 4 ? 4 : MT <= 6 ? 3 : 2; }

struct ColsPasses {
  ColsPass wide[10], one[10];
  int width[10];
  int rows;  // the most rows a pass takes (9 on AVX-512, 6 on AVX2): a call's chunk of rows
};

template <int MT>
void fill_cols_passes(ColsPasses& p) {
  p.wide[MT] = bf16cols_pass<MT, cols_width<MT>()>;
  p.one[MT] = bf16cols_pass<MT, 1>;
  p.width[MT] = cols_width<MT>();
  if constexpr (MT > 1) fill_cols_passes<MT - 1>(p);
}

const ColsPasses& cols_passes() {
  static const ColsPasses passes = [] {
    ColsPasses p{};
    fill_cols_passes<9>(p);
    p.rows = 9;
    return p;
  }();
  return passes;
}

// tiles [t0, t1) for all M rows: in groups of COLS_GROUP tiles (held in cache while every
// chunk of up to p.rows rows passes over them), each chunk as wide as its row count allows
void kernel_bf16cols(const float* x, const uint16_t* w, const float* bias, void* y, bool y_bf16, int64_t M,
                     int64_t N, int64_t K, int64_t t0, int64_t t1, const ColsPasses& p) {
  for (int64_t g = t0; g < t1; g += COLS_GROUP) {
    const int64_t g1 = std::min<int64_t>(g + COLS_GROUP, t1);
    for (int64_t m0 = 0; m0 < M; m0 += p.rows) {
      const int mt = (int)std::min<int64_t>(p.rows, M - m0);
      const int width = p.width[mt];
      int64_t t = g;
      for (; t + width <= g1; t += width) p.wide[mt](x, w, bias, y, y_bf16, N, K, m0, t);
      for (; t < g1; t++) p.one[mt](x, w, bias, y, y_bf16, N, K, m0, t);
    }
  }
}

// bf16cols on AVX2: a tile's 16 columns are two 8-lane halves, each lane still one column's
// fused multiply-add chain in k order (the first product fma'd onto zero, the bias added
// after), so every output has the AVX-512 pass's bits. Sixteen registers hold 2 * T * MT
// accumulators, the 2 * T widened weights and one broadcast: T = 2 for up to 2 rows, else T = 1
// for up to 6 rows a pass.
template <int MT, int T>
__attribute__((target("avx2,fma")))
void bf16cols_pass_256(const float* x, const uint16_t* w, const float* bias, void* y, bool y_bf16, int64_t N,
                       int64_t K, int64_t m0, int64_t tile) {
  __m256 acc[2 * T][MT];
#pragma GCC unroll 4
  for (int c = 0; c < 2 * T; c++)
#pragma GCC unroll 6
    for (int r = 0; r < MT; r++) acc[c][r] = _mm256_setzero_ps();
  const uint16_t* wt = w + tile * K * 16;
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; k++) {
    __m256 wv[2 * T];
#pragma GCC unroll 4
    for (int c = 0; c < 2 * T; c++)  // half c & 1 of tile c / 2
      wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wt + ((c >> 1) * K + k) * 16 + 8 * (c & 1)))), 16));
#pragma GCC unroll 6
    for (int r = 0; r < MT; r++) {
      const __m256 xv = _mm256_set1_ps(xr[r * K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < 2 * T; c++) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < 2 * T; c++) {
    const int64_t n = (tile + (c >> 1)) * 16 + 8 * (c & 1);
#pragma GCC unroll 6
    for (int r = 0; r < MT; r++) {
      float out[8];
      _mm256_storeu_ps(out, acc[c][r]);
      for (int j = 0; j < 8 && n + j < N; j++) {
        const float v = bias ? out[j] + bias[n + j] : out[j];
        const int64_t at = (m0 + r) * N + n + j;
        if (y_bf16) ((uint16_t*)y)[at] = float_to_bf16_rne(v);
        else ((float*)y)[at] = v;
      }
    }
  }
}

template <int MT>
void fill_cols_passes_256(ColsPasses& p) {
  p.wide[MT] = bf16cols_pass_256<MT, MT <= 2 ? 2 : 1>;
  p.one[MT] = bf16cols_pass_256<MT, 1>;
  p.width[MT] = MT <= 2 ? 2 : 1;
  if constexpr (MT > 1) fill_cols_passes_256<MT - 1>(p);
}

const ColsPasses& cols_passes_256() {
  static const ColsPasses passes = [] {
    ColsPasses p{};
    fill_cols_passes_256<6>(p);
    p.rows = 6;
    return p;
  }();
  return passes;
}

// ---------------------------------------------------------------------------- scalar

template <int FMT>
void kernel_scalar(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                   int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  // 16 lane accumulators, the AVX-512 path's order, one lane at a time
  const int64_t nb = K / BLOCK;
  float wv[BLOCK];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * row_bytes;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m = 0; m < M; m++) {
      float acc[16] = {0};
      for (int64_t blk = 0; blk < nb; blk++) {
        if (FMT == Q4_1) {
          const uint8_t* p = wn + blk * Q4_1_BYTES;
          uint16_t dh, mh;
          std::memcpy(&dh, p, 2);
          std::memcpy(&mh, p + 2, 2);
          float d = fp16_to_float(dh), mm = fp16_to_float(mh);
          for (int j = 0; j < 16; j++) {
            wv[j] = std::fma((float)(p[4 + j] & 0x0f), d, mm);
            wv[j + 16] = std::fma((float)(p[4 + j] >> 4), d, mm);
          }
        } else if (FMT == Q8_0) {
          const uint8_t* p = wn + blk * Q8_0_BYTES;
          uint16_t dh;
          std::memcpy(&dh, p, 2);
          float d = fp16_to_float(dh);
          for (int j = 0; j < 32; j++) wv[j] = (float)(int8_t)p[2 + j] * d;
        } else {
          const uint16_t* row = (const uint16_t*)wn + blk * BLOCK;
          for (int j = 0; j < 32; j++) {
            uint32_t bits = (uint32_t)row[j] << 16;
            std::memcpy(&wv[j], &bits, 4);
          }
        }
        const float* xr = x + m * K + blk * BLOCK;
        for (int j = 0; j < 16; j++) acc[j] = std::fma(wv[j], xr[j], acc[j]);
        for (int j = 0; j < 16; j++) acc[j] = std::fma(wv[j + 16], xr[j + 16], acc[j]);
      }
      float s8[8], s4[4], s2[2];
      for (int j = 0; j < 8; j++) s8[j] = acc[j] + acc[j + 8];
      for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
      for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
      y[m * N + n] = (s2[0] + s2[1]) + b;
    }
  }
}

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, VNNI = 3, AMX_INT8 = 4 };

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return AVX2;
  return SCALAR;
}

using KernelFn = void (*)(const float*, const uint8_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t);

template <int FMT>
KernelFn pick(int isa) {
  if (isa == AVX512) return kernel_512<FMT>;
  if (isa == AVX2) return kernel_256<FMT>;
  return kernel_scalar<FMT>;
}

int64_t row_bytes_for(int fmt, int64_t K) {
  if (fmt == Q4_1) return K / BLOCK * Q4_1_BYTES;
  if (fmt == Q8_0) return K / BLOCK * Q8_0_BYTES;
  return K * 2;
}

}  // namespace

// a linear's optional bias as float32 (kept alive by `holder`), or nullptr
static const float* float_bias(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->to(torch::kFloat32).contiguous();
  TORCH_CHECK(holder.numel() == N, "bias must have N elements");
  return holder.data_ptr<float>();
}

// isa: -1 the best float kernel for this CPU, 0 scalar, 1 avx2, 2 avx512 (float activations);
// 3 VNNI (int8 activations; q4_1 and q8_0 only; a different numerical model, see above)
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t fmt, int64_t N,
                      int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be contiguous uint8 blocks");
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "unknown weight format");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  const int64_t row_bytes = row_bytes_for((int)fmt, K);
  TORCH_CHECK(w.numel() == N * row_bytes, "w has ", w.numel(), " bytes, expected ", N * row_bytes);
  torch::Tensor b;
  const float* bptr = float_bias(bias, N, b);
  auto y = torch::empty({M, N}, x.options());
  if (isa == VNNI) {
    TORCH_CHECK(fmt != BF16, "the VNNI kernel reads q4_1 and q8_0 weights only");
    TORCH_CHECK(has_vnni(), "this CPU has no AVX-512 VNNI");
    QuantizedRows xq;
    quantize_rows(x.data_ptr<float>(), M, K, xq);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      if (fmt == Q4_1) kernel_vnni<Q4_1>(xq, wp, bptr, yp, M, N, K, row_bytes, n0, n1);
      else kernel_vnni<Q8_0>(xq, wp, bptr, yp, M, N, K, row_bytes, n0, n1);
    });
    return y;
  }
  if (isa < 0) isa = best_isa();
  KernelFn fn = fmt == Q4_1 ? pick<Q4_1>((int)isa) : fmt == Q8_0 ? pick<Q8_0>((int)isa) : pick<BF16>((int)isa);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // columns split across threads; every element's own sum is unchanged by the split
  const int64_t grain = std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { fn(xp, wp, bptr, yp, M, N, K, row_bytes, n0, n1); });
  return y;
}

// x bf16 [M, K], w bf16 rows as uint8; out bf16 (or float32 with out_float)
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N,
                          bool out_float) {
  TORCH_CHECK(has_avx512bf16(), "this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be a 2-D bfloat16 tensor");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be contiguous uint8 (bf16 rows)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  const int64_t n_pad = (N + 3) / 4 * 4;
  TORCH_CHECK(w.numel() == n_pad * K * 2, "w must hold the 4-interleaved rows (N rounded up to 4)");
  torch::Tensor b;
  const float* bptr = float_bias(bias, N, b);
  auto y = torch::empty({M, N}, x.options().dtype(out_float ? torch::kFloat32 : torch::kBFloat16));
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  void* yp = y.data_ptr();
  const int64_t grain = std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
  // split on whole 4-column tiles
  at::parallel_for(0, n_pad / 4, std::max<int64_t>(1, grain / 4), [&](int64_t t0, int64_t t1) {
    kernel_bf16dot(xp, wp, bptr, yp, !out_float, M, N, K, t0 * 4, t1 * 4);
  });
  return y;
}

// x bf16 [M, K], w the AMX groups (quant.py interleave_amx) as uint8; out bf16 (or float32)
torch::Tensor bf16amx_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N,
                             bool out_float) {
  TORCH_CHECK(has_amx_bf16(), "this CPU (or its kernel) offers no AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be a 2-D bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  const int64_t groups = (N + AMX_GROUP - 1) / AMX_GROUP;
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == groups * AMX_GROUP * K * 2,
              "w must hold the AMX groups (N rounded up to 64)");
  torch::Tensor b;
  const float* bptr = float_bias(bias, N, b);
  auto y = torch::empty({M, N}, x.options().dtype(out_float ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0) return y;
  // x in whole 16-row tiles, the padding rows zero: one tile shape for every call (a
  // buffer kept per calling thread: a fresh tensor per call cost ~1 us of a 1-row call)
  const int64_t MP = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  thread_local std::vector<uint16_t> xpad;
  if ((int64_t)xpad.size() < MP * K) xpad.resize(MP * K);
  x = x.contiguous();
  std::memcpy(xpad.data(), x.data_ptr(), M * K * 2);
  std::memset(xpad.data() + M * K, 0, (MP - M) * K * 2);
  const uint16_t* xp = xpad.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  void* yp = y.data_ptr();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    kernel_bf16amx(xp, MP, wp, bptr, yp, !out_float, M, N, K, g0, g1);
  });
  return y;
}

// x float32 or bfloat16 [M, K]; w the 16-column tiles (quant.py interleave16_bf16) as uint8;
// out float32 when x is float32 or out_float, else bfloat16 (rounded to nearest even)
// isa: -1 the best this CPU has, 2 AVX-512, 1 AVX2 (the same bits)
torch::Tensor bf16cols_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N,
                              bool out_float, int64_t isa) {
  if (isa < 0) isa = best_isa() == AVX512 ? AVX512 : AVX2;
  TORCH_CHECK(isa == AVX512 || isa == AVX2, "bf16cols runs on AVX-512 (2) or AVX2 (1)");
  TORCH_CHECK(best_isa() >= isa, isa == AVX512 ? "the bf16cols kernel needs AVX-512F and AVX-512BW"
                                               : "the bf16cols kernel needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == tiles * 16 * K * 2,
              "w must hold the 16-column tiles (N rounded up to 16)");
  const bool y_bf16 = !out_float && x.scalar_type() == torch::kBFloat16;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();  // bf16 widens exactly
  torch::Tensor b;
  const float* bptr = float_bias(bias, N, b);
  auto y = torch::empty({M, N}, x.options().dtype(y_bf16 ? torch::kBFloat16 : torch::kFloat32));
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = (const uint16_t*)w.data_ptr<uint8_t>();
  void* yp = y.data_ptr();
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * std::max(1, at::get_num_threads())));
  const ColsPasses& passes = isa == AVX512 ? cols_passes() : cols_passes_256();
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    kernel_bf16cols(xp, wp, bptr, yp, y_bf16, M, N, K, t0, t1, passes);
  });
  return y;
}

// q [n, H, D], k and v [G, S, D] float32 (G KV heads, H a multiple of G), mask [n, S]
// bool (true = attend) or undefined (every key); returns [n, H, D] float32
// x float32 [M, K]; w the 16-interleaved q4_1 / q8_0 tiles (N rounded up to 16)
// isa: -1 the best this CPU has without AMX, 4 AMX-INT8, 3 VNNI, 1 AVX2 (all give the same bits);
// with 4, calls of at least amx_rows rows (default 1) run on tiles as kernel_qx16_amx says, the rest on VNNI
torch::Tensor qlinear16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t fmt, int64_t N,
                        int64_t isa, int64_t amx_rows) {
  if (isa < 0) isa = has_vnni() ? VNNI : AVX2;
  if (isa == AMX_INT8 && amx_rows <= 0) amx_rows = 1;
  TORCH_CHECK(isa == VNNI || isa == AVX2 || isa == AMX_INT8, "qlinear16 runs on AMX-INT8 (4), VNNI (3) or AVX2 (1)");
  const bool amx = isa == AMX_INT8 && x.size(0) >= amx_rows;
  const bool vnni = isa == VNNI || isa == AMX_INT8;  // AMX-INT8 hosts have VNNI: the rows not on tiles
  TORCH_CHECK(!vnni || has_vnni(), "this CPU has no AVX-512 VNNI");
  TORCH_CHECK(isa != AMX_INT8 || has_amx_int8(), "this CPU (or its kernel) offers no AMX-INT8");
  TORCH_CHECK(vnni || best_isa() >= AVX2, "this CPU has no AVX2");
  TORCH_CHECK(fmt == Q4_1 || fmt == Q8_0, "qlinear16 reads q4_1 and q8_0 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  const int64_t tiles = (N + 15) / 16;
  const int64_t tb = fmt == Q4_1 ? Q4X16_BYTES : Q8X16_BYTES;
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == tiles * nb * tb,
              "w must hold the 16-interleaved tiles");
  torch::Tensor b;
  const float* bptr = float_bias(bias, N, b);
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), M, K, xq);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (amx && fmt == Q4_1) kernel_qx16_amx<Q4_1>(xq, wp, bptr, yp, M, N, K, t0, t1, amx_rows);
    else if (amx) kernel_qx16_amx<Q8_0>(xq, wp, bptr, yp, M, N, K, t0, t1, amx_rows);
    else if (vnni && fmt == Q4_1) kernel_qx16<Q4_1>(xq, wp, bptr, yp, M, N, K, t0, t1);
    else if (vnni) kernel_qx16<Q8_0>(xq, wp, bptr, yp, M, N, K, t0, t1);
    else if (fmt == Q4_1) kernel_qx16_256<Q4_1>(xq, wp, bptr, yp, M, N, K, t0, t1);
    else kernel_qx16_256<Q8_0>(xq, wp, bptr, yp, M, N, K, t0, t1);
  });
  return y;
}

// attention over the first S keys of caches holding `stride` slots per KV head
template <typename KV>
torch::Tensor attention_strided(torch::Tensor q, const KV* kp, const KV* vp, int64_t G, int64_t S, int64_t stride,
                                int64_t D, c10::optional<torch::Tensor> mask, double scale) {
  q = q.contiguous();
  const int64_t n = q.size(0), H = q.size(1);
  TORCH_CHECK(q.size(2) == D && H % G == 0, "shape mismatch");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  const bool* mp = nullptr;
  torch::Tensor mk;
  if (mask.has_value() && mask->defined()) {
    mk = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(mk.size(0) == n && mk.size(1) == S, "mask must be [n, S]");
    mp = mk.data_ptr<bool>();
  }
  auto out = torch::empty({n, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = best_isa() == AVX512, avx2 = best_isa() == AVX2;
  const int64_t per_group = H / G;
  at::parallel_for(0, n * H, 1, [&](int64_t a, int64_t b) {
    std::vector<float> scores(S + 16);
    for (int64_t t = a; t < b; t++) {
      const int64_t i = t / H, h = t % H, g = h / per_group;
      const float* qi = qp + (i * H + h) * D;
      const bool* allow = mp ? mp + i * S : nullptr;
      float* oi = op + (i * H + h) * D;
      const KV* kg = kp + g * stride * D;
      const KV* vg = vp + g * stride * D;
      if (wide && D == 64) attend_one_512<4, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else if (wide && D == 128) attend_one_512<8, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else if (wide && D == 256) attend_one_512<16, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else if (avx2 && D == 64) attend_one_256<4, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else if (avx2 && D == 128) attend_one_256<8, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else if (avx2 && D == 256) attend_one_256<16, KV>(qi, kg, vg, allow, S, (float)scale, scores.data(), oi);
      else attend_one_scalar(qi, kg, vg, allow, S, D, (float)scale, scores.data(), oi);
    }
  });
  return out;
}

// attention_strided over K/V of either element type (`kind`: float32, or bfloat16 bits)
torch::Tensor attention_of(torch::Tensor q, const void* kp, const void* vp, torch::ScalarType kind, int64_t G,
                           int64_t S, int64_t stride, int64_t D, c10::optional<torch::Tensor> mask, double scale) {
  if (kind == torch::kBFloat16)
    return attention_strided(q, (const uint16_t*)kp, (const uint16_t*)vp, G, S, stride, D, mask, scale);
  return attention_strided(q, (const float*)kp, (const float*)vp, G, S, stride, D, mask, scale);
}

// q [n, H, D] float32, k and v [G, S, D] float32 or bfloat16 (both the same; G KV heads, H a
// multiple of G), mask [n, S] bool (true = attend) or undefined (every key); returns [n, H, D]
// float32, computed in float32 either way
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [n, H, D], k and v [G, S, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "attention runs in float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16),
              "k and v must both be float32 or both bfloat16");
  k = k.contiguous();
  v = v.contiguous();
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == q.size(2), "shape mismatch");
  return attention_of(q, k.data_ptr(), v.data_ptr(), k.scalar_type(), k.size(0), k.size(1), k.size(1), k.size(2), mask,
                      scale);
}

// ---------------------------------------------------------------------------- decode-step helpers
//
// Small fused steps of a decoder layer, each replacing several PyTorch ops (a decode step
// of a 135M model issues ~600 of them, ~5 us of dispatch each): RoPE in place, SiLU(gate)
// * up, and writing a row's new K/V into its cache together with its attention. All are
// per-row and per-element, so batch-invariant; attention is `attention` above.

template <typename T>
inline float load_f(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i];
  else { uint32_t b = (uint32_t)((const uint16_t*)p)[i] << 16; float f; std::memcpy(&f, &b, 4); return f; }
}

template <typename T>
inline void store_f(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) p[i] = v;
  else ((uint16_t*)p)[i] = float_to_bf16_rne(v);
}

// x [n, heads, D] in place: x * cos + rotate_half(x) * sin (sin carries rotate_half's sign:
// models/decoder.py RotaryTable), cos / sin [n, D]; each product and the sum in float32,
// rounded once to x's dtype
template <typename T>
void rope_impl(T* x, const T* cos, const T* sin, int64_t n, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  std::vector<float> row(D);
  for (int64_t i = 0; i < n; i++)
    for (int64_t h = 0; h < heads; h++) {
      T* xr = x + (i * heads + h) * D;
      for (int64_t d = 0; d < D; d++) row[d] = load_f(xr, d);
      for (int64_t d = 0; d < D; d++) {
        const float rot = row[(d + half) % D];
        store_f(xr, d, std::fma(rot, load_f(sin, i * D + d), row[d] * load_f(cos, i * D + d)));
      }
    }
}

// the first `heads` heads of every row of qkv [n, row] (q and k; v left alone), in place
void rope_qk_(torch::Tensor qkv, int64_t heads, int64_t D, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * D, "qkv must be [n, row], rows contiguous");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtype mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t n = qkv.size(0), row = qkv.stride(0);
  for (int64_t i = 0; i < n; i++) {
    if (qkv.scalar_type() == torch::kFloat32)
      rope_impl<float>(qkv.data_ptr<float>() + i * row, cos.data_ptr<float>() + i * D, sin.data_ptr<float>() + i * D, 1,
                       heads, D);
    else if (qkv.scalar_type() == torch::kBFloat16)
      rope_impl<uint16_t>((uint16_t*)qkv.data_ptr() + i * row, (const uint16_t*)cos.data_ptr() + i * D,
                          (const uint16_t*)sin.data_ptr() + i * D, 1, heads, D);
    else TORCH_CHECK(false, "rope runs in float32 or bfloat16");
  }
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 3, "x must be a contiguous [n, heads, D] tensor");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtype mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2);
  if (x.scalar_type() == torch::kFloat32)
    rope_impl<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), n, heads, D);
  else if (x.scalar_type() == torch::kBFloat16)
    rope_impl<uint16_t>((uint16_t*)x.data_ptr(), (const uint16_t*)cos.data_ptr(), (const uint16_t*)sin.data_ptr(), n,
                        heads, D);
  else TORCH_CHECK(false, "rope_ runs in float32 or bfloat16");
}

// gate_up [n, 2I] -> silu(gate) * up [n, I], in float32 (g / (1 + exp(-g)) * u), rounded once;
// 16 elements at a time where AVX-512 runs, the same operations one at a time otherwise
__attribute__((target("avx512f,avx512bw,fma")))
inline void silu_mul_row_f32_512(const float* gu, float* out, int64_t I) {
  int64_t j = 0;
  for (; j + 16 <= I; j += 16) {
    __m512 g = _mm512_loadu_ps(gu + j), u = _mm512_loadu_ps(gu + I + j);
    __m512 e = exp_poly512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
  }
  for (; j < I; j++) out[j] = gu[j] / (1.0f + exp_poly(-gu[j])) * gu[I + j];
}

using GatedRow = void (*)(const float* gu, float* out, int64_t I);

// act(gate) * up for each [2I] row of gate_up by `row` (float32 in and out): in place for
// float32 data, through a float32 copy of the row for bf16 (rounded once on the way out)
// Rows are independent, so a many-row call (a verify block, a features sequence) splits them
// over the threads, four rows at least a share: no element's operations change.
template <typename T>
void gated_rows(const T* gu, T* out, int64_t n, int64_t I, GatedRow row) {
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> g, o;
    if constexpr (!std::is_same_v<T, float>) {
      g.resize(2 * I);
      o.resize(I);
    }
    for (int64_t i = r0; i < r1; i++) {
      if constexpr (std::is_same_v<T, float>) {
        row(gu + i * 2 * I, out + i * I, I);
      } else {
        for (int64_t j = 0; j < 2 * I; j++) g[j] = load_f(gu, i * 2 * I + j);
        row(g.data(), o.data(), I);
        for (int64_t j = 0; j < I; j++) store_f(out, i * I + j, o[j]);
      }
    }
  });
}

inline void silu_mul_row_scalar(const float* gu, float* out, int64_t I) {
  for (int64_t j = 0; j < I; j++) out[j] = gu[j] / (1.0f + exp_poly(-gu[j])) * gu[I + j];
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t n, int64_t I) {
  const int isa = best_isa();
  gated_rows(gu, out, n, I, isa == AVX512 ? silu_mul_row_f32_512 : isa == AVX2 ? silu_mul_row_f32_256
                                                                               : silu_mul_row_scalar);
}

// RMSNorm of each row of x [n, H] (float32 sums of squares in a fixed order: 16 lanes, then
// the hsum tree), as models/decoder.py computes it: llama / qwen round the normalized row
// to x's dtype and multiply by the weight (in x's dtype); gemma (offset) multiplies by its
// float32 weight, which already carries the + 1, and rounds once. With `residual`, the
// row normalized is x + residual (rounded to x's dtype), written to `sum`.
// lanes[l] = the fused sum of row[j]^2 over j = l mod 16 in increasing j: the scalar loop's
// sums, one 16-lane fma per 16 elements (H a multiple of 16)
__attribute__((target("avx512f,fma")))
inline void sum_squares_lanes_512(const float* row, int64_t H, float* lanes) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  _mm512_storeu_ps(lanes, acc);
}

// the same lanes on AVX2: lanes 0-7 and 8-15 in two registers, each fma in increasing j
__attribute__((target("avx2,fma")))
inline void sum_squares_lanes_256(const float* row, int64_t H, float* lanes) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    const __m256 a = _mm256_loadu_ps(row + j), b = _mm256_loadu_ps(row + j + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
}

template <typename T>
void rmsnorm_impl(const T* x, const T* residual, T* sum, const void* weight, bool weight_f32, bool offset, T* out,
                  int64_t n, int64_t H, float eps, int64_t weight_rows) {
  const bool wide = H % 16 == 0 && best_isa() == AVX512, wide256 = H % 16 == 0 && best_isa() == AVX2;
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {  // rows alone, as gated_rows
    std::vector<float> row(H);
    for (int64_t i = r0; i < r1; i++) {
      for (int64_t j = 0; j < H; j++) {
        float v = load_f(x, i * H + j);
        if (residual) {
          v = v + load_f(residual, i * H + j);
          store_f(sum, i * H + j, v);
          v = load_f(sum, i * H + j);  // the rounded sum, as the next layer sees it
        }
        row[j] = v;
      }
      float lanes[16] = {0};
      if (wide) sum_squares_lanes_512(row.data(), H, lanes);
      else if (wide256) sum_squares_lanes_256(row.data(), H, lanes);
      else for (int64_t j = 0; j < H; j++) lanes[j % 16] = std::fma(row[j], row[j], lanes[j % 16]);
      float s8[8], s4[4], s2[2];
      for (int l = 0; l < 8; l++) s8[l] = lanes[l] + lanes[l + 8];
      for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
      for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
      const float inv = 1.0f / std::sqrt((s2[0] + s2[1]) / (float)H + eps);
      const int64_t wr = (i % weight_rows) * H;  // per-head norms: row i takes weight row i % heads
      for (int64_t j = 0; j < H; j++) {
        const float w = weight_f32 ? ((const float*)weight)[wr + j] : load_f((const T*)weight, wr + j);
        const float normed = row[j] * inv;
        if (offset) store_f(out, i * H + j, normed * w);
        else {
          store_f(out, i * H + j, normed);  // round to x's dtype first (a no-op in float32)
          store_f(out, i * H + j, load_f(out, i * H + j) * w);
        }
      }
    }
  });
}

std::vector<torch::Tensor> rmsnorm(torch::Tensor x, torch::Tensor weight, double eps, bool offset,
                                   c10::optional<torch::Tensor> residual) {
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2, "x must be [n, H]");
  const int64_t n = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.numel() % H == 0, "weight must have H values per row");
  const int64_t weight_rows = weight.numel() / H;
  weight = weight.contiguous();
  const bool wf32 = weight.scalar_type() == torch::kFloat32;
  TORCH_CHECK(wf32 || weight.scalar_type() == x.scalar_type(), "weight dtype mismatch");
  torch::Tensor res, sum;
  if (residual.has_value() && residual->defined()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must match x");
    sum = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kFloat32)
    rmsnorm_impl<float>(x.data_ptr<float>(), res.defined() ? res.data_ptr<float>() : nullptr,
                        sum.defined() ? sum.data_ptr<float>() : nullptr, weight.data_ptr(), wf32, offset,
                        out.data_ptr<float>(), n, H, (float)eps, weight_rows);
  else if (x.scalar_type() == torch::kBFloat16)
    rmsnorm_impl<uint16_t>((const uint16_t*)x.data_ptr(), res.defined() ? (const uint16_t*)res.data_ptr() : nullptr,
                           sum.defined() ? (uint16_t*)sum.data_ptr() : nullptr, weight.data_ptr(), wf32, offset,
                           (uint16_t*)out.data_ptr(), n, H, (float)eps, weight_rows);
  else TORCH_CHECK(false, "rmsnorm runs in float32 or bfloat16");
  if (sum.defined()) return {out, sum};
  return {out};
}

// gelu_tanh(gate) * up: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u, with tanh(z) =
// 1 - 2 / (exp(2z) + 1) on the same exp polynomial, in float32, rounded once. 16 elements
// at a time where AVX-512 runs, by the scalar tail's operations in its order (no fused
// multiply-adds outside exp: the file is built with -ffp-contract=off), so every element
// has the same bits either way. Vectorized because the scalar loop was ~14 ns an element:
// 4 ms of Gemma-3-270M's 8-token verify forward.
inline float gelu_mul_one(float g, float u) {
  const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float t = 1.0f - 2.0f / (exp_poly(2.0f * z) + 1.0f);
  return 0.5f * g * (1.0f + t) * u;
}

__attribute__((target("avx512f,avx512bw,fma")))
inline void gelu_mul_row_f32_512(const float* gu, float* out, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  int64_t j = 0;
  for (; j + 16 <= I; j += 16) {
    const __m512 g = _mm512_loadu_ps(gu + j), u = _mm512_loadu_ps(gu + I + j);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, cube));
    const __m512 e = exp_poly512(_mm512_mul_ps(two, z));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g),
                                                          _mm512_add_ps(one, t)), u));
  }
  for (; j < I; j++) out[j] = gelu_mul_one(gu[j], gu[I + j]);
}

// The same 8 lanes at a time on AVX2 (the scalar loop cost Gemma-3-270M's features ~9% of
// their time on an AVX2 EPYC: ~20 ns an element)
__attribute__((target("avx2,fma")))
inline void gelu_mul_row_f32_256(const float* gu, float* out, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  int64_t j = 0;
  for (; j + 8 <= I; j += 8) {
    const __m256 g = _mm256_loadu_ps(gu + j), u = _mm256_loadu_ps(gu + I + j);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), g), g);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(g, cube));
    const __m256 e = exp_poly256(_mm256_mul_ps(two, z));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g),
                                                          _mm256_add_ps(one, t)), u));
  }
  for (; j < I; j++) out[j] = gelu_mul_one(gu[j], gu[I + j]);
}

inline void gelu_mul_row_scalar(const float* gu, float* out, int64_t I) {
  for (int64_t j = 0; j < I; j++) out[j] = gelu_mul_one(gu[j], gu[I + j]);
}

template <typename T>
void gelu_mul_impl(const T* gu, T* out, int64_t n, int64_t I) {
  const int isa = best_isa();
  gated_rows(gu, out, n, I, isa == AVX512 ? gelu_mul_row_f32_512 : isa == AVX2 ? gelu_mul_row_f32_256
                                                                               : gelu_mul_row_scalar);
}

// act(gate) * up for [n, 2I] rows (gate, up halves), in the input's dtype; `impl` is the
// per-dtype loop (silu_mul_impl / gelu_mul_impl), called with float* or uint16_t* (bf16)
template <typename Impl>
torch::Tensor gated_product(torch::Tensor gate_up, const char* name, Impl impl) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [n, 2I]");
  gate_up = gate_up.contiguous();
  const int64_t n = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({n, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) impl(gate_up.data_ptr<float>(), out.data_ptr<float>(), n, I);
  else if (gate_up.scalar_type() == torch::kBFloat16)
    impl((const uint16_t*)gate_up.data_ptr(), (uint16_t*)out.data_ptr(), n, I);
  else TORCH_CHECK(false, name, " runs in float32 or bfloat16");
  return out;
}

torch::Tensor gelu_mul(torch::Tensor gate_up) {
  return gated_product(gate_up, "gelu_mul",
                       [](const auto* gu, auto* out, int64_t n, int64_t I) { gelu_mul_impl(gu, out, n, I); });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  return gated_product(gate_up, "silu_mul",
                       [](const auto* gu, auto* out, int64_t n, int64_t I) { silu_mul_impl(gu, out, n, I); });
}

// One row's new K/V (k_new, v_new [n, G, D]) into its cache (cache_k, cache_v [G, S, D], slot
// of position p = p % S: a linear cache is never wrapped, a sliding ring wraps), then its
// attention over slots [0, n_view) with `mask` ([n, n_view] or undefined), all float32
torch::Tensor attend_cached(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor cache_k,
                            torch::Tensor cache_v, int64_t start, int64_t n_view, c10::optional<torch::Tensor> mask,
                            double scale) {
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous(), "caches must be contiguous");
  const auto kind = cache_k.scalar_type();
  TORCH_CHECK(cache_v.scalar_type() == kind && (kind == torch::kFloat32 || kind == torch::kBFloat16),
              "caches must both be float32 or both bfloat16");
  const int64_t n = k_new.size(0), G = k_new.size(1), D = k_new.size(2), S = cache_k.size(1);
  TORCH_CHECK(n_view <= S, "n_view beyond the cache");
  // the new rows in the cache's dtype (exact where they hold that dtype's numbers: a bf16
  // model's K/V in a bf16 cache), copied slot by slot
  k_new = k_new.to(kind).contiguous();
  v_new = v_new.to(kind).contiguous();
  const int64_t bytes = D * (int64_t)cache_k.element_size();
  char* ck = (char*)cache_k.data_ptr();
  char* cv = (char*)cache_v.data_ptr();
  const char* kn = (const char*)k_new.data_ptr();
  const char* vn = (const char*)v_new.data_ptr();
  for (int64_t i = 0; i < n; i++) {
    const int64_t slot = (start + i) % S;
    for (int64_t g = 0; g < G; g++) {
      std::memcpy(ck + (g * S + slot) * bytes, kn + (i * G + g) * bytes, bytes);
      std::memcpy(cv + (g * S + slot) * bytes, vn + (i * G + g) * bytes, bytes);
    }
  }
  return attention_of(q.to(torch::kFloat32), ck, cv, kind, G, n_view, S, D, mask, scale);
}

int64_t isa() { return best_isa(); }
bool bf16dot() { return has_avx512bf16(); }
bool bf16amx() { return has_amx_bf16(); }
bool vnni() { return has_vnni(); }
bool amx_int8() { return has_amx_int8(); }
int64_t int8dot() { return has_vnni() ? VNNI : best_isa() >= AVX2 ? AVX2 : 0; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "weight-only linear over q4_1 / q8_0 / bf16 rows (batch-invariant)");
  m.def("isa", &isa, "the ISA the float kernels dispatch to: 0 scalar, 1 avx2, 2 avx512");
  m.def("vnni", &vnni, "whether the int8-activation VNNI kernel runs here");
  m.def("bf16_linear", &bf16_linear, "bf16 x bf16 linear with float32 sums (AVX512-BF16, batch-invariant)");
  m.def("amx_int8", &amx_int8, "whether qlinear16's AMX-INT8 path runs here (CPU and kernel permission)");
  m.def("qlinear16", &qlinear16, "q4_1 / q8_0 16-column tiles x int8 activations (AMX-INT8, VNNI or AVX2; batch-invariant)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("fmt"), py::arg("N"), py::arg("isa") = -1,
        py::arg("amx_rows") = 0);
  m.def("int8dot", &int8dot, "the ISA of the int8-activation kernels here: 3 VNNI, 1 AVX2, 0 none");
  m.def("rope_", &rope_, "RoPE in place (float32 / bfloat16)");
  m.def("rope_qk_", &rope_qk_, "RoPE in place on the q and k heads of fused qkv rows");
  m.def("rmsnorm", &rmsnorm, "RMSNorm of rows ([normed]), or of x + residual ([normed, sum])");
  m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up of a fused gate_up output");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up output");
  m.def("attend_cached", &attend_cached, "write a row's K/V into its cache (float32 or bfloat16), then attend in float32");
  m.def("attention", &attention, "attention computed per (query, head), batch-invariant");
  m.def("bf16dot", &bf16dot, "whether the AVX512-BF16 kernel runs here");
  m.def("bf16amx", &bf16amx, "whether the AMX-BF16 kernel runs here (CPU and kernel permission)");
  m.def("bf16cols_linear", &bf16cols_linear, "bf16 weights in 16-column tiles x float32 activations, sums in k order (AVX-512F or AVX2, the same bits; batch-invariant)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("N"), py::arg("out_float"), py::arg("isa") = -1);
  m.def("bf16amx_linear", &bf16amx_linear, "bf16 x bf16 linear with float32 sums on AMX tiles (batch-invariant)");
}
