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

// TB tokens of one row; NA independent accumulators per token (more when TB is small, so the FMA
// latency chain does not bound a GEMV).
template <int TB, int NA>
inline void row_tokens(const float* x, int64_t ldx, int64_t K, const uint8_t* prow, const uint8_t* srow,
                       float* out, int64_t ldo) {
  const __m128i lut = lut_x2();
  __m256 acc[TB][NA];
  for (int t = 0; t < TB; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  const int64_t nblocks = K / BLOCK;
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256 w[4];
    decode_block(prow + b * (BLOCK / 2), kTables.scale[srow[b]], lut, w[0], w[1], w[2], w[3]);
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
    out[t * ldo] = hsum(s);
  }
}

inline void one_row(const float* x, int64_t T, int64_t K, const uint8_t* prow, const uint8_t* srow,
                    float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 6 <= T; t += 6) row_tokens<6, 2>(x + t * K, K, K, prow, srow, out + t * ldo, ldo);
  const int64_t left = T - t;
  const float* xt = x + t * K;
  float* ot = out + t * ldo;
  switch (left) {
    case 5: row_tokens<5, 2>(xt, K, K, prow, srow, ot, ldo); break;
    case 4: row_tokens<4, 2>(xt, K, K, prow, srow, ot, ldo); break;
    case 3: row_tokens<3, 4>(xt, K, K, prow, srow, ot, ldo); break;
    case 2: row_tokens<2, 4>(xt, K, K, prow, srow, ot, ldo); break;
    case 1: row_tokens<1, 4>(xt, K, K, prow, srow, ot, ldo); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// x [T, K] fp32 (nibble order), packed [N, K/2] uint8, scale [N, K/32] uint8, out [T, N] fp32
// (row stride ldo). K must be a multiple of 32; all tensors contiguous.
void mxfp4_linear(const float* x, int64_t T, int64_t K, const uint8_t* packed, const uint8_t* scale,
                  int64_t N, float* out, int64_t ldo, int nthreads) {
  const int64_t row_bytes = K / 2, row_scales = K / BLOCK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n)
    one_row(x, T, K, packed + n * row_bytes, scale + n * row_scales, out + n, ldo);
}

int mxfp4_abi_version() { return 1; }
}
