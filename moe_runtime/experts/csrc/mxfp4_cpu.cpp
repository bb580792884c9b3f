// Fused MXFP4 decode + GEMM on CPU (DESIGN §8): out[t, n] = sum_k x[t, k] * W[n, k] where W is
// MXFP4 (uint8 nibbles + E8M0 scale per block of 32), decoded in registers, never written to
// memory; and the plain decode of W (mxfp4_decode) for the batched path, which multiplies decoded
// tiles with torch's GEMM. Accumulation in fp32. Built on first use by
// moe_runtime/experts/mxfp4_cpu.py (plain C ABI, loaded with ctypes; OpenMP resolves to the libgomp
// torch already loaded), twice where the CPU has AVX-512: with -mavx2 -mfma, and with AVX-512
// flags added, which compiles the 16-lane variants under __AVX512F__ below.
//
// Exactness: every decoded weight equals the reference decode (mxfp4.decode: FP4 value * 2**(s-127)
// in fp32): the lookup gives 2 * value as a small integer, converted exactly, times 2**(s-128)
// (a power of two, exact down to 2**-128, the smallest magnitude an FP4 value times an E8M0 scale
// can take; overflow to inf happens for the same elements). Products x * w are exact in fp32 for
// bf16/fp16 x (at most 11 + 2 significant bits); only the order of the fp32 additions differs
// from a BLAS GEMM. A decoded weight is exact in bf16 too (<= 2 significant bits, bf16 has fp32's
// exponent range and reaches 2**-133), so mxfp4_decode's bf16 output is the fp32 value's upper
// half: truncation, no rounding.
//
// Layout: x [T, K] fp32 in "nibble order": within each block of 32, the 16 even elements then the
// 16 odd ones (the low nibbles of a block's 16 bytes are its even elements, the high nibbles its
// odd ones), so one 16-byte load decodes to vectors that meet x with plain loads.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int BLOCK = 32;

struct Tables {
  float scale[256];  // 2**(s - 128): the E8M0 scale times 1/2 (the lookup holds 2 * value)
  Tables() {
    for (int s = 0; s < 256; ++s) scale[s] = ldexpf(1.0f, s - 128);
  }
};
const Tables kTables;

// 2 * FP4 value of each code: 0 0.5 1 1.5 2 3 4 6, bit 3 the sign
inline __m128i lut_x2() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

// One block of one row: 32 weights as four 8-lane fp32 vectors (even 0-7, even 8-15, odd 0-7, odd 8-15).
inline void decode_block(const uint8_t* p, float s, __m128i lut, __m256& w0, __m256& w1, __m256& w2,
                         __m256& w3) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  const __m256 sc = _mm256_set1_ps(s);
  w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), sc);
  w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))), sc);
  w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), sc);
  w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi))), sc);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of block b of one row as four 8-lane fp32 vectors, in the order x is laid out.
struct Mxfp4Row {  // x in nibble order (see the header)
  static constexpr int lanes = 8;
  const uint8_t* p;
  const uint8_t* s;
  __m128i lut;
  inline void operator()(int64_t b, __m256 w[4]) const {
    decode_block(p + b * (BLOCK / 2), kTables.scale[s[b]], lut, w[0], w[1], w[2], w[3]);
  }
};

struct Bf16Row {  // x in natural order; bf16 -> fp32 is exact (the bits shifted up by 16)
  static constexpr int lanes = 8;
  const uint16_t* w;
  inline void operator()(int64_t b, __m256 out[4]) const {
    const uint16_t* q = w + b * BLOCK;
    for (int v = 0; v < 4; ++v) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * v));
      out[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
};

// TB tokens of one row over blocks [b0, b1), added to out[t * ldo]; NA independent accumulators
// per token (more when TB is small, so the FMA latency chain does not bound a GEMV).
template <int TB, int NA, class Row>
inline void row_tokens(const Row& row, const float* x, int64_t ldx, int64_t b0, int64_t b1, float* out,
                       int64_t ldo) {
  __m256 acc[TB][NA];
  for (int t = 0; t < TB; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    __m256 w[4];
    row(b, w);
    const float* xb = x + b * BLOCK;
    for (int t = 0; t < TB; ++t) {
      const float* xt = xb + t * ldx;
      for (int v = 0; v < 4; ++v)
        acc[t][v % NA] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xt + 8 * v), acc[t][v % NA]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[t][a]);
    out[t * ldo] += hsum(s);
  }
}

#if defined(__AVX512F__)
// The 16-lane variants (AVX-512F: twice the lanes and 32 registers). A block of MXFP4 weights
// decodes through a 16-entry fp32 lookup of 2 * value, scaled once per block by 2**(s-128)
// (exact, as above): two permutes give its 16 even and its 16 odd weights.
inline __m512 lut16_x2() { return _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

struct Mxfp4Row16 {  // x in nibble order
  static constexpr int lanes = 16;
  const uint8_t* p;
  const uint8_t* s;
  inline void operator()(int64_t b, __m512 w[2]) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * (BLOCK / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 lut = _mm512_mul_ps(lut16_x2(), _mm512_set1_ps(kTables.scale[s[b]]));
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)), lut);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)), lut);
  }
};

struct Bf16Row16 {  // x in natural order
  static constexpr int lanes = 16;
  const uint16_t* w;
  inline void operator()(int64_t b, __m512 out[2]) const {
    const uint16_t* q = w + b * BLOCK;
    for (int v = 0; v < 2; ++v) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * v));
      out[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
};

// TB tokens of one row over blocks [b0, b1); with NA == 4 two blocks in flight per token (their
// own accumulators), so one or two tokens are not bound by the FMA latency chain.
template <int TB, int NA, class Row>
inline void row_tokens16(const Row& row, const float* x, int64_t ldx, int64_t b0, int64_t b1, float* out,
                         int64_t ldo) {
  __m512 acc[TB][NA];
  for (int t = 0; t < TB; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int a) {
    __m512 w[2];
    row(b, w);
    const float* xb = x + b * BLOCK;
    for (int t = 0; t < TB; ++t) {
      acc[t][a] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + t * ldx), acc[t][a]);
      acc[t][a + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + t * ldx + 16), acc[t][a + 1]);
    }
  };
  int64_t b = b0;
  if constexpr (NA == 4)
    for (; b + 2 <= b1; b += 2) {
      step(b, 0);
      step(b + 1, 2);
    }
  for (; b < b1; ++b) step(b, 0);
  for (int t = 0; t < TB; ++t) {
    __m512 s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = _mm512_add_ps(s, acc[t][a]);
    out[t * ldo] += _mm512_reduce_add_ps(s);
  }
}
#endif

#if defined(__AVX512F__)
template <class Row>
inline void one_row16(const Row& row, const float* x, int64_t T, int64_t K, int64_t b0, int64_t b1, float* out,
                      int64_t ldo) {
  // 8 tokens x 2 accumulators + 2 weight vectors + constants fit AVX-512's 32 registers
  int64_t t = 0;
  for (; t + 8 <= T; t += 8) row_tokens16<8, 2>(row, x + t * K, K, b0, b1, out + t * ldo, ldo);
  const float* xt = x + t * K;
  float* ot = out + t * ldo;
  switch (T - t) {
    case 7: row_tokens16<7, 2>(row, xt, K, b0, b1, ot, ldo); break;
    case 6: row_tokens16<6, 2>(row, xt, K, b0, b1, ot, ldo); break;
    case 5: row_tokens16<5, 2>(row, xt, K, b0, b1, ot, ldo); break;
    case 4: row_tokens16<4, 2>(row, xt, K, b0, b1, ot, ldo); break;
    case 3: row_tokens16<3, 4>(row, xt, K, b0, b1, ot, ldo); break;
    case 2: row_tokens16<2, 4>(row, xt, K, b0, b1, ot, ldo); break;
    case 1: row_tokens16<1, 4>(row, xt, K, b0, b1, ot, ldo); break;
    default: break;
  }
}
#endif

template <class Row>
inline void one_row(const Row& row, const float* x, int64_t T, int64_t K, int64_t b0, int64_t b1, float* out,
                    int64_t ldo) {
#if defined(__AVX512F__)
  if constexpr (Row::lanes == 16) {
    one_row16(row, x, T, K, b0, b1, out, ldo);
  } else
#endif
  {
    // 4 tokens x 2 accumulators + 4 weight vectors + constants fit AVX2's 16 registers (6 spill)
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) row_tokens<4, 2>(row, x + t * K, K, b0, b1, out + t * ldo, ldo);
    const float* xt = x + t * K;
    float* ot = out + t * ldo;
    switch (T - t) {
      case 3: row_tokens<3, 2>(row, xt, K, b0, b1, ot, ldo); break;
      case 2: row_tokens<2, 4>(row, xt, K, b0, b1, ot, ldo); break;
      case 1: row_tokens<1, 4>(row, xt, K, b0, b1, ot, ldo); break;
      default: break;
    }
  }
}

constexpr int64_t ROW_TILE = 8;
constexpr int64_t X_CHUNK_BYTES = 16384;  // x's slice of a K chunk for all tokens: within L1

// out [T, N] = x [T, K] . W^T, rows of W from make_row(n). Row tiles in parallel; within a tile,
// K in chunks whose x slice stays in L1 while every row of the tile and every token uses it.
template <class MakeRow>
void linear(const float* x, int64_t T, int64_t K, int64_t N, float* out, int64_t ldo, int nthreads,
            MakeRow make_row) {
  const int64_t nblocks = K / BLOCK;
  int64_t chunk = X_CHUNK_BYTES / (4 * BLOCK * (T > 0 ? T : 1));
  chunk = chunk < 8 ? 8 : chunk;  // >= 256 elements: the per-chunk horizontal sums stay cheap
  const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * ROW_TILE, n1 = n0 + ROW_TILE < N ? n0 + ROW_TILE : N;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t = 0; t < T; ++t) out[t * ldo + n] = 0.0f;
    for (int64_t b0 = 0; b0 < nblocks; b0 += chunk) {
      const int64_t b1 = b0 + chunk < nblocks ? b0 + chunk : nblocks;
      for (int64_t n = n0; n < n1; ++n) one_row(make_row(n), x, T, K, b0, b1, out + n, ldo);
    }
  }
}

// One block of 32 weights in natural order, written as fp32 or as bf16 (the fp32 bits' upper half:
// exact, see the header).
inline void store_block(const __m256 w[4], float* out) {
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + 8 * v, w[v]);
}
inline void store_block(const __m256 w[4], uint16_t* out) {
  for (int v = 0; v < 4; v += 2) {
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(w[v]), 16);
    const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(w[v + 1]), 16);
    // packus works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * v), ab);
  }
}

template <class Out>
void decode_rows(const uint8_t* packed, const uint8_t* scale, int64_t N, int64_t K, Out* out, int nthreads) {
  const int64_t nblocks = K / BLOCK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* p = packed + n * (K / 2);
    const uint8_t* s = scale + n * nblocks;
    Out* o = out + n * K;
#if defined(__AVX512F__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    // interleave the even and odd weights back into natural order
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t b = 0; b < nblocks; ++b) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * (BLOCK / 2)));
      const __m512 lut = _mm512_mul_ps(lut16_x2(), _mm512_set1_ps(kTables.scale[s[b]]));
      const __m512 even = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)), lut);
      const __m512 odd = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)), lut);
      const __m512 w[2] = {_mm512_permutex2var_ps(even, first, odd), _mm512_permutex2var_ps(even, second, odd)};
      for (int v = 0; v < 2; ++v) {
        if constexpr (sizeof(Out) == 4)
          _mm512_storeu_ps(reinterpret_cast<float*>(o) + b * BLOCK + 16 * v, w[v]);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + b * BLOCK + 16 * v),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(w[v]), 16)));
      }
    }
#else
    const __m128i lut = lut_x2(), mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nblocks; ++b) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * (BLOCK / 2)));
      const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));
      const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
      const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // elements 0-15, 16-31
      const __m256 sc = _mm256_set1_ps(kTables.scale[s[b]]);
      const __m128i parts[4] = {first, _mm_unpackhi_epi64(first, first), second, _mm_unpackhi_epi64(second, second)};
      __m256 w[4];
      for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[v])), sc);
      store_block(w, o + b * BLOCK);
    }
#endif
  }
}

}  // namespace

extern "C" {

// x [T, K] fp32 (nibble order), packed [N, K/2] uint8, scale [N, K/32] uint8, out [T, N] fp32
// (row stride ldo). K must be a multiple of 32; all tensors contiguous.
void mxfp4_linear(const float* x, int64_t T, int64_t K, const uint8_t* packed, const uint8_t* scale,
                  int64_t N, float* out, int64_t ldo, int nthreads) {
#if defined(__AVX512F__)
  linear(x, T, K, N, out, ldo, nthreads,
         [=](int64_t n) { return Mxfp4Row16{packed + n * (K / 2), scale + n * (K / BLOCK)}; });
#else
  const __m128i lut = lut_x2();
  linear(x, T, K, N, out, ldo, nthreads,
         [=](int64_t n) { return Mxfp4Row{packed + n * (K / 2), scale + n * (K / BLOCK), lut}; });
#endif
}

// x [T, K] fp32, w [N, K] bf16 (as uint16 bits), out [T, N] fp32. K a multiple of 32.
void bf16_linear(const float* x, int64_t T, int64_t K, const uint16_t* w, int64_t N, float* out, int64_t ldo,
                 int nthreads) {
#if defined(__AVX512F__)
  linear(x, T, K, N, out, ldo, nthreads, [=](int64_t n) { return Bf16Row16{w + n * K}; });
#else
  linear(x, T, K, N, out, ldo, nthreads, [=](int64_t n) { return Bf16Row{w + n * K}; });
#endif
}

// packed [N, K/2] uint8, scale [N, K/32] uint8 -> out [N, K] in natural order, fp32 (bf16 == 0)
// or bf16 bits (bf16 == 1). K a multiple of 32; all tensors contiguous.
void mxfp4_decode(const uint8_t* packed, const uint8_t* scale, int64_t N, int64_t K, void* out, int bf16,
                  int nthreads) {
  if (bf16)
    decode_rows(packed, scale, N, K, static_cast<uint16_t*>(out), nthreads);
  else
    decode_rows(packed, scale, N, K, static_cast<float*>(out), nthreads);
}

// The vector width the kernels were compiled for: 16 fp32 lanes (AVX-512) or 8 (AVX2).
int mxfp4_lanes() {
#if defined(__AVX512F__)
  return 16;
#else
  return 8;
#endif
}

int mxfp4_abi_version() { return 4; }
}
