#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Lanes of one score / accumulator panel row: one AVX-512 register of fp32, two AVX2 ones.
constexpr int64_t kLanes = 16;
// Panel rows kept in registers at once (keys of a score panel, head-dim entries of an output panel).
#ifdef __AVX512F__
constexpr int kPanelRows = 8;
#else
constexpr int kPanelRows = 4;
#endif
// Query rows (queries x query heads of a group) a prefill tile aims for, and its range in queries.
constexpr int64_t kTileRows = 64, kMinTileQueries = 8, kMaxTileQueries = 32;
// The score of a masked (query, key) pair: finite, so a row with nothing visible yet never computes
// -inf - -inf; its probability is set to 0 explicitly.
constexpr float kMasked = -1e30f;

// exp(x) within 2 ulps (Cody-Waite reduction, degree-6 polynomial), plain arithmetic so that loops
// calling it may vectorise (std::exp does not without -ffast-math; GCC 12 keeps it scalar all the same, hence
// exp_approx8 for AVX2). Inputs are clamped to [-87.3, 88.3]:
// below, it returns ~1e-38 instead of 0, which only ever multiplies zeros or negligible terms here.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // Round x / ln 2 to the nearest integer by adding and removing 1.5 * 2^23 (std::floor would not vectorise).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 panel (kLanes = two registers), up to 4 rows: the accumulators are named variables. Written as the
// array below, GCC 12 (-fopenmp -fPIC) kept them on the stack, loading and storing each one on every step of
// the depth loop: prefill attention ran at ~50 GFLOP/s on two cores.
template <int I, bool kKeep>
inline void panel_avx2(const float* a, int64_t a_i, int64_t a_j, const float* b, int64_t ldb, int64_t depth,
                       float* c, int64_t ldc, const float* keep) {
  static_assert(I >= 1 && I <= 4 && kLanes == 16, "two registers a row, at most four rows");
  __m256 c0l = _mm256_setzero_ps(), c0h = c0l, c1l = c0l, c1h = c0l, c2l = c0l, c2h = c0l, c3l = c0l, c3h = c0l;
  if constexpr (kKeep) {
    const __m256 kl = _mm256_loadu_ps(keep), kh = _mm256_loadu_ps(keep + 8);
#define MINIPD_KEEP(i, lo, hi)                                       \
    if constexpr (I > i) {                                           \
      lo = _mm256_mul_ps(_mm256_loadu_ps(c + i * ldc), kl);          \
      hi = _mm256_mul_ps(_mm256_loadu_ps(c + i * ldc + 8), kh);      \
    }
    MINIPD_KEEP(0, c0l, c0h) MINIPD_KEEP(1, c1l, c1h) MINIPD_KEEP(2, c2l, c2h) MINIPD_KEEP(3, c3l, c3h)
#undef MINIPD_KEEP
  }
  for (int64_t j = 0; j < depth; ++j) {
    const __m256 bl = _mm256_loadu_ps(b + j * ldb), bh = _mm256_loadu_ps(b + j * ldb + 8);
#define MINIPD_ROW(i, lo, hi)                                        \
    if constexpr (I > i) {                                           \
      const __m256 x = _mm256_broadcast_ss(a + i * a_i + j * a_j);   \
      lo = _mm256_fmadd_ps(x, bl, lo);                               \
      hi = _mm256_fmadd_ps(x, bh, hi);                               \
    }
    MINIPD_ROW(0, c0l, c0h) MINIPD_ROW(1, c1l, c1h) MINIPD_ROW(2, c2l, c2h) MINIPD_ROW(3, c3l, c3h)
#undef MINIPD_ROW
  }
  _mm256_storeu_ps(c, c0l);
  _mm256_storeu_ps(c + 8, c0h);
  if constexpr (I > 1) { _mm256_storeu_ps(c + ldc, c1l); _mm256_storeu_ps(c + ldc + 8, c1h); }
  if constexpr (I > 2) { _mm256_storeu_ps(c + 2 * ldc, c2l); _mm256_storeu_ps(c + 2 * ldc + 8, c2h); }
  if constexpr (I > 3) { _mm256_storeu_ps(c + 3 * ldc, c3l); _mm256_storeu_ps(c + 3 * ldc + 8, c3h); }
}
#endif

// c[i][:] = (kKeep ? c[i][:] * keep[:] : 0) + sum_j a(i, j) * b[j][:] for I rows of kLanes lanes, where
// a(i, j) = a[i * a_i + j * a_j]. The one inner loop of both products of a prefill tile; the I x kLanes
// accumulators stay in registers over the whole depth.
template <int I, bool kKeep>
inline void panel(const float* a, int64_t a_i, int64_t a_j, const float* b, int64_t ldb, int64_t depth,
                  float* c, int64_t ldc, const float* keep) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (I <= 4) return panel_avx2<I, kKeep>(a, a_i, a_j, b, ldb, depth, c, ldc, keep);
#endif
  float acc[I][kLanes];
  for (int i = 0; i < I; ++i) {
#pragma omp simd
    for (int64_t r = 0; r < kLanes; ++r) acc[i][r] = kKeep ? c[i * ldc + r] * keep[r] : 0.f;
  }
  for (int64_t j = 0; j < depth; ++j) {
    const float* bj = b + j * ldb;
    for (int i = 0; i < I; ++i) {
      const float aij = a[i * a_i + j * a_j];
#pragma omp simd
      for (int64_t r = 0; r < kLanes; ++r) acc[i][r] += aij * bj[r];
    }
  }
  for (int i = 0; i < I; ++i) {
#pragma omp simd
    for (int64_t r = 0; r < kLanes; ++r) c[i * ldc + r] = acc[i][r];
  }
}

// The whole (rows x width) product c = [c * keep +] a b, width a multiple of kLanes, in panels.
template <bool kKeep>
inline void product(const float* a, int64_t a_i, int64_t a_j, const float* b, int64_t ldb, int64_t depth,
                    float* c, int64_t ldc, int64_t rows, int64_t width, const float* keep) {
  for (int64_t r0 = 0; r0 < width; r0 += kLanes) {
    const float* keep_r = kKeep ? keep + r0 : nullptr;
    int64_t i = 0;
    for (; i + kPanelRows <= rows; i += kPanelRows)
      panel<kPanelRows, kKeep>(a + i * a_i, a_i, a_j, b + r0, ldb, depth, c + i * ldc + r0, ldc, keep_r);
    for (; i + 4 <= rows; i += 4)  // a GQA group of 4 query heads, in decode
      panel<4, kKeep>(a + i * a_i, a_i, a_j, b + r0, ldb, depth, c + i * ldc + r0, ldc, keep_r);
    for (; i < rows; ++i) panel<1, kKeep>(a + i * a_i, a_i, a_j, b + r0, ldb, depth, c + i * ldc + r0, ldc, keep_r);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Rows r[0..7] of an 8 x 8 fp32 tile become its columns (r[j] = entry j of every row), in registers.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {  // 32-bit interleave of row pairs
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // 64-bit interleave
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit halves across the two groups of four rows
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int j = 0; j < 8; ++j) r[j] = t[j];
}
#endif

// keys_t[d * kLanes + t] = entry d of key t, for kLanes keys `row` floats apart (keys at or past n repeat
// key n - 1, a valid row) and d < depth. Half of the decode kernel's time went into this as a scalar
// loop; with AVX-512 each 16 x 16 slab is transposed in registers (four rounds of shuffles), with AVX2
// each 8 x 8 one (three rounds; on a 2-core AVX2 EPYC the scalar loop made decode attention ~2x slower).
inline void transpose_keys(const float* keys, int64_t row, int64_t n, int64_t depth, float* keys_t) {
#ifdef __AVX512F__
  if (depth % 16 == 0 && kLanes == 16) {
    for (int64_t d0 = 0; d0 < depth; d0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(keys + std::min<int64_t>(i, n - 1) * row + d0);
      for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {  // 64-bit interleave
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
      }
      for (int h = 0; h < 16; h += 8) {  // 128-bit lanes, within each half
        for (int j = 0; j < 4; ++j) {
          t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + 4 + j], 0x88);
          t[h + 4 + j] = _mm512_shuffle_f32x4(r[h + j], r[h + 4 + j], 0xdd);
        }
      }
      for (int j = 0; j < 8; ++j) {  // 128-bit lanes, across the halves: register j now holds entry d0 + j
        _mm512_storeu_ps(keys_t + (d0 + j) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
        _mm512_storeu_ps(keys_t + (d0 + 8 + j) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
      }
    }
    return;
  }
#elif defined(__AVX2__)
  if (depth % 8 == 0 && kLanes == 16) {
    for (int64_t d0 = 0; d0 < depth; d0 += 8) {
      for (int64_t half = 0; half < kLanes; half += 8) {  // keys half .. half + 7
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(keys + std::min<int64_t>(half + i, n - 1) * row + d0);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(keys_t + (d0 + j) * kLanes + half, r[j]);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < kLanes; ++t) {
    const float* k = keys + std::min(t, n - 1) * row;
    for (int64_t d = 0; d < depth; ++d) keys_t[d * kLanes + t] = k[d];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define MINIPD_AVX2_PATHS 1
// Keys per online-softmax step of the vectorised decode path (a multiple of 8): the max, the correction of
// the accumulators and its std::exp are paid once per this many keys.
constexpr int64_t kDecodeChunk = 64;

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one register (two rounds of hadd, one 128-bit swap).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes 0-3 and 4-7 summed apart
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp_approx on eight lanes with intrinsics: the same steps, as the compiler does not vectorise the scalar
// version's loop here (its integer bit trick stays scalar, and was over half of the decode kernel's time).
inline __m256 exp_approx8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 shift = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift), shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

using minipd_panels::widen8;  // (cpu_panel_linear.cpp: bf16/fp16 rows widened to fp32, eight at a time)

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// acc[g][d] += sum_t p[g][t] v_t[d] for G query heads (p rows kDecodeChunk apart, acc rows dim apart) and n
// keys: each V row is loaded once for the G heads, the accumulators of 16 entries of the head dimension stay
// in registers over all n keys.
template <int G>
inline void decode_pv(const float* p, float* acc, int64_t dim, const float* const* v, int64_t n) {
  int64_t d = 0;
#ifdef __AVX512F__
  // A slice of 16 entries is one register: half the loads and FMAs of two AVX2 halves.
  for (; d + 16 <= dim; d += 16) {
    __m512 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm512_loadu_ps(acc + g * dim + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 v0 = _mm512_loadu_ps(v[t] + d);
      for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * kDecodeChunk + t]), v0, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * dim + d, a[g]);
  }
#endif
  for (; d + 16 <= dim; d += 16) {
    __m256 a0[G], a1[G];
    for (int g = 0; g < G; ++g) {
      a0[g] = _mm256_loadu_ps(acc + g * dim + d);
      a1[g] = _mm256_loadu_ps(acc + g * dim + d + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v[t] + d), v1 = _mm256_loadu_ps(v[t] + d + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * kDecodeChunk + t);
        a0[g] = _mm256_fmadd_ps(pg, v0, a0[g]);
        a1[g] = _mm256_fmadd_ps(pg, v1, a1[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(acc + g * dim + d, a0[g]);
      _mm256_storeu_ps(acc + g * dim + d + 8, a1[g]);
    }
  }
  for (; d < dim; d += 8) {  // a head dimension that is an odd multiple of 8
    __m256 a0[G];
    for (int g = 0; g < G; ++g) a0[g] = _mm256_loadu_ps(acc + g * dim + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v[t] + d);
      for (int g = 0; g < G; ++g) a0[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * kDecodeChunk + t), v0, a0[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * dim + d, a0[g]);
  }
}

// One online-softmax step of a decode work item: n <= kDecodeChunk keys and values given by row pointers,
// the group's queries qs (already scaled; group x dim), its accumulators acc (group x dim), maxima m and sums l.
// `scores` holds group x kDecodeChunk floats; k must have round_up(n, 8) entries (the padding repeats a row).
// Scores come from dot products, eight keys' sums reduced together (no transposed copy of the keys, which
// cost as much as the products), the probabilities from the vectorised exp_approx, and the values are
// accumulated by decode_pv.
inline void decode_chunk(const float* qs, int64_t group, int64_t dim, const float* const* k, const float* const* v,
                         int64_t n, float* scores, float* acc, float* m, float* l) {
  const int64_t padded = (n + 7) & ~int64_t{7};
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qs + g * dim;
    float* sg = scores + g * kDecodeChunk;
    for (int64_t t0 = 0; t0 < padded; t0 += 8) {
      __m256 a[8];
#ifdef __AVX512F__
      if (dim % 16 == 0) {  // 16 entries a product (half the FMAs), each sum folded to eight lanes for hsum8
        __m512 w[8];
        for (int i = 0; i < 8; ++i) w[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qg + d);
          for (int i = 0; i < 8; ++i) w[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[t0 + i] + d), w[i]);
        }
        for (int i = 0; i < 8; ++i)
          a[i] = _mm256_add_ps(_mm512_castps512_ps256(w[i]),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[i]), 1)));
        _mm256_storeu_ps(sg + t0, hsum8(a));
        continue;
      }
#endif
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[t0 + i] + d), a[i]);
      }
      _mm256_storeu_ps(sg + t0, hsum8(a));
    }
    for (int64_t t = n; t < padded; ++t) sg[t] = kMasked;
    __m256 mx = _mm256_loadu_ps(sg);
    for (int64_t t0 = 8; t0 < padded; t0 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t0));
    const float m_new = std::max(m[g], hmax8(mx));
    // Rescale what was accumulated to the new running maximum, once per chunk.
    const float correction = std::exp(m[g] - m_new);
    float* ag = acc + g * dim;
    l[g] *= correction;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) ag[d] *= correction;
    // Probabilities of the padding lanes are set to 0 (their scores only took part in the maximum).
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < padded; t0 += 8) {
      const __m256 live = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n - t0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 p = _mm256_and_ps(exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(sg + t0), mv)), live);
      _mm256_storeu_ps(sg + t0, p);
      sum = _mm256_add_ps(sum, p);
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    l[g] += _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    m[g] = m_new;
  }
#ifdef __AVX512F__
  constexpr int64_t kHeadsAtOnce = 8;  // a slice's accumulators, one register each
#else
  constexpr int64_t kHeadsAtOnce = 4;  // two registers each
#endif
  for (int64_t g = 0; g < group; g += kHeadsAtOnce) {
    switch (std::min<int64_t>(kHeadsAtOnce, group - g)) {
      case 1: decode_pv<1>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      case 2: decode_pv<2>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      case 3: decode_pv<3>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
#ifdef __AVX512F__
      case 4: decode_pv<4>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      case 5: decode_pv<5>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      case 6: decode_pv<6>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      case 7: decode_pv<7>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n); break;
      default: decode_pv<8>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n);
#else
      default: decode_pv<4>(scores + g * kDecodeChunk, acc + g * dim, dim, v, n);
#endif
    }
  }
}
#endif

// With narrow_pools, the caches may also be bf16 or fp16 (both alike) and q fp32 or the caches' dtype.
void check_pool(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& context_lens, bool narrow_pools = false) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be (tokens, heads, head_dim) and the caches (blocks, block_size, kv_heads, head_dim)");
  const auto pool = k_cache.scalar_type();
  if (narrow_pools && pool != torch::kFloat) {
    TORCH_CHECK((pool == torch::kBFloat16 || pool == torch::kHalf) && v_cache.scalar_type() == pool &&
                    (q.scalar_type() == torch::kFloat || q.scalar_type() == pool),
                "the caches must both be fp32, bf16 or fp16, and q fp32 or the caches' dtype");
    for (const torch::Tensor* t : {&q, &k_cache, &v_cache})
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "q and the caches must be contiguous CPU tensors");
  } else {
    for (const torch::Tensor* t : {&q, &k_cache, &v_cache})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->device().is_cpu() && t->is_contiguous(),
                  narrow_pools ? "q and the caches must be contiguous fp32 CPU tensors (or bf16/fp16 caches)"
                               : "q and the caches must be contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(q.size(2) == k_cache.size(3) && k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and the query heads must be a multiple of the KV heads");
  for (const torch::Tensor* t : {&block_tables, &context_lens})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->device().is_cpu() && t->is_contiguous(),
                "block tables and lengths must be contiguous int64 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == context_lens.size(0),
              "block_tables must be (sequences, width) and context_lens (sequences,)");
}

// Sequence `seq` keeps its first `length` positions in valid blocks of its table row (read unchecked later).
void check_blocks(const int64_t* tables, int64_t width, int64_t seq, int64_t length, int64_t block_size,
                  int64_t num_blocks) {
  TORCH_CHECK(length >= 0 && length <= width * block_size && length < std::numeric_limits<int32_t>::max(),
              "sequence ", seq, ": context length ", length, " does not fit its block table");
  for (int64_t j = 0; j < (length + block_size - 1) / block_size; ++j) {
    const int64_t block = tables[seq * width + j];
    TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", seq, ": block id ", block, " out of range");
  }
}

// One work item of a prefill: a tile of one sequence's queries against one KV head.
struct PrefillTile {
  int64_t seq, first_query, num_queries, kv_head, cost;
};

}  // namespace

// q (B, H, D), caches (N, block_size, KVH, D), tables (B, max_blocks) int64, lens (B) int64; fp32.
// k_new, v_new: empty, or (B, KVH, D): position lens[b] - 1 is read from them, not from the pool.
// A pool's element type, passed as a value to the generic lambdas below (C++17 has no std::type_identity).
template <typename T>
struct ElementType {
  using type = T;
};

// The caches may also be bf16 or fp16 (a model loaded in that dtype): each chunk's rows are widened to fp32 once
// fetched, and everything else is fp32; q, k_new and v_new may then be in the caches' dtype, and the result is.
torch::Tensor paged_decode(torch::Tensor q_in, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           int64_t window, torch::Tensor k_new_in, torch::Tensor v_new_in) {
  MINIPD_RELEASE_GIL_IF_HELD  // (defined in cpu_panel_linear.cpp, compiled before this file)
  check_pool(q_in, k_cache, v_cache, block_tables, context_lens, /*narrow_pools=*/true);
  const auto pool_type = k_cache.scalar_type();
  const torch::Tensor q = q_in.to(torch::kFloat).contiguous();
  const bool narrow_new = k_new_in.numel() > 0 && k_new_in.scalar_type() == pool_type && pool_type != torch::kFloat;
  const torch::Tensor k_new = narrow_new ? k_new_in.to(torch::kFloat).contiguous() : k_new_in;
  const torch::Tensor v_new = narrow_new && v_new_in.scalar_type() == pool_type ? v_new_in.to(torch::kFloat).contiguous()
                                                                                : v_new_in;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t group = H / KVH, table_width = block_tables.size(1);
  TORCH_CHECK(context_lens.size(0) == B, "one length per query");
  const bool has_new = k_new.numel() > 0;
  if (has_new) {
    for (const torch::Tensor* t : {&k_new, &v_new})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->device().is_cpu() && t->is_contiguous() &&
                      t->dim() == 3 && t->size(0) == B && t->size(1) == KVH && t->size(2) == D,
                  "k_new and v_new must be contiguous fp32 (batch, kv_heads, head_dim) CPU tensors");
  }
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(!has_new || lp[b] >= 1, "sequence ", b, ": with k_new a context holds at least the new token");
    check_blocks(tp, table_width, b, has_new ? lp[b] - 1 : lp[b], bs, num_blocks);
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* knp = has_new ? k_new.data_ptr<float>() : nullptr;
  const float* vnp = has_new ? v_new.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * D, block_stride = bs * row;
  const float fscale = static_cast<float>(scale);
  // The head size as a constant for the common sizes: fixed trip counts let the compiler unroll and keep
  // the per-key loops in registers.
  auto run = [&](auto head_dim, auto element) {
    constexpr int64_t kD = decltype(head_dim)::value;
    using T = typename decltype(element)::type;  // the pool's element type
    constexpr bool kNarrow = !std::is_same_v<T, float>;
    const int64_t Dn = kD > 0 ? kD : D;
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(group * Dn), scores(group * kLanes), keys_t(Dn * kLanes), m(group), l(group);
      // Narrow pools: the rows in use, widened to fp32 (a block's on the generic path, a chunk's of at most 64 on the
      // AVX2 one).
      std::vector<float> wide_k(kNarrow ? std::max(bs, int64_t{64}) * Dn : 0), wide_v(wide_k.size());
#ifdef MINIPD_AVX2_PATHS
      std::vector<float> qs(group * Dn), chunk_scores(group * kDecodeChunk);
      std::vector<const T*> key_rows(2 * kDecodeChunk), value_rows(2 * kDecodeChunk);  // this chunk, the next
      std::vector<const float*> wide_k_rows(kNarrow ? kDecodeChunk : 0), wide_v_rows(wide_k_rows.size());
#endif
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / KVH, kvh = idx % KVH, len = lp[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        // With the new token supplied, the pool holds the positions before it only.
        const int64_t pool_end = has_new ? len - 1 : len;
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.end(), 0.f);
        const float* qb = qp + (b * H + kvh * group) * Dn;
#ifdef MINIPD_AVX2_PATHS
        if (Dn % 8 == 0) {
          for (int64_t i = 0; i < group * Dn; ++i) qs[i] = qb[i] * fscale;
          // Row pointers of each chunk's keys and values (a chunk may span blocks), found by walking the table;
          // the next chunk's rows are found and prefetched before this one is computed: its blocks lie anywhere
          // in the pool, where the hardware prefetcher cannot guess them, and a step's K/V rarely fit the caches.
          int64_t block_index = first / bs, within = first % bs;
          auto gather = [&](int64_t c0, const T** k_rows, const T** v_rows) {
            const int64_t n = std::min(kDecodeChunk, pool_end - c0);
            for (int64_t t = 0; t < n; ++t) {
              const int64_t offset = tp[b * table_width + block_index] * block_stride + within * row + kvh * Dn;
              k_rows[t] = kp + offset;
              v_rows[t] = vp + offset;
              // The whole row, every KV head's part: the item of the next head reads it from the cache. Into L2,
              // not L1: a chunk's K and V (32 KB for tiny-py) fill an L1 cache, and prefetched there they pushed
              // out the chunk being computed (its V loads stalled). 64 rows x 500 tokens x 6 layers of tiny-py on
              // the 2-core EPYC: 8.6 -> 4.7 ms with the blocks scattered over the pool, 7.0 -> 5.1 ms in order.
              const char* k_line = reinterpret_cast<const char*>(k_rows[t] - kvh * Dn);
              const char* v_line = reinterpret_cast<const char*>(v_rows[t] - kvh * Dn);
              for (int64_t byte = 0; byte < row * static_cast<int64_t>(sizeof(T)); byte += 64) {
                _mm_prefetch(k_line + byte, _MM_HINT_T1);
                _mm_prefetch(v_line + byte, _MM_HINT_T1);
              }
              if (++within == bs) within = 0, ++block_index;
            }
            for (int64_t t = n; t < kDecodeChunk; ++t) k_rows[t] = k_rows[n - 1];
            return n;
          };
          const T** k_now = key_rows.data();
          const T** v_now = value_rows.data();
          const T** k_next = k_now + kDecodeChunk;
          const T** v_next = v_now + kDecodeChunk;
          int64_t n = first < pool_end ? gather(first, k_now, v_now) : 0;
          for (int64_t c0 = first; c0 < pool_end; c0 += kDecodeChunk) {
            const int64_t n_next = c0 + kDecodeChunk < pool_end ? gather(c0 + kDecodeChunk, k_next, v_next) : 0;
            if constexpr (kNarrow) {
              // This chunk's rows (fetched into L2 while the chunk before was computed) widened to fp32.
              for (int64_t t = 0; t < n; ++t) {
                float* wk = wide_k.data() + t * Dn;
                float* wv = wide_v.data() + t * Dn;
                for (int64_t d = 0; d < Dn; d += 8) {
                  _mm256_storeu_ps(wk + d, widen8(k_now[t] + d));
                  _mm256_storeu_ps(wv + d, widen8(v_now[t] + d));
                }
                wide_k_rows[t] = wk;
                wide_v_rows[t] = wv;
              }
              for (int64_t t = n; t < kDecodeChunk; ++t) wide_k_rows[t] = wide_k_rows[n - 1];
              decode_chunk(qs.data(), group, Dn, wide_k_rows.data(), wide_v_rows.data(), n, chunk_scores.data(),
                           acc.data(), m.data(), l.data());
            } else {
              decode_chunk(qs.data(), group, Dn, k_now, v_now, n, chunk_scores.data(), acc.data(), m.data(),
                           l.data());
            }
            std::swap(k_now, k_next);
            std::swap(v_now, v_next);
            n = n_next;
          }
        } else
#endif
        // first < pool_end: an empty range would give a block of no scores, whose correction is exp(-inf + inf).
        for (int64_t start = first - first % bs; first < pool_end && start < pool_end; start += bs) {
          const int64_t block = tp[b * table_width + start / bs];
          const int64_t lo = std::max(start, first), hi = std::min(start + bs, pool_end);
          const float* kb;
          const float* vb;
          int64_t stride = row;  // between the keys (and values) of the block as read here
          if constexpr (kNarrow) {  // the block's rows in use, widened to fp32, one after the other
            for (int64_t t = lo - start; t < hi - start; ++t)
              for (int64_t d = 0; d < Dn; ++d) {
                wide_k[t * Dn + d] = static_cast<float>(kp[block * block_stride + t * row + kvh * Dn + d]);
                wide_v[t * Dn + d] = static_cast<float>(vp[block * block_stride + t * row + kvh * Dn + d]);
              }
            kb = wide_k.data();
            vb = wide_v.data();
            stride = Dn;
          } else {
            kb = kp + block * block_stride + kvh * Dn;
            vb = vp + block * block_stride + kvh * Dn;
          }
          // Up to kLanes keys at a time (a block may hold more).
          for (int64_t c0 = lo; c0 < hi; c0 += kLanes) {
            // Scores of the whole group against the chunk as one small product: its keys are first
            // laid out transposed (head_dim x kLanes), so each query head's scores fill one register-wide row.
            const int64_t n = std::min(hi - c0, kLanes);
            transpose_keys(kb + (c0 - start) * stride, stride, n, Dn, keys_t.data());
            product<false>(qb, Dn, 1, keys_t.data(), kLanes, Dn, scores.data(), kLanes, group, kLanes, nullptr);
            for (int64_t g = 0; g < group; ++g) {
              float* sg = scores.data() + g * kLanes;
              float block_max = -std::numeric_limits<float>::infinity();
              for (int64_t t = 0; t < n; ++t) {
                sg[t] *= fscale;
                block_max = std::max(block_max, sg[t]);
              }
              // Rescale what was accumulated to the new running maximum, once per chunk of keys.
              const float m_new = std::max(m[g], block_max);
              const float correction = std::exp(m[g] - m_new);
              float* a = acc.data() + g * Dn;
              l[g] *= correction;
#pragma omp simd
              for (int64_t d = 0; d < Dn; ++d) a[d] *= correction;
              // The chunk's probabilities in one vectorised pass (a scalar std::exp per key was most of the time).
              float block_sum = 0.f;
#pragma omp simd reduction(+:block_sum)
              for (int64_t t = 0; t < n; ++t) {
                sg[t] = exp_approx(sg[t] - m_new);
                block_sum += sg[t];
              }
              l[g] += block_sum;
              for (int64_t t = 0; t < n; ++t) {
                const float pt = sg[t];
                const float* v = vb + (c0 - start + t) * stride;
#pragma omp simd
                for (int64_t d = 0; d < Dn; ++d) a[d] += pt * v[d];
              }
              m[g] = m_new;
            }
          }
        }
        if (has_new) {
          // The new token, last position of the context: one more single-row step of the online softmax.
          const float* kn = knp + (b * KVH + kvh) * Dn;
          const float* vn = vnp + (b * KVH + kvh) * Dn;
          for (int64_t g = 0; g < group; ++g) {
            const float* qh = qb + g * Dn;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < Dn; ++d) dot += qh[d] * kn[d];
            dot *= fscale;
            const float m_new = std::max(m[g], dot);
            const float correction = std::exp(m[g] - m_new), p = std::exp(dot - m_new);
            l[g] = l[g] * correction + p;
            float* a = acc.data() + g * Dn;
#pragma omp simd
            for (int64_t d = 0; d < Dn; ++d) a[d] = a[d] * correction + p * vn[d];
            m[g] = m_new;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* o = op + (b * H + kvh * group + g) * Dn;
          const float inv = 1.f / l[g];
          for (int64_t d = 0; d < Dn; ++d) o[d] = acc[g * Dn + d] * inv;
        }
      }
    });
  };
  auto run_for = [&](auto element) {
    switch (D) {
      case 32: run(std::integral_constant<int64_t, 32>{}, element); break;
      case 64: run(std::integral_constant<int64_t, 64>{}, element); break;
      case 128: run(std::integral_constant<int64_t, 128>{}, element); break;
      default: run(std::integral_constant<int64_t, 0>{}, element);
    }
  };
  if (pool_type == torch::kBFloat16)
    run_for(ElementType<at::BFloat16>{});
  else if (pool_type == torch::kHalf)
    run_for(ElementType<at::Half>{});
  else
    run_for(ElementType<float>{});
  return q_in.scalar_type() == torch::kFloat ? out : out.to(q_in.scalar_type());
}

// q (N, H, D): sequence i's queries are rows query_start_loc[i] .. query_start_loc[i + 1], the last of its
// context_lens[i] positions (their K/V already in the pool). Causal; window > 0 keeps the `window` most
// recent keys of each query. Caches, tables and lengths as for paged_decode.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor query_start_loc,
                            torch::Tensor context_lens, double scale, int64_t window) {
  MINIPD_RELEASE_GIL_IF_HELD
  check_pool(q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kLong && query_start_loc.device().is_cpu() &&
                  query_start_loc.is_contiguous() && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == context_lens.size(0) + 1,
              "query_start_loc must be a contiguous int64 CPU tensor of sequences + 1 offsets");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t B = context_lens.size(0), group = H / KVH, table_width = block_tables.size(1);
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  if (window <= 0) window = 0;

  // Tiles of queries: each K/V row loaded serves tile_queries x group query rows, padded to whole panels.
  const int64_t tile_queries = std::clamp(kTileRows / group, kMinTileQueries, kMaxTileQueries);
  const int64_t width = (tile_queries * group + kLanes - 1) / kLanes * kLanes;
  std::vector<PrefillTile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_begin = qsl[b], q_end = qsl[b + 1], len = lp[b];
    TORCH_CHECK(0 <= q_begin && q_begin <= q_end && q_end <= N && q_end - q_begin <= len,
                "sequence ", b, ": its queries must be rows of q and the last of its context");
    check_blocks(tp, table_width, b, len, bs, num_blocks);
    for (int64_t first_query = q_begin; first_query < q_end; first_query += tile_queries) {
      const int64_t count = std::min(tile_queries, q_end - first_query);
      const int64_t last_pos = len - (q_end - first_query) + count - 1;
      const int64_t first_key = window ? std::max<int64_t>(0, last_pos - count + 1 - window + 1) : 0;
      for (int64_t kvh = 0; kvh < KVH; ++kvh)
        tiles.push_back({b, first_query, count, kvh, count * (last_pos + 1 - first_key)});
    }
  }
  // Costliest tiles first, handed out one at a time: a causal prompt's late tiles see the most keys, so
  // static halves would leave one core idle while the other does its tail.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const PrefillTile& x, const PrefillTile& y) { return x.cost > y.cost; });
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * D, block_stride = bs * row;
  const float fscale = static_cast<float>(scale);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> next_tile{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Per worker: the tile's scaled queries transposed (D x width), scores then probabilities (bs x width),
    // the output accumulator transposed (D x width), and per query row its softmax state and position range.
    std::vector<float> q_t(D * width), probs(bs * width), acc_t(D * width);
    std::vector<float> m(width), l(width), block_max(width), correction(width);
    std::vector<int32_t> pos(width), first_visible(width);
    for (int64_t idx; (idx = next_tile.fetch_add(1)) < num_tiles;) {
      const PrefillTile& tile = tiles[idx];
      const int64_t b = tile.seq, kvh = tile.kv_head, len = lp[b];
      const int64_t rows = tile.num_queries * group;
      const int64_t first_pos = len - (qsl[b + 1] - tile.first_query);
      const float* q_tile = qp + (tile.first_query * H + kvh * group) * D;
      // Row r is query r / group, head r % group; padding rows copy the last query's position, with zero q.
      for (int64_t r = 0; r < width; ++r) {
        if (r < rows) {
          const float* src = q_tile + (r / group) * H * D + (r % group) * D;
          for (int64_t d = 0; d < D; ++d) q_t[d * width + r] = src[d] * fscale;
        } else {
          for (int64_t d = 0; d < D; ++d) q_t[d * width + r] = 0.f;
        }
        pos[r] = static_cast<int32_t>(first_pos + (r < rows ? r / group : tile.num_queries - 1));
        first_visible[r] = window ? pos[r] - static_cast<int32_t>(window) + 1 : 0;
      }
      std::fill(m.begin(), m.end(), kMasked);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc_t.begin(), acc_t.end(), 0.f);
      const int64_t key_begin = std::max<int64_t>(0, first_visible[0]), key_end = pos[width - 1] + 1;
      // Only the blocks some query of the tile sees: from the first row's window start to the last row.
      for (int64_t start = key_begin - key_begin % bs; start < key_end; start += bs) {
        const int64_t block = tp[b * table_width + start / bs];
        const int64_t lo = std::max(start, key_begin), hi = std::min(start + bs, key_end), n = hi - lo;
        const float* kb = kp + block * block_stride + (lo - start) * row + kvh * D;
        const float* vb = vp + block * block_stride + (lo - start) * row + kvh * D;
        // scores[t][r] = q_r . k_t (scaled)
        product<false>(kb, row, 1, q_t.data(), width, D, probs.data(), width, n, width, nullptr);
        // Mask only blocks not wholly visible to every row (the diagonal, the window's edge).
        if (hi - 1 > pos[0] || lo < first_visible[width - 1]) {
          for (int64_t t = 0; t < n; ++t) {
            const int32_t key = static_cast<int32_t>(lo + t);
            float* s = probs.data() + t * width;
#pragma omp simd
            for (int64_t r = 0; r < width; ++r) s[r] = key <= pos[r] && key >= first_visible[r] ? s[r] : kMasked;
          }
        }
        std::fill(block_max.begin(), block_max.end(), kMasked);
        for (int64_t t = 0; t < n; ++t) {
          const float* s = probs.data() + t * width;
#pragma omp simd
          for (int64_t r = 0; r < width; ++r) block_max[r] = std::max(block_max[r], s[r]);
        }
        // Online softmax: rescale what was accumulated to the new running maximum, once per block.
#pragma omp simd
        for (int64_t r = 0; r < width; ++r) {
          const float m_new = std::max(m[r], block_max[r]);
          correction[r] = exp_approx(m[r] - m_new);
          l[r] *= correction[r];
          m[r] = m_new;
        }
        for (int64_t t = 0; t < n; ++t) {
          float* s = probs.data() + t * width;
#ifdef MINIPD_AVX2_PATHS
          // width is a multiple of kLanes: whole registers (the scalar loop below is not vectorised).
          for (int64_t r = 0; r < width; r += 8) {
            const __m256 sv = _mm256_loadu_ps(s + r);
            const __m256 seen = _mm256_cmp_ps(sv, _mm256_set1_ps(kMasked), _CMP_NEQ_OQ);
            const __m256 p = _mm256_and_ps(exp_approx8(_mm256_sub_ps(sv, _mm256_loadu_ps(m.data() + r))), seen);
            _mm256_storeu_ps(s + r, p);
            _mm256_storeu_ps(l.data() + r, _mm256_add_ps(_mm256_loadu_ps(l.data() + r), p));
          }
#else
#pragma omp simd
          for (int64_t r = 0; r < width; ++r) {
            const float p = s[r] == kMasked ? 0.f : exp_approx(s[r] - m[r]);
            s[r] = p;
            l[r] += p;
          }
#endif
        }
        // acc_t[d][r] = acc_t[d][r] * correction[r] + sum_t v_t[d] p[t][r]
        product<true>(vb, 1, row, probs.data(), width, n, acc_t.data(), width, D, width, correction.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* o = op + ((tile.first_query + r / group) * H + kvh * group + r % group) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) o[d] = acc_t[d * width + r] * inv;
      }
    }
  });
  return out;
}

// The decode kernel as a dispatcher op too (torch.ops.minipd_cpu.paged_decode): a compiled graph calls
// it directly, with no Python between the graph and the kernel.
TORCH_LIBRARY(minipd_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window, Tensor k_new, Tensor v_new) -> Tensor");
}
TORCH_LIBRARY_IMPL(minipd_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
