// y = x W^T (+ b) in fp32 for a few rows, with AVX2 + FMA, row-invariant by construction.
//
// Every output element y[m, n] is one fixed instruction sequence: an 8-lane FMA accumulator run over k in
// order, a fixed horizontal sum, the k % 8 tail by scalar FMA, then the bias. Blocking (2 rows x 4 weight
// rows per register tile), threads (split over weight rows) and the number of rows only decide which
// elements are computed together, never how one is summed; so a row's result is bit for bit the same
// whatever rows share the call. Why this exists and what it measures: rowwise_kernel.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRowsPerTile = 2;     // x rows per register tile: 2 x 4 accumulators + 4 weights + 1 input of 16 ymm
constexpr int kWeightsPerTile = 4;  // weight rows per register tile (contiguous: 4 K floats)

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MB, int NB>
inline void tile(const float* x, const float* w, int64_t K, const float* b, float* y, int64_t N) {
  __m256 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  // The weight rows after this tile's are contiguous with them: fetch them while these multiply.
  const char* next = reinterpret_cast<const char*>(w + NB * K);
  for (int64_t k = 0; k < K8; k += 8) {
    _mm_prefetch(next + k * NB * 4, _MM_HINT_T0);
    _mm_prefetch(next + k * NB * 4 + 64, _MM_HINT_T0);
    __m256 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  // Spill the accumulators once, after the loop (indexing them in the loop below would keep them in memory).
  alignas(32) float lanes[MB][NB][8];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) _mm256_store_ps(lanes[i][j], acc[i][j]);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = lane_sum(_mm256_load_ps(lanes[i][j]));
      for (int64_t k = K8; k < K; ++k) s = std::fma(x[i * K + k], w[j * K + k], s);
      if (b != nullptr) s += b[j];
      y[i * N + j] = s;
    }
}

template <int NB>
inline void all_rows(const float* x, int64_t M, int64_t K, const float* w, const float* b, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile) tile<kRowsPerTile, NB>(x + m * K, w, K, b, y + m * N, N);
  for (; m < M; ++m) tile<1, NB>(x + m * K, w, K, b, y + m * N, N);
}

torch::Tensor rowwise_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rowwise_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rowwise_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rowwise_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "rowwise_linear: bias [N]");
    bp = bias->data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / kWeightsPerTile;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kWeightsPerTile;
      all_rows<kWeightsPerTile>(xp, M, K, wp + n * K, bp ? bp + n : nullptr, yp + n, N);
    }
  });
  for (int64_t n = tiles * kWeightsPerTile; n < N; ++n) all_rows<1>(xp, M, K, wp + n * K, bp ? bp + n : nullptr, yp + n, N);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rowwise_linear", &rowwise_linear, "row-invariant fp32 x W^T + b"); }
