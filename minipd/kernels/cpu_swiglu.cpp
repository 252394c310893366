// SwiGLU's activation in one pass: silu(gate) * up from the fused gate/up projection's output, for the
// eager (prefill) path. In torch it is three passes over the (tokens, 2 x intermediate) activations (silu,
// the product, and the split's strided reads), a sixth of tiny-py's prefill time; here each row is read once.
// Compiled with cpu_paged_attention.cpp (after it: exp_approx and exp_approx8 come from there).

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kFloat,
              "silu_mul: gate_up must be a float32 CPU tensor, got ", gate_up.scalar_type(), " on ", gate_up.device());
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
              "silu_mul: gate_up must be contiguous (rows, 2 x width), got shape ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Rows in grains of ~16K elements: small batches (decode) stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = in + r * 2 * width;
      const float* u = g + width;
      float* o = y + r * width;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; j + 8 <= width; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp_approx8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(sig, _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < width; ++j) o[j] = g[j] / (1.f + exp_approx(-g[j])) * u[j];
    }
  });
  return out;
}
