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

// The vector operations the token loop needs, per width: 8 fp32 lanes (AVX2, 16 registers) or
// 16 (AVX-512, 32 registers).
struct Vec8 {
  using T = __m256;
  static constexpr int lanes = 8, registers = 16;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float sum(T v) { return hsum(v); }
};

// The 32 weights of block b of one row as four 8-lane fp32 vectors, in the order x is laid out.
struct Mxfp4Row {  // x in nibble order (see the header)
  using V = Vec8;
  const uint8_t* p;
  const uint8_t* s;
  __m128i lut;
  inline void operator()(int64_t b, __m256 w[4]) const {
    decode_block(p + b * (BLOCK / 2), kTables.scale[s[b]], lut, w[0], w[1], w[2], w[3]);
  }
};

struct Bf16Row {  // x in natural order; bf16 -> fp32 is exact (the bits shifted up by 16)
  using V = Vec8;
  const uint16_t* w;
  inline void operator()(int64_t b, __m256 out[4]) const {
    const uint16_t* q = w + b * BLOCK;
    for (int v = 0; v < 4; ++v) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * v));
      out[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
};

#if defined(__AVX512F__)
// The 16-lane variants (AVX-512F: twice the lanes and 32 registers). A block of MXFP4 weights
// decodes through a 16-entry fp32 lookup of 2 * value, scaled once per block by 2**(s-128)
// (exact, as above): two permutes give its 16 even and its 16 odd weights.
inline __m512 lut16_x2() { return _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

struct Vec16 {
  using T = __m512;
  static constexpr int lanes = 16, registers = 32;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};

struct Mxfp4Row16 {  // x in nibble order
  using V = Vec16;
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
  using V = Vec16;
  const uint16_t* w;
  inline void operator()(int64_t b, __m512 out[2]) const {
    const uint16_t* q = w + b * BLOCK;
    for (int v = 0; v < 2; ++v) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * v));
      out[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
};
#endif

// Accumulators per token for TB tokens: 4 (more independent FMA chains, so few tokens are not
// bound by the FMA latency) while they and a block's weight vectors fit 3/4 of the registers.
template <class V>
constexpr int accumulators(int TB) {
  return TB * 4 + BLOCK / V::lanes <= 3 * V::registers / 4 ? 4 : 2;
}

// TB tokens of one row over blocks [b0, b1), added to out[t * ldo]. A block gives BLOCK / lanes
// weight vectors; with more accumulators than that, consecutive blocks use their own sets.
template <int TB, class Row>
inline void row_tokens(const Row& row, const float* x, int64_t ldx, int64_t b0, int64_t b1, float* out,
                       int64_t ldo) {
  using V = typename Row::V;
  constexpr int per = BLOCK / V::lanes, NA = accumulators<V>(TB), sets = NA > per ? NA / per : 1;
  typename V::T acc[TB][NA];
  for (int t = 0; t < TB; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = V::zero();
  auto step = [&](int64_t b, int set) {
    typename V::T w[per];
    row(b, w);
    const float* xb = x + b * BLOCK;
    for (int t = 0; t < TB; ++t)
      for (int v = 0; v < per; ++v) {
        const int a = (set * per + v) % NA;
        acc[t][a] = V::fma(w[v], V::load(xb + t * ldx + V::lanes * v), acc[t][a]);
      }
  };
  int64_t b = b0;
  for (; b + sets <= b1; b += sets)
    for (int s = 0; s < sets; ++s) step(b + s, s);
  for (; b < b1; ++b) step(b, 0);
  for (int t = 0; t < TB; ++t) {
    typename V::T s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = V::add(s, acc[t][a]);
    out[t * ldo] += V::sum(s);
  }
}

// The last TB or fewer tokens (a compile-time count each).
template <int TB, class Row>
inline void tail_tokens(const Row& row, int64_t left, const float* x, int64_t K, int64_t b0, int64_t b1,
                        float* out, int64_t ldo) {
  if constexpr (TB > 0) {
    if (left == TB)
      row_tokens<TB>(row, x, K, b0, b1, out, ldo);
    else
      tail_tokens<TB - 1>(row, left, x, K, b0, b1, out, ldo);
  }
}

template <class Row>
inline void one_row(const Row& row, const float* x, int64_t T, int64_t K, int64_t b0, int64_t b1, float* out,
                    int64_t ldo) {
  // tokens per pass, 2 accumulators each: with the weight vectors 12 of AVX2's 16 registers (6
  // tokens spilled), 18 of AVX-512's 32
  constexpr int G = Row::V::lanes == 16 ? 8 : 4;
  int64_t t = 0;
  for (; t + G <= T; t += G) row_tokens<G>(row, x + t * K, K, b0, b1, out + t * ldo, ldo);
  tail_tokens<G - 1>(row, T - t, x + t * K, K, b0, b1, out + t * ldo, ldo);
}

constexpr int64_t ROW_TILE = 8;
constexpr int64_t X_CHUNK_BYTES = 16384;  // x's slice of a K chunk for all tokens: within L1
// Up to this much x (a few tokens) the rows are read whole, in one sweep: x stays in L2 anyway, and
// a row read in K chunks is a strided stream the prefetchers serve worse (a K3 expert at 2 / 3 / 4
// tokens: 2.04 / 2.58 / 3.15 ms in chunks, 1.76 / 2.01 / 2.60 ms whole; AVX-512, 2 threads).
constexpr int64_t X_WHOLE_BYTES = 65536;

// out [T, N] = x [T, K] . W^T, rows of W from make_row(n). Row tiles in parallel; within a tile,
// K in chunks whose x slice stays in L1 while every row of the tile and every token uses it.
// Tiles are handed out in small runs as threads free up, not in one static half each: on a shared
// machine a thread that loses its core for a while no longer holds up the call's end (every row is
// still computed by one thread in one order: the results do not depend on the schedule).
template <class MakeRow>
void linear(const float* x, int64_t T, int64_t K, int64_t N, float* out, int64_t ldo, int nthreads,
            MakeRow make_row) {
  const int64_t nblocks = K / BLOCK;
  int64_t chunk = X_CHUNK_BYTES / (4 * BLOCK * (T > 0 ? T : 1));
  chunk = chunk < 8 ? 8 : chunk;  // >= 256 elements: the per-chunk horizontal sums stay cheap
  if (4 * T * K <= X_WHOLE_BYTES) chunk = nblocks;
  const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads)
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
#pragma omp parallel for schedule(dynamic, 32) num_threads(nthreads)  // as linear's tiles
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
