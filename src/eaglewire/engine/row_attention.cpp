// Attention of a few query rows over a KV cache layer, each row on its own, with AVX2 + FMA; and the
// row-wise steps around it (RMSNorm; RoPE and the cache write), which cost ~20 us a call as torch ops.
//
// Row t of q attends over its own keys (slots 0..lengths[t]-1 of the cache, or the slots listed for it in
// index) with the keys' heads shared by H / KVH query heads. Everything a row's result depends on is its
// query, its keys' values in order and their count: blocks of 8 keys, 8-lane accumulators over the head
// dimension, a fixed softmax and a fixed weighted sum. So a verify row gets bit for bit what a one-token
// decode step over the same keys gets, however many rows share the call. Why this exists: lean.py
// (attention); torch's SDPA spends ~0.25 us per key on one query row (105 us at 400 keys on this CPU).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lane_sum.h"

namespace {

constexpr int kKeysPerBlock = 8;  // keys scored together: one 8-lane vector of scores
constexpr int kLanes = 8;
constexpr int64_t kMaxHeadDim = 512;  // rope_and_store rotates a head in a stack buffer this long

// exp(x) for x <= 0 (a softmax's x - max): exp(x) = 2^n * exp(r), r = x - n ln 2 in [-ln2/2, ln2/2], exp(r)
// from its degree-7 Taylor-like minimax polynomial (Cephes' expf coefficients). Below -87.3, 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so n * ln2_high is exact and r keeps its low bits
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// The 8 lane sums of a[0..7] as one vector: lane i = sum of a[i]'s lanes.
inline __m256 lane_sums8(const __m256 a[kKeysPerBlock]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[0..V*8) = sum over the keys of p[j] * rows[j][at..at + V*8), each lane summed over j in order.
template <int V>
inline void weighted_sum(const float* p, const float* const* rows, int64_t at, int64_t n, float* out) {
  __m256 acc[V];
#pragma GCC unroll 8
  for (int c = 0; c < V; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
    for (int c = 0; c < V; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(rows[j] + at + c * kLanes), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < V; ++c) _mm256_storeu_ps(out + c * kLanes, acc[c]);
}

void weighted_sum_any(const float* p, const float* const* rows, int64_t at, int64_t n, int vectors, float* out) {
  switch (vectors) {  // 8 accumulators at most stay in registers; wider heads take several passes
    case 1: return weighted_sum<1>(p, rows, at, n, out);
    case 2: return weighted_sum<2>(p, rows, at, n, out);
    case 3: return weighted_sum<3>(p, rows, at, n, out);
    case 4: return weighted_sum<4>(p, rows, at, n, out);
    case 5: return weighted_sum<5>(p, rows, at, n, out);
    case 6: return weighted_sum<6>(p, rows, at, n, out);
    case 7: return weighted_sum<7>(p, rows, at, n, out);
    default: return weighted_sum<8>(p, rows, at, n, out);
  }
}

// One query head over n keys (rows of D floats, padded with a zero row to a multiple of 8): softmax(q.k * scale) v.
void attend_head(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t n, int64_t D,
                 float scale, float* scores, float* out) {
  const int64_t blocks = (n + kKeysPerBlock - 1) / kKeysPerBlock;
  __m256 most = _mm256_set1_ps(-INFINITY);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* const* keys = k_rows + b * kKeysPerBlock;
    __m256 acc[kKeysPerBlock];
#pragma GCC unroll 8
    for (int i = 0; i < kKeysPerBlock; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += kLanes) {
      const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
      for (int i = 0; i < kKeysPerBlock; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[i] + d), acc[i]);
    }
    __m256 s = _mm256_mul_ps(lane_sums8(acc), _mm256_set1_ps(scale));
    if (b == blocks - 1 && n % kKeysPerBlock) {  // the padding keys score -inf: no weight
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n % kKeysPerBlock)), lane));
      s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, real);
    }
    _mm256_storeu_ps(scores + b * kKeysPerBlock, s);
    most = _mm256_max_ps(most, s);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + b * kKeysPerBlock), top));
    _mm256_storeu_ps(scores + b * kKeysPerBlock, p);
    total = _mm256_add_ps(total, p);
  }
  const float inverse = 1.0f / lane_sum(total);
  for (int64_t d = 0; d < D; d += 8 * kLanes) {
    weighted_sum_any(scores, v_rows, d, n, int(std::min<int64_t>(8, (D - d) / kLanes)), out + d);
  }
  const __m256 inv = _mm256_set1_ps(inverse);
  for (int64_t d = 0; d < D; d += kLanes) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), inv));
}

}  // namespace

// q [T, H, D]; k, v [KVH, S, D] (a cache layer); lengths int64 [T]; index int64 [sum(lengths)] listing each
// row's slots in turn, or empty: row t reads slots 0..lengths[t]-1. Returns [T, H, D].
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& lengths, const torch::Tensor& index, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
              "attend_rows: q [T, H, D], k and v [KVH, S, D]");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "attend_rows: contiguous fp32 q, k, v");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(0), S = k.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "attend_rows: ", H, " query heads are not a multiple of ", KVH, " key heads");
  TORCH_CHECK(D % kLanes == 0, "attend_rows: head dimension ", D, " is not a multiple of 8");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == T && lengths.is_contiguous(),
              "attend_rows: int64 lengths [T]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(), "attend_rows: int64 index [N]");
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> start(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(len[t] >= 1 && len[t] <= S, "attend_rows: row ", t, " attends over ", len[t], " keys, not 1..", S);
    start[t + 1] = start[t] + len[t];
  }
  const bool listed = index.numel() > 0;
  TORCH_CHECK(!listed || index.numel() == start[T], "attend_rows: index lists ", index.numel(), " slots, lengths sum to ", start[T]);
  const int64_t* slots = listed ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; listed && i < start[T]; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < S, "attend_rows: slot ", slots[i], " outside the cache's ", S);

  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / KVH;
  const std::vector<float> zeros(D, 0.0f);  // the padding key
  // one task per (row, key head): its keys' pointers serve the group's query heads
  at::parallel_for(0, T * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> k_rows, v_rows;
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / KVH, kv = i % KVH, n = len[t];
      const int64_t padded = (n + kKeysPerBlock - 1) / kKeysPerBlock * kKeysPerBlock;
      k_rows.assign(padded, zeros.data());
      v_rows.resize(n);
      scores.resize(padded);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = listed ? slots[start[t] + j] : j;
        k_rows[j] = kp + (kv * S + slot) * D;
        v_rows[j] = vp + (kv * S + slot) * D;
      }
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
        attend_head(qp + (t * H + h) * D, k_rows.data(), v_rows.data(), n, D, float(scale), scores.data(),
                    op + (t * H + h) * D);
    }
  });
  return out;
}

// RMSNorm of each row of x [M, H]: w * (x * (1 / sqrt(mean(x^2) + eps))), the sum of squares in 8 lanes over H.
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_contiguous() &&
              weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) && weight.size(0) % kLanes == 0,
              "rms_norm_rows: contiguous fp32 x [..., H] and weight [H], H a multiple of 8");
  const int64_t H = weight.size(0), M = x.numel() / H;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * H;
    __m256 squares = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; h += kLanes) {
      const __m256 v = _mm256_loadu_ps(row + h);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(lane_sum(squares) / float(H) + float(eps)));
    for (int64_t h = 0; h < H; h += kLanes)
      _mm256_storeu_ps(yp + m * H + h, _mm256_mul_ps(_mm256_loadu_ps(wp + h), _mm256_mul_ps(_mm256_loadu_ps(row + h), r)));
  }
  return y;
}

// RoPE on q [T, H, D] (in place) and k [T, KVH, D], with each token's cos and signed sin rows [T, D]
// (x * cos + roll(x, D / 2) * sin_signed); then k and v [T, KVH, D] go to slots [T] of the caches [KVH, S, D].
void rope_and_store(torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                    const torch::Tensor& sin_signed, torch::Tensor& k_cache, torch::Tensor& v_cache,
                    const torch::Tensor& slots) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &cos, &sin_signed, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rope_and_store: contiguous fp32 tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "rope_and_store: q [T, H, D], k and v [T, KVH, D], caches [KVH, S, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), S = k_cache.size(1), half = D / 2;
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && k_cache.size(0) == KVH && k_cache.size(2) == D && D % 16 == 0,
              "rope_and_store: shapes disagree, or the head dimension is not a multiple of 16");
  TORCH_CHECK(D <= kMaxHeadDim, "rope_and_store: head dimension ", D, " over ", kMaxHeadDim);
  TORCH_CHECK(cos.sizes() == sin_signed.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D,
              "rope_and_store: cos and sin rows [T, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "rope_and_store: int64 slots [T]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "rope_and_store: slot ", slot[t], " outside the cache's ", S);
  // one head's rotation: out[i] = x[i] * c[i] + x[(i + half) % D] * s[i], as a product, a product and a sum
  auto rotate = [&](const float* x, const float* c, const float* s, float* out) {
    alignas(32) float rotated[kMaxHeadDim];
    for (int64_t i = 0; i < D; i += kLanes) {
      const int64_t from = (i + half) % D;
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(c + i));
      const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + from), _mm256_loadu_ps(s + i));
      _mm256_store_ps(rotated + i, _mm256_add_ps(a, b));
    }
    std::copy(rotated, rotated + D, out);
  };
  float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + t * D;
    const float* s = sin_signed.data_ptr<float>() + t * D;
    for (int64_t h = 0; h < H; ++h) rotate(qp + (t * H + h) * D, c, s, qp + (t * H + h) * D);
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(kp + (t * KVH + h) * D, c, s, kc + (h * S + slot[t]) * D);
      std::copy(vp + (t * KVH + h) * D, vp + (t * KVH + h + 1) * D, vc + (h * S + slot[t]) * D);
    }
  }
}
