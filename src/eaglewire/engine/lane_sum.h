// The one horizontal sum of an 8-lane vector that every eaglewire kernel uses: a row's bits depend on its
// fixed order ((0+4, 1+5, 2+6, 3+7), then pairs, then the last two), so it has one home.
// rowwise_kernel.py puts this file's hash into the extension's build flags: torch's builder hashes only the
// listed sources, and an edit here must rebuild them.
#pragma once
#include <immintrin.h>

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
