// Linear layers on the CPU with weights packed in panels of 16 output features (linear_backend="cpu").
//
// A panel holds 16 rows of W (16 output features) interleaved by input: panel[k][j] = W[16 p + j][k]. A
// register block multiplies up to 6 input rows by one panel (AVX2; 12 with AVX-512, where a line of a panel is one
// register, or 16 when they are the whole batch): per input k, two loads of the panel (16 floats), one broadcast
// per row, 12 fused multiply-adds into 12 accumulators. The weight is read once per block of rows, in order, so
// one decode row streams it at memory speed and a full block runs at the FMA units' rate. Threads split the
// panels; rows are taken in chunks that stay in the L2 cache. While a panel's blocks run, they prefetch the next
// panel into L2, a share each: with several blocks (a decode batch of 16 rows is three with AVX2), only the first
// would otherwise wait for memory, and the others would leave it idle.
//
// Weights may also be kept as bf16 or fp16 (a model loaded in that dtype): half the bytes to stream, which is
// what bounds a decode step. They are widened to fp32 as they are loaded and everything else is fp32 (inputs,
// products, sums), so the result is the fp32 product of the stored weights, rounded once to the model's dtype.
// For more rows than one register block, a panel is widened once into a scratch buffer and the fp32 blocks read
// that instead, so prefill does not widen the same weights again for every block.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// Called through the extension's own binding, a kernel holds the GIL: it is released while the kernel runs, so
// another Python thread (a server's event loop beside its engine) is not stopped for a long prefill. Called through
// the dispatcher from Python or C++, the GIL is not held here, and nothing is released.
#define MINIPD_RELEASE_GIL_IF_HELD                          \
  std::optional<pybind11::gil_scoped_release> minipd_no_gil; \
  if (PyGILState_Check()) minipd_no_gil.emplace();

// Named, not anonymous: this file is compiled in one unit with the attention kernels.
namespace minipd_panels {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 registers of fp32, or one AVX-512 register
#if defined(__AVX512F__)
constexpr int64_t kBlockRows = 12;  // input rows per register block: 12 accumulators of the 32 registers
// A batch of up to 16 rows is one block (16 accumulators): the panel is read once, as the memory delivers it. Split
// in two (8 + 8), the second block ran from L2 while the memory idled; 16 rows of the 50M model's linears took 1.12x
// the one block's time on a Zen 5 (13 rows 1.24x). Beyond one block, blocks of 16 were slower than of 12 (32 rows
// 1.19x: 17 loads to 16 FMAs a step).
constexpr int64_t kSingleBlockRows = 16;
#else
constexpr int64_t kBlockRows = 6;  // input rows per register block: 12 accumulators of the 16 registers
constexpr int64_t kSingleBlockRows = 6;
#endif
constexpr int64_t kChunkBytes = 256 << 10;  // input rows taken together: what half an L2 cache holds

#if defined(__AVX2__) && defined(__FMA__)
// Eight weights (or K/V entries: the attention kernels use it too) as one register of fp32: bf16 is the top half
// of an fp32, widened by a shift; fp16 by F16C.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 widen8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}

// Line k of a panel (16 weights) as two registers of fp32.
template <typename W>
inline void load_line(const W* p, __m256& lo, __m256& hi) {
  lo = widen8(p);
  hi = widen8(p + 8);
}

// One output row of a panel: bias added, only the panel's real columns written (the last panel may be short).
inline void store_row(__m256 lo, __m256 hi, float* out, int64_t cols, const float* bias) {
  if (cols == kPanel) {
    if (bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  for (int64_t j = 0; j < cols; ++j) out[j] = tmp[j] + (bias ? bias[j] : 0.f);
}

// R input rows (2-6) times one panel. The accumulators are named variables, not an array: GCC 12 with
// -fopenmp and -fPIC kept an array of them on the stack and stored it on every iteration (a third of the speed).
// Prefetching: ``ahead`` points at lines of the next panel (one line, 16 floats, per input k), the first
// ``ahead_lines`` of which this block fetches into L2, one per input.
template <int R, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, int64_t K, float* out, int64_t ldo,
                  int64_t cols, const float* bias, const W* ahead, int64_t ahead_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0, e0 = a0,
         e1 = a0, f0 = a0, f1 = a0;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    load_line(panel + k * kPanel, w0, w1);
    if (k < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
#define MINIPD_ROW(i, lo, hi)                                 \
    if constexpr (R > i) {                                    \
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k); \
      lo = _mm256_fmadd_ps(xb, w0, lo);                       \
      hi = _mm256_fmadd_ps(xb, w1, hi);                       \
    }
    MINIPD_ROW(0, a0, a1) MINIPD_ROW(1, b0, b1) MINIPD_ROW(2, c0, c1)
    MINIPD_ROW(3, d0, d1) MINIPD_ROW(4, e0, e1) MINIPD_ROW(5, f0, f1)
#undef MINIPD_ROW
  }
  store_row(a0, a1, out, cols, bias);
  if constexpr (R > 1) store_row(b0, b1, out + ldo, cols, bias);
  if constexpr (R > 2) store_row(c0, c1, out + 2 * ldo, cols, bias);
  if constexpr (R > 3) store_row(d0, d1, out + 3 * ldo, cols, bias);
  if constexpr (R > 4) store_row(e0, e1, out + 4 * ldo, cols, bias);
  if constexpr (R > 5) store_row(f0, f1, out + 5 * ldo, cols, bias);
}

// One input row: two chains of accumulators (even and odd inputs), so the FMA latency does not bound it. (The
// last row of a batch like 7 = 6 + 1 prefetches its share of the next panel too.)
template <typename W>
inline void row(const float* x, const W* panel, int64_t K, float* out, int64_t cols, const float* bias,
                const W* ahead, int64_t ahead_lines) {
  for (int64_t k = 0; k < ahead_lines; ++k)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, w0, w1, v0, v1;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    load_line(panel + k * kPanel, w0, w1);
    load_line(panel + (k + 1) * kPanel, v0, v1);
    a0 = _mm256_fmadd_ps(xa, w0, a0);
    a1 = _mm256_fmadd_ps(xa, w1, a1);
    b0 = _mm256_fmadd_ps(xb, v0, b0);
    b1 = _mm256_fmadd_ps(xb, v1, b1);
  }
  if (k < K) {
    const __m256 xa = _mm256_broadcast_ss(x + k);
    load_line(panel + k * kPanel, w0, w1);
    a0 = _mm256_fmadd_ps(xa, w0, a0);
    a1 = _mm256_fmadd_ps(xa, w1, a1);
  }
  store_row(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), out, cols, bias);
}
#endif

#if defined(__AVX512F__)
// AVX-512: a line of a panel is one register, so a row costs one broadcast and one fused multiply-add per input,
// half the instructions of two AVX2 halves. Blocks go up to 12 rows (16 for a batch of one block): enough
// independent sums to keep two 512-bit FMA units busy (Zen 5: 64 flops a cycle a core, twice what the AVX2 blocks
// reached there). Each row's sum runs over k in the same order as in the AVX2 blocks, so results do not depend on
// the build.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 widen16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_row16(__m512 v, float* out, int64_t cols, const float* bias) {
  const __mmask16 mask = cols >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(out, mask, v);
}

// R input rows (2-16) times one panel; named accumulators, as in block() above.
template <int R, typename W>
inline void block16(const float* x, int64_t ldx, const W* panel, int64_t K, float* out, int64_t ldo,
                    int64_t cols, const float* bias, const W* ahead, int64_t ahead_lines) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = widen16(panel + k * kPanel);
    if (k < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
#define MINIPD_ROW16(i) \
    if constexpr (R > i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w, a##i);
    MINIPD_ROW16(0) MINIPD_ROW16(1) MINIPD_ROW16(2) MINIPD_ROW16(3) MINIPD_ROW16(4) MINIPD_ROW16(5)
    MINIPD_ROW16(6) MINIPD_ROW16(7) MINIPD_ROW16(8) MINIPD_ROW16(9) MINIPD_ROW16(10) MINIPD_ROW16(11)
    MINIPD_ROW16(12) MINIPD_ROW16(13) MINIPD_ROW16(14) MINIPD_ROW16(15)
#undef MINIPD_ROW16
  }
#define MINIPD_STORE16(i) \
  if constexpr (R > i) store_row16(a##i, out + i * ldo, cols, bias);
  MINIPD_STORE16(0) MINIPD_STORE16(1) MINIPD_STORE16(2) MINIPD_STORE16(3) MINIPD_STORE16(4) MINIPD_STORE16(5)
  MINIPD_STORE16(6) MINIPD_STORE16(7) MINIPD_STORE16(8) MINIPD_STORE16(9) MINIPD_STORE16(10) MINIPD_STORE16(11)
  MINIPD_STORE16(12) MINIPD_STORE16(13) MINIPD_STORE16(14) MINIPD_STORE16(15)
#undef MINIPD_STORE16
}

// One input row: two chains (even and odd inputs), as in row() above.
template <typename W>
inline void row16(const float* x, const W* panel, int64_t K, float* out, int64_t cols, const float* bias,
                  const W* ahead, int64_t ahead_lines) {
  for (int64_t k = 0; k < ahead_lines; ++k)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
  __m512 a = _mm512_setzero_ps(), b = a;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    a = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), widen16(panel + k * kPanel), a);
    b = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), widen16(panel + (k + 1) * kPanel), b);
  }
  if (k < K) a = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), widen16(panel + k * kPanel), a);
  store_row16(_mm512_add_ps(a, b), out, cols, bias);
}
#endif

// Rows [0, rows) (at most kSingleBlockRows) of x times one panel, into out (row stride ldo).
template <typename W>
void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const W* panel, int64_t K, float* out,
                      int64_t ldo, int64_t cols, const float* bias, const W* ahead, int64_t ahead_lines) {
#if defined(__AVX512F__)
  switch (rows) {
    case 1: return row16(x, panel, K, out, cols, bias, ahead, ahead_lines);
    case 2: return block16<2>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 3: return block16<3>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 4: return block16<4>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 5: return block16<5>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 6: return block16<6>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 7: return block16<7>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 8: return block16<8>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 9: return block16<9>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 10: return block16<10>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 11: return block16<11>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 12: return block16<12>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 13: return block16<13>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 14: return block16<14>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 15: return block16<15>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    default: return block16<16>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (rows) {
    case 1: return row(x, panel, K, out, cols, bias, ahead, ahead_lines);
    case 2: return block<2>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 3: return block<3>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 4: return block<4>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    case 5: return block<5>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
    default: return block<6>(x, ldx, panel, K, out, ldo, cols, bias, ahead, ahead_lines);
  }
#else
  // Portable path (no AVX2/FMA): the same order of work, vectorised by the compiler where it can.
  (void)ahead;
  (void)ahead_lines;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {0};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += xv * static_cast<float>(panel[k * kPanel + j]);
    }
    for (int64_t j = 0; j < cols; ++j) out[r * ldo + j] = acc[j] + (bias ? bias[j] : 0.f);
  }
#endif
}

// A panel's K lines of 16 weights widened to fp32, into wide.
template <typename W>
void widen_panel(const W* panel, int64_t K, float* wide) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    load_line(panel + k * kPanel, lo, hi);
    _mm256_storeu_ps(wide + k * kPanel, lo);
    _mm256_storeu_ps(wide + k * kPanel + 8, hi);
  }
#else
  for (int64_t i = 0; i < K * kPanel; ++i) wide[i] = static_cast<float>(panel[i]);
#endif
}

}  // namespace minipd_panels

// The instruction set this build's fast paths were compiled for (MINIPD_CPU_ISA chooses it; the tests check that a
// limited build really is one).
std::string compiled_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

using minipd_panels::kBlockRows;
using minipd_panels::kSingleBlockRows;
using minipd_panels::kChunkBytes;
using minipd_panels::kPanel;

bool panel_dtype(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kHalf;
}

// W (N, K) -> panels (ceil(N / 16), K, 16) of W's dtype, the features past N zero.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && panel_dtype(weight.scalar_type()) && weight.device().is_cpu(),
              "pack_panels: weight must be a 2-D fp32, bf16 or fp16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// x (M, K) @ W.T + bias -> (M, N) as rows of fp32 (x, bias and out), the panels of type W.
template <typename W>
void multiply_panels(const float* xp, int64_t M, int64_t K, const W* pp, int64_t P, const float* bp, float* op,
                     int64_t N) {
  const int64_t chunk = std::max<int64_t>(
      kSingleBlockRows, kChunkBytes / (4 * std::max<int64_t>(K, 1)) / kBlockRows * kBlockRows);
  constexpr bool kNarrow = !std::is_same_v<W, float>;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(kNarrow ? K * kPanel : 0);  // a narrow panel widened, for chunks of several blocks
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {  // a chunk of rows stays in L2 while this thread's panels pass
      const int64_t r1 = std::min(M, r0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        // The panel this thread takes next: p + 1, or its first one again for the next chunk of rows. (One or two
        // rows stream the weight at memory speed anyway: prefetching it as well was 5% slower for two.)
        const int64_t next = r1 - r0 <= 2 ? -1 : p + 1 < end ? p + 1 : (r1 < M ? begin : -1);
        const int64_t blocks = r1 - r0 <= kSingleBlockRows ? 1 : (r1 - r0 + kBlockRows - 1) / kBlockRows;
        const W* panel = pp + p * K * kPanel;
        // Up to three blocks widen the weights as they load them (16 rows: 0.88x fp32's time on a 50M model's
        // linears, where a widened copy took 1.16x); more share one widened copy.
        const bool widen = kNarrow && blocks > 3;
        if (widen) minipd_panels::widen_panel(panel, K, wide.data());
        for (int64_t b = 0; b < blocks; ++b) {
          // Blocks of even size (17 rows: 8 + 9, not 12 + 5): a short block has too few sums to fill the FMA units.
          const int64_t r = r0 + b * (r1 - r0) / blocks, rows = r0 + (b + 1) * (r1 - r0) / blocks - r;
          const int64_t first = b * K / blocks, lines = next < 0 ? 0 : (b + 1) * K / blocks - first;
          float* out = op + r * N + p * kPanel;
          const float* bias = bp ? bp + p * kPanel : nullptr;
          const W* ahead = pp + (next < 0 ? 0 : next * K + first) * kPanel;
          if (widen)  // (the next panel is prefetched as it is stored: in bf16/fp16, a cache line per 32 weights)
            minipd_panels::rows_times_panel<float>(xp + r * K, K, rows, wide.data(), K, out, N, cols, bias,
                                                   reinterpret_cast<const float*>(ahead), lines * sizeof(W) / 4);
          else
            minipd_panels::rows_times_panel<W>(xp + r * K, K, rows, panel, K, out, N, cols, bias, ahead, lines);
        }
      }
    }
  });
}

// x (M, K) @ W.T + bias -> (M, N), W given as pack_panels(W). fp32 panels take fp32 x; bf16 and fp16 panels take x
// in their dtype or fp32, and the result has x's dtype (computed in fp32, rounded once).
torch::Tensor panel_linear(const torch::Tensor& x_in, const torch::Tensor& panels,
                           const c10::optional<torch::Tensor>& bias_in, int64_t N) {
  MINIPD_RELEASE_GIL_IF_HELD
  const auto wtype = panels.scalar_type(), xtype = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  (xtype == torch::kFloat32 || (wtype != torch::kFloat32 && xtype == wtype)),
              "panel_linear: x must be a 2-D CPU tensor of fp32, or of the panels' dtype");
  TORCH_CHECK(panels.dim() == 3 && panel_dtype(wtype) && panels.is_contiguous() &&
                  panels.size(1) == x_in.size(1) && panels.size(2) == kPanel && panels.size(0) * kPanel >= N &&
                  (panels.size(0) - 1) * kPanel < N,
              "panel_linear: panels must be pack_panels(W) of a W with N rows and x's number of columns");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();  // (no copy for fp32 rows already in order)
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N && (bias_in->scalar_type() == torch::kFloat32 ||
                                          bias_in->scalar_type() == wtype),
                "panel_linear: bias of N values, fp32 or the panels' dtype");
    bias = bias_in->to(torch::kFloat32).contiguous();
  }
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const float* xp = x.data_ptr<float>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    if (wtype == torch::kFloat32)
      multiply_panels(xp, M, K, panels.data_ptr<float>(), P, bp, op, N);
    else if (wtype == torch::kBFloat16)
      multiply_panels(xp, M, K, panels.data_ptr<at::BFloat16>(), P, bp, op, N);
    else
      multiply_panels(xp, M, K, panels.data_ptr<at::Half>(), P, bp, op, N);
  }
  return xtype == torch::kFloat32 ? out : out.to(xtype);
}

// Also a dispatcher op (torch.ops.minipd_cpu.panel_linear), so a compiled graph calls it with no Python between.
TORCH_LIBRARY_FRAGMENT(minipd_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(minipd_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
