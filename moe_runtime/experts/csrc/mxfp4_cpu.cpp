// Fused MXFP4 decode + GEMM for CPUs with AVX2 + FMA (DESIGN §8): out[t, n] = sum_k x[t, k] * W[n, k]
// where W is MXFP4 (uint8 nibbles + E8M0 scale per block of 32), decoded in registers, never
// written to memory. Accumulation in fp32. Built on first use by moe_runtime/experts/mxfp4_cpu.py
// (plain C ABI, loaded with ctypes; OpenMP resolves to the libgomp torch already loaded).
//
// Exactness: every decoded weight equals the reference decode (mxfp4.decode: FP4 value * 2**(s-127)
// in fp32): the lookup gives 2 * value as a small integer, converted exactly, times 2**(s-128)
// (a power of two, exact down to 2**-128, the smallest magnitude an FP4 value times an E8M0 scale
// can take; overflow to inf happens for the same elements). Products x * w are exact in fp32 for
// bf16/fp16 x (at most 11 + 2 significant bits); only the order of the fp32 additions differs
// from a BLAS GEMM.
//
// Layout: x [T, K] fp32 in "nibble order": within each block of 32, the 16 even elements then the
// 16 odd ones (the low nibbles of a block's 16 bytes are its even elements, the high nibbles its
// odd ones), so one 16-byte load decodes to four 8-lane vectors that meet x with plain loads.
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
  const uint8_t* p;
  const uint8_t* s;
  __m128i lut;
  inline void operator()(int64_t b, __m256 w[4]) const {
    decode_block(p + b * (BLOCK / 2), kTables.scale[s[b]], lut, w[0], w[1], w[2], w[3]);
  }
};

struct Bf16Row {  // x in natural order; bf16 -> fp32 is exact (the bits shifted up by 16)
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

template <class Row>
inline void one_row(const Row& row, const float* x, int64_t T, int64_t K, int64_t b0, int64_t b1, float* out,
                    int64_t ldo) {
  // 4 tokens x 2 accumulators + 4 weight vectors + constants fit AVX2's 16 registers (6 tokens spill)
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

}  // namespace

extern "C" {

// x [T, K] fp32 (nibble order), packed [N, K/2] uint8, scale [N, K/32] uint8, out [T, N] fp32
// (row stride ldo). K must be a multiple of 32; all tensors contiguous.
void mxfp4_linear(const float* x, int64_t T, int64_t K, const uint8_t* packed, const uint8_t* scale,
                  int64_t N, float* out, int64_t ldo, int nthreads) {
  const __m128i lut = lut_x2();
  linear(x, T, K, N, out, ldo, nthreads,
         [=](int64_t n) { return Mxfp4Row{packed + n * (K / 2), scale + n * (K / BLOCK), lut}; });
}

// x [T, K] fp32, w [N, K] bf16 (as uint16 bits), out [T, N] fp32. K a multiple of 32.
void bf16_linear(const float* x, int64_t T, int64_t K, const uint16_t* w, int64_t N, float* out, int64_t ldo,
                 int nthreads) {
  linear(x, T, K, N, out, ldo, nthreads, [=](int64_t n) { return Bf16Row{w + n * K}; });
}

int mxfp4_abi_version() { return 3; }
}
