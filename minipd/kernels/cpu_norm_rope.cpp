// RMSNorm, the residual add fused with it, and RoPE, each in one pass over fp32 activations, for the eager
// (prefill) path. In torch each is a chain of four to six elementwise ops, every one a pass over the (tokens,
// width) activations with a fresh tensor: on tiny-py's 2,048-token prefill steps the chains cost several times
// the bytes they touch. Compiled decode keeps torch's ops, which the compiler fuses itself.
// Compiled with cpu_paged_attention.cpp (its includes come first).

namespace {

void check_f32_cpu(const torch::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, what, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// Rows in grains of ~16K elements: a decode step's few rows stay on the calling thread.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// y = weight * (x * rsqrt(mean(x^2) + eps)) for one row, the reference's order of products.
inline void norm_row(const float* x, const float* w, float* y, int64_t dim, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < dim; ++j) squares += x[j] * x[j];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t j = 0; j < dim; ++j) y[j] = w[j] * (x[j] * inv);
}

}  // namespace

torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps) {
  check_f32_cpu(x, "rms_norm_f32", "x");
  check_f32_cpu(weight, "rms_norm_f32", "weight");
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm_f32: x must be contiguous with a last dimension of ", dim, " (the weight's), got shape ",
              x.sizes());
  auto out = torch::empty_like(x);
  const int64_t rows = dim ? x.numel() / dim : 0;
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(in + r * dim, w, y + r * dim, dim, e);
  });
  return out;
}

// (rms_norm(x + residual), x + residual): the pre-norm block's add and norm, each row read once.
std::vector<torch::Tensor> add_rms_norm_f32(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                            double eps) {
  check_f32_cpu(x, "add_rms_norm_f32", "x");
  check_f32_cpu(residual, "add_rms_norm_f32", "residual");
  check_f32_cpu(weight, "add_rms_norm_f32", "weight");
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.sizes() == residual.sizes() && x.dim() >= 1 && x.size(-1) == dim && x.is_contiguous() &&
                  residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm_f32: x and residual must be contiguous, of one shape, with a last dimension of ", dim,
              " (the weight's); got ", x.sizes(), " and ", residual.sizes());
  auto normed = torch::empty_like(x);
  auto summed = torch::empty_like(x);
  const int64_t rows = dim ? x.numel() / dim : 0;
  const float *a = x.data_ptr<float>(), *b = residual.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *y = normed.data_ptr<float>(), *s = summed.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t at = r * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) s[at + j] = a[at + j] + b[at + j];
      norm_row(s + at, w, y + at, dim, e);
    }
  });
  return {normed, summed};
}

// RoPE in the HF layout: x * cos + rotate_half(x) * sin, where rotate_half maps halves (a, b) to (-b, a).
// x is (tokens, heads, head_dim) with any token and head strides (q and k are views into the fused qkv
// projection's rows) and a contiguous last dimension; cos and sin are (tokens, [1,] head_dim), contiguous.
// The output is a new contiguous (tokens, heads, head_dim) tensor.
torch::Tensor rotary_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_f32_cpu(x, "rotary_f32", "x");
  check_f32_cpu(cos, "rotary_f32", "cos");
  check_f32_cpu(sin, "rotary_f32", "sin");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rotary_f32: x must be (tokens, heads, head_dim) with an even, contiguous head_dim; got shape ",
              x.sizes(), " and strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == tokens * dim && cos.size(0) == tokens &&
                  cos.size(-1) == dim && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_f32: cos and sin must be contiguous (tokens, [1,] head_dim) = (", tokens, ", ", dim,
              "); got ", cos.sizes(), " and ", sin.sizes());
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const float *in = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *ct = c + t * dim, *st = sn + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xa = in + t * token_stride + h * head_stride;
        const float* xb = xa + half;
        float* o = y + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) o[j] = xa[j] * ct[j] + (-xb[j]) * st[j];
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) o[half + j] = xb[j] * ct[half + j] + xa[j] * st[half + j];
      }
    }
  });
  return out;
}
