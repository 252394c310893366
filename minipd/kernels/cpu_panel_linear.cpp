// Linear layers on the CPU with weights packed in panels of 16 output features (linear_backend="cpu").
//
// A panel holds 16 rows of W (16 output features) interleaved by input: panel[k][j] = W[16 p + j][k]. A
// register block multiplies up to 6 input rows by one panel: per input k, two loads of the panel (16
// floats), one broadcast per row, 12 fused multiply-adds into 12 accumulators. The weight is read once per
// block of 6 rows, in order, so one decode row streams it at memory speed and a full block runs at the
// FMA units' rate. Threads split the panels; rows are taken in chunks that stay in the L2 cache. While a panel's
// blocks run, they prefetch the next panel into L2, a share each: with several blocks (a decode batch of 16 rows
// is three), only the first would otherwise wait for memory, and the others would leave it idle.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <optional>
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

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 registers of fp32
constexpr int64_t kBlockRows = 6;  // input rows per register block: 12 accumulators of the 16 registers
constexpr int64_t kChunkBytes = 256 << 10;  // input rows taken together: what half an L2 cache holds

#if defined(__AVX2__) && defined(__FMA__)
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
template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
                  int64_t cols, const float* bias, const float* ahead, int64_t ahead_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0, e0 = a0,
         e1 = a0, f0 = a0, f1 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
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
inline void row(const float* x, const float* panel, int64_t K, float* out, int64_t cols, const float* bias,
                const float* ahead, int64_t ahead_lines) {
  for (int64_t k = 0; k < ahead_lines; ++k)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(panel + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(panel + k * kPanel + 8), a1);
    b0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + (k + 1) * kPanel), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + (k + 1) * kPanel + 8), b1);
  }
  if (k < K) {
    const __m256 xa = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(panel + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(panel + k * kPanel + 8), a1);
  }
  store_row(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), out, cols, bias);
}
#endif

// Rows [0, rows) (at most kBlockRows) of x times one panel, into out (row stride ldo).
void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t K, float* out,
                      int64_t ldo, int64_t cols, const float* bias, const float* ahead, int64_t ahead_lines) {
#if defined(__AVX2__) && defined(__FMA__)
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
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += xv * panel[k * kPanel + j];
    }
    for (int64_t j = 0; j < cols; ++j) out[r * ldo + j] = acc[j] + (bias ? bias[j] : 0.f);
  }
#endif
}

}  // namespace minipd_panels

using minipd_panels::kBlockRows;
using minipd_panels::kChunkBytes;
using minipd_panels::kPanel;

// W (N, K) -> panels (ceil(N / 16), K, 16), the features past N zero.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack_panels: weight must be a 2-D fp32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// x (M, K) @ W.T + bias -> (M, N), W given as pack_panels(W).
torch::Tensor panel_linear(const torch::Tensor& x_in, const torch::Tensor& panels,
                           const c10::optional<torch::Tensor>& bias_in, int64_t N) {
  MINIPD_RELEASE_GIL_IF_HELD
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
              "panel_linear: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kFloat32 && panels.is_contiguous() &&
                  panels.size(1) == x_in.size(1) && panels.size(2) == kPanel && panels.size(0) * kPanel >= N &&
                  (panels.size(0) - 1) * kPanel < N,
              "panel_linear: panels must be pack_panels(W) of a W with N rows and x's number of columns");
  const torch::Tensor x = x_in.contiguous();
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N && bias_in->scalar_type() == torch::kFloat32, "panel_linear: bias of N fp32");
    bias = bias_in->contiguous();
  }
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(kBlockRows, kChunkBytes / (4 * std::max<int64_t>(K, 1)) / kBlockRows *
                                                          kBlockRows);
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {  // a chunk of rows stays in L2 while this thread's panels pass
      const int64_t r1 = std::min(M, r0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        // The panel this thread takes next: p + 1, or its first one again for the next chunk of rows. (One or two
        // rows stream the weight at memory speed anyway: prefetching it as well was 5% slower for two.)
        const int64_t next = r1 - r0 <= 2 ? -1 : p + 1 < end ? p + 1 : (r1 < M ? begin : -1);
        const int64_t blocks = (r1 - r0 + kBlockRows - 1) / kBlockRows;
        for (int64_t r = r0, b = 0; r < r1; r += kBlockRows, ++b) {
          const int64_t first = b * K / blocks, lines = next < 0 ? 0 : (b + 1) * K / blocks - first;
          minipd_panels::rows_times_panel(xp + r * K, K, std::min(kBlockRows, r1 - r), pp + p * K * kPanel, K,
                                          op + r * N + p * kPanel, N, cols, bp ? bp + p * kPanel : nullptr,
                                          pp + (next < 0 ? 0 : next * K + first) * kPanel, lines);
        }
      }
    }
  });
  return out;
}

// Also a dispatcher op (torch.ops.minipd_cpu.panel_linear), so a compiled graph calls it with no Python between.
TORCH_LIBRARY_FRAGMENT(minipd_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(minipd_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
