// y = x W^T (+ b) in fp32 for a few rows, with AVX2 + FMA, row-invariant by construction.
//
// Every output element y[m, n] is one fixed instruction sequence: an 8-lane FMA accumulator run over k in
// order, a fixed horizontal sum, the k % 8 tail by scalar FMA, then the bias. Blocking (2 rows x 4 weight
// rows per register tile), threads (split over weight rows) and the number of rows only decide which
// elements are computed together, never how one is summed; so a row's result is bit for bit the same
// whatever rows share the call. Why this exists and what it measures: rowwise_kernel.py.
//
// rowwise_linear_blocks takes W as exact block codes (block_codes.py): each run of 32 weights along K is
// d * q + m with a 4-bit or 8-bit integer q, or an fp16 q (d = 1, m = -0.0). For one to four x rows (eight
// where built for AVX-512VL: a decode step, a chain's verify step) it multiplies weights decoded in registers;
// for more it decodes eight weight rows at a time into a cache-resident panel and runs the same tiles over it.
// Built for AVX-512VL, a decode step's one row decodes 4-bit codes by table lookup (decode_block_by_table).
// Either way each element is summed as rowwise_linear sums it from the decoded W, so the output is bit for
// bit the same, from 1.8-5x fewer bytes of weights (with fp32 weights a decode step on this CPU is bound by reading them).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "lane_sum.h"

namespace {

constexpr int kRowsPerTile = 2;     // x rows per register tile: 2 x 4 accumulators + 4 weights + 1 input of 16 ymm
constexpr int kWeightsPerTile = 4;  // weight rows per register tile (contiguous: 4 K floats)

// A prefetch the compiler must emit. GCC 12 at -O3 silently dropped every _mm_prefetch from some instantiations
// of few_rows and kept them in others, and which ones changed with unrelated edits (one x row without them:
// SmolLM2's layer matrices 5.8 -> 12.8 ms on Zen 4); a volatile asm statement is never removed.
inline void prefetch_line(const void* address) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(address)));
}

// kPrefetch: W's next weight rows follow these in memory (not so for a decoded panel).
template <int MB, int NB, bool kPrefetch>
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
    if constexpr (kPrefetch) {
      prefetch_line(next + k * NB * 4);
      prefetch_line(next + k * NB * 4 + 64);
    }
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

constexpr int64_t kBlock = 32;  // weights per block code along K

// One block of a weight row from its codes, as four vectors of 8 weights in K order: w = d * q + m. d * q is
// exact (d has the 11 significant bits of an fp16 and q at most 8; or d = 1), so the FMA rounds once, as an
// fp32 multiply-then-add would.
template <int BITS>
inline void decode_block(const uint8_t* codes, float scale, float offset, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  if constexpr (BITS == 4) {  // byte i holds q[i] (low nibble) and q[i + 16] (high nibble)
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i lo = _mm_and_si128(packed, low_nibbles);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
  } else if constexpr (BITS == 16) {  // one fp16 per weight, d = 1 and m = -0.0: the value itself, no FMA
    // (v * 1 + -0.0 is v for every v; dropping it made a drafter's nine matrices 0.73 -> 0.65 ms for one row on Zen 4)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16)));
  } else {  // one signed byte per weight
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * 8)))), d, m);
  }
}

#ifdef __AVX512VL__
// decode_block<4>'s four vectors by table lookup: the block's 16 possible weights d * k + m (k = 0..15) by the
// same FMA, then each code picks its weight (a two-table permute reads an index's low 4 bits, so the high
// nibbles need only a shift). The same values as decode_block<4>, with two FMAs a block instead of four FMAs
// and four conversions. Faster only where decoding bounds the product, i.e. for one x row: SmolLM2's layer
// matrices on Zen 4, one thread (medians of 11 rounds, same bits): 1 row 7.26 -> 6.54 ms, 3-5 rows 2-6% slower.
inline void decode_block_by_table(const uint8_t* codes, float scale, float offset, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  const __m256 low = _mm256_fmadd_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), d, m);
  const __m256 high = _mm256_fmadd_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), d, m);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8)));
  w[0] = _mm256_permutex2var_ps(low, first, high);
  w[1] = _mm256_permutex2var_ps(low, second, high);
  w[2] = _mm256_permutex2var_ps(low, _mm256_srli_epi32(first, 4), high);
  w[3] = _mm256_permutex2var_ps(low, _mm256_srli_epi32(second, 4), high);
}
constexpr bool kDecodeByTable = true;
#else
inline void decode_block_by_table(const uint8_t*, float, float, __m256*) {}
constexpr bool kDecodeByTable = false;
#endif

template <int BITS>
inline void decode_row(const uint8_t* codes, const float* scale, const float* offset, int64_t blocks, float* out) {
  constexpr int64_t bytes = kBlock * BITS / 8;
  for (int64_t b = 0; b < blocks; ++b, out += kBlock) {
    __m256 w[4];
    decode_block<BITS>(codes + b * bytes, scale[b], offset[b], w);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + i * 8, w[i]);
  }
}

// The next ROWS weight rows follow these in memory: each block fetches its share of them (ROWS blocks of
// codes, ROWS scales and offsets) while it multiplies, which the hardware prefetcher's 3 * ROWS strided
// streams miss. SmolLM2's 210 layer matrices, one row, one thread: 18.8 -> 16.7 ms (medians of 40 rounds).
template <int BITS, int ROWS>
inline void fetch_next_rows(const uint8_t* codes, const float* scale, const float* offset, int64_t blocks, int64_t blk) {
  constexpr int64_t bytes = kBlock * BITS / 8;
  const char* next_codes = reinterpret_cast<const char*>(codes + (ROWS * blocks + blk * ROWS) * bytes);
  for (int64_t line = 0; line < ROWS * bytes; line += 64) prefetch_line(next_codes + line);
  if ((blk * ROWS * 4) % 64 < ROWS * 4) {  // a new cache line of scales and offsets
    prefetch_line(scale + ROWS * blocks + blk * ROWS);
    prefetch_line(offset + ROWS * blocks + blk * ROWS);
  }
}

// Tiles of 4 or 8 weight rows read 12-24 strided streams (codes, scales, offsets), more than the hardware
// prefetcher follows, and fetch_next_rows pays; a tile of 2 weight rows (7-8 x rows) reads 6, which it follows, and
// the extra prefetches only evict x rows from L1 (7 rows of a K = 1536 input are 43 KB). SmolLM2's layer matrices on
// Zen 4, one thread, medians of 9-15 rounds, same bits: prefetching 2/3 x rows (4 weight rows) 0.82-0.84/0.87-0.89 of
// the time without, 4-6 x rows by 4 weight rows 0.89-0.93 of 4-6 by 2 without (by 4 without: 0.96-1.01; by 2 with:
// 0.97-1.04), 7/8 x rows by 2 with 1.13/1.07 of without.
constexpr int kFetchAheadWeightRows = 4;

// M x rows (a decode step's one, a verify step's 2-8) by ROWS weight rows decoded in registers, never stored.
// Each element is its own 8-lane accumulator over K in order, then lane_sum and the bias, as a panel's tiles
// sum it, so the result is bit for bit the panel path's without its stores and loads. SmolLM2's layer
// matrices, one thread: 1 row 20.4 ms through a panel, 17.8 so (ROWS = 8); 2/3/4 rows 22.2/27.5/32.6 ms,
// 17.0/22.2/27.5 so (ROWS = 4, or 2 for 4 x rows: M * ROWS accumulators fill AVX2's 16 registers; AVX-512VL's
// 32 hold 4-6 x rows by 4 weight rows, 7-8 by 2).
// Every loop over acc's indices unrolls fully (M, ROWS <= 8): one left rolled indexes acc at run time, which
// keeps it in memory, not registers (Zen 4, one thread, medians of 11 rounds, same bits: 6/7/8 x rows
// 20.8/22.9/27.1 ms -> 18.9/20.4/25.6; one x row, ROWS = 8, with decode_block_by_table 6.43 -> 6.11).
// Never inlined: one call covers a whole weight row's blocks, and inlined into its caller's switch some
// instantiations came out slower with no change to their code (4 x rows 14.9 ms before an unrelated edit
// elsewhere in this file, 16.4 after it, 15.0 as its own function: medians of 9 rounds, the three builds alternating;
// probably the compiler's dropped prefetches, found since: see prefetch_line).
template <int BITS, int M, int ROWS>
__attribute__((noinline)) void few_rows(const float* x, int64_t K, const uint8_t* codes, const float* scale,
                                        const float* offset, int64_t blocks, const float* b, float* y, int64_t N) {
  constexpr int64_t bytes = kBlock * BITS / 8;
  __m256 acc[M][ROWS];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < ROWS; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    if constexpr (ROWS >= kFetchAheadWeightRows) fetch_next_rows<BITS, ROWS>(codes, scale, offset, blocks, blk);
    const float* xb = x + blk * kBlock;
#pragma GCC unroll 8
    for (int j = 0; j < ROWS; ++j) {
      __m256 w[4];
      if constexpr (BITS == 4 && M == 1 && kDecodeByTable)
        decode_block_by_table(codes + (j * blocks + blk) * bytes, scale[j * blocks + blk], offset[j * blocks + blk], w);
      else
        decode_block<BITS>(codes + (j * blocks + blk) * bytes, scale[j * blocks + blk], offset[j * blocks + blk], w);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * K + c * 8), w[c], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < ROWS; ++j) {
      float s = lane_sum(acc[i][j]);
      if (b != nullptr) s += b[j];
      y[i * N + j] = s;
    }
}

template <int NB, bool kPrefetch = true>
inline void all_rows(const float* x, int64_t M, int64_t K, const float* w, const float* b, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile) tile<kRowsPerTile, NB, kPrefetch>(x + m * K, w, K, b, y + m * N, N);
  for (; m < M; ++m) tile<1, NB, kPrefetch>(x + m * K, w, K, b, y + m * N, N);
}

// The bias's values (fp32, contiguous, N of them), or nullptr for none.
const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "rowwise product: fp32 bias [N]");
  return bias->data_ptr<float>();
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
  const float* bp = bias_data(bias, N);
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

constexpr int kPanelRows = 2 * kWeightsPerTile;  // weight rows decoded at a time
// The most x rows multiplied from weights decoded in registers; more go through a decoded panel. 5-6 rows by
// 4 weight rows take 20-24 accumulators, 7-8 by 2 take 14-16: they fit AVX-512VL's 32 ymm registers, not AVX2's
// 16. SmolLM2's layer matrices on Zen 4, one thread (medians of 7 rounds, all by 2 weight rows then): 5/6/7/8 rows
// 26.3/28.5/32.4/35.7 ms through a panel, 21.1/24.8/27.3/32.4 ms so; built for AVX2 alone (spilling) they moved
// within the builds' ±10% noise.
#ifdef __AVX512VL__
constexpr int64_t kRegisterRows = 8;
#else
constexpr int64_t kRegisterRows = 4;
#endif

// Every x row against a decoded panel of kPanelRows weight rows: pairs of x rows in 2 x 4 tiles, each half of
// the panel in turn (4 rows of K stay in L1), and an odd last row in one 1 x 8 tile, whose 8 accumulators
// keep both FMA units busy where a 1 x 4 tile waits on their latency (a decode step is one row: SmolLM2's
// 210 layer matrices take 20.4 ms so, 21.6 as two 1 x 4 tiles).
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* b, float* y, int64_t N) {
  const int64_t pairs = M & ~int64_t(1);
  for (int half = 0; half < 2; ++half) {
    const int64_t j = half * kWeightsPerTile;
    for (int64_t m = 0; m < pairs; m += 2)
      tile<2, kWeightsPerTile, false>(x + m * K, panel + j * K, K, b ? b + j : nullptr, y + m * N + j, N);
  }
  if (M & 1) tile<1, kPanelRows, false>(x + pairs * K, panel, K, b, y + pairs * N, N);
}

struct BlockCodes {
  const uint8_t* codes;
  const float* scale;
  const float* offset;
  int64_t blocks, row_bytes;  // per weight row
  int64_t bits;
  void decode(int64_t row, int64_t rows, float* out) const {
    for (int64_t r = row; r < row + rows; ++r, out += blocks * kBlock) {
      const uint8_t* c = codes + r * row_bytes;
      if (bits == 4) decode_row<4>(c, scale + r * blocks, offset + r * blocks, blocks, out);
      else if (bits == 8) decode_row<8>(c, scale + r * blocks, offset + r * blocks, blocks, out);
      else decode_row<16>(c, scale + r * blocks, offset + r * blocks, blocks, out);
    }
  }
};

template <int ROWS>
void one_row_of(const BlockCodes& w, const float* x, int64_t row, const float* b, float* y) {
  const uint8_t* c = w.codes + row * w.row_bytes;
  const float* d = w.scale + row * w.blocks;
  const float* m = w.offset + row * w.blocks;
  if (w.bits == 4) few_rows<4, 1, ROWS>(x, 0, c, d, m, w.blocks, b, y, 0);  // one x row: K and N are not read
  else if (w.bits == 8) few_rows<8, 1, ROWS>(x, 0, c, d, m, w.blocks, b, y, 0);
  else few_rows<16, 1, ROWS>(x, 0, c, d, m, w.blocks, b, y, 0);
}

// x rows [M, K] (M = 2..8) by one panel's kPanelRows weight rows from row, in groups of ROWS.
template <int M, int ROWS>
void few_rows_of(const BlockCodes& w, const float* x, int64_t K, int64_t row, const float* b, float* y, int64_t N) {
  for (int64_t j = 0; j < kPanelRows; j += ROWS) {
    const uint8_t* c = w.codes + (row + j) * w.row_bytes;
    const float* d = w.scale + (row + j) * w.blocks;
    const float* m = w.offset + (row + j) * w.blocks;
    const float* bj = b ? b + j : nullptr;
    if (w.bits == 4) few_rows<4, M, ROWS>(x, K, c, d, m, w.blocks, bj, y + j, N);
    else if (w.bits == 8) few_rows<8, M, ROWS>(x, K, c, d, m, w.blocks, bj, y + j, N);
    else few_rows<16, M, ROWS>(x, K, c, d, m, w.blocks, bj, y + j, N);
  }
}

BlockCodes block_codes(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16, "block codes: 4, 8 or 16 bits, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == kBlock * bits / 8 && codes.is_contiguous(),
              "block codes: uint8 codes [N, K / 32, 32 * bits / 8]");
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == codes.size(0) &&
                t->size(1) == codes.size(1), "block codes: fp32 scale and offset [N, K / 32]");
  return {codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), codes.size(1), codes.size(1) * codes.size(2), bits};
}

// The codes of one block, as block_codes.py describes the search: offset m = the least value (4 bits) or
// +0.0 (8 bits), scale d = the first of the fp16 values within 2 ulps of (max - m) / 15 or max |v| / 127 for which
// d * q + m, q rounded into the code range, gives back every value bit for bit. False: no such codes.
template <int BITS>
bool encode_block(const float* v, uint8_t* codes, float* scale, float* offset) {
  constexpr int low = BITS == 4 ? 0 : -128, high = BITS == 4 ? 15 : 127;
  float least = v[0], most = v[0], magnitude = std::fabs(v[0]);
  for (int i = 1; i < kBlock; ++i) {
    least = std::min(least, v[i]);
    most = std::max(most, v[i]);
    magnitude = std::max(magnitude, std::fabs(v[i]));
  }
  const float m = BITS == 4 ? least : 0.0f;
  const uint16_t estimate = _cvtss_sh(BITS == 4 ? (most - least) / high : magnitude / high, _MM_FROUND_TO_NEAREST_INT);
  for (int ulps : {0, -1, 1, -2, 2}) {
    const float d = _cvtsh_ss(static_cast<uint16_t>(estimate + ulps));
    if (!std::isfinite(d) || d < 0) continue;
    int q[kBlock];
    bool exact = true;
    for (int i = 0; i < kBlock && exact; ++i) {
      // rint: round half to even, one instruction with SSE4.1 (nearbyint is a libm call)
      q[i] = d > 0 ? static_cast<int>(std::clamp(std::rint((v[i] - m) / d), float(low), float(high))) : 0;
      const float back = std::fma(d, static_cast<float>(q[i]), m);
      uint32_t back_bits, value_bits;
      std::memcpy(&back_bits, &back, sizeof(float));
      std::memcpy(&value_bits, v + i, sizeof(float));
      exact = back_bits == value_bits;
    }
    if (!exact) continue;
    for (int i = 0; i < kBlock; ++i) {
      if constexpr (BITS == 4) {
        if (i < kBlock / 2) codes[i] = static_cast<uint8_t>(q[i] | (q[i + kBlock / 2] << 4));
      } else {
        codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
      }
    }
    *scale = d;
    *offset = m;
    return true;
  }
  return false;
}

// Block codes of w [N, K] (K a multiple of 32) with 4 or 8 bits, or empty tensors where some block has none.
std::vector<torch::Tensor> encode_blocks(const torch::Tensor& w, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "encode_blocks: 4 or 8 bits, got ", bits);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) % kBlock == 0,
              "encode_blocks: contiguous fp32 w [N, K], K a multiple of 32");
  const int64_t N = w.size(0), blocks = w.size(1) / kBlock, bytes = kBlock * bits / 8;
  auto codes = torch::empty({N, blocks, bytes}, w.options().dtype(at::kByte));
  auto scale = torch::empty({N, blocks}, w.options());
  auto offset = torch::empty({N, blocks}, w.options());
  const float* v = w.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* d = scale.data_ptr<float>();
  float* m = offset.data_ptr<float>();
  for (int64_t b = 0; b < N * blocks; ++b) {
    const bool found = bits == 4 ? encode_block<4>(v + b * kBlock, c + b * bytes, d + b, m + b)
                                 : encode_block<8>(v + b * kBlock, c + b * bytes, d + b, m + b);
    if (!found) return {};
  }
  return {codes, scale, offset};
}

torch::Tensor dequantize_blocks(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset, int64_t bits) {
  const BlockCodes w = block_codes(codes, scale, offset, bits);
  auto out = torch::empty({codes.size(0), w.blocks * kBlock}, scale.options());
  w.decode(0, codes.size(0), out.data_ptr<float>());
  return out;
}

// Whether the codes decode (with the decoder the products use) into w bit for bit: row by row, no copy of w.
bool decodes_to(const torch::Tensor& w, const torch::Tensor& codes, const torch::Tensor& scale,
                const torch::Tensor& offset, int64_t bits) {
  const BlockCodes c = block_codes(codes, scale, offset, bits);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == codes.size(0) &&
              w.size(1) == c.blocks * kBlock, "decodes_to: contiguous fp32 w [N, 32 * blocks]");
  const int64_t K = w.size(1);
  std::vector<float> row(K);
  for (int64_t n = 0; n < w.size(0); ++n) {
    c.decode(n, 1, row.data());
    if (std::memcmp(row.data(), w.data_ptr<float>() + n * K, K * sizeof(float)) != 0) return false;
  }
  return true;
}

torch::Tensor rowwise_linear_blocks(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                    const torch::Tensor& offset, int64_t bits, const c10::optional<torch::Tensor>& bias) {
  const BlockCodes w = block_codes(codes, scale, offset, bits);
  const int64_t M = x.size(0), K = w.blocks * kBlock, N = codes.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rowwise_linear_blocks: contiguous fp32 x [M, K] with K = 32 * blocks");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = bias_data(bias, N);
  float* yp = y.data_ptr<float>();
  const int64_t panels = N / kPanelRows;
  if (M == 1) {  // a decode step: decoded weights are used once, so they stay in registers
    at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        one_row_of<kPanelRows>(w, xp, p * kPanelRows, bp ? bp + p * kPanelRows : nullptr, yp + p * kPanelRows);
    });
    for (int64_t n = panels * kPanelRows; n < N; ++n) one_row_of<1>(w, xp, n, bp ? bp + n : nullptr, yp + n);
    return y;
  }
  if (M <= kRegisterRows) {  // a chain's verify step: decoded weights are used 2-8 times, still in registers
    at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * kPanelRows;
        const float* bn = bp ? bp + n : nullptr;
        switch (M) {
          case 2: few_rows_of<2, 4>(w, xp, K, n, bn, yp + n, N); break;
          case 3: few_rows_of<3, 4>(w, xp, K, n, bn, yp + n, N); break;
          case 4: few_rows_of<4, kRegisterRows == 8 ? 4 : 2>(w, xp, K, n, bn, yp + n, N); break;
          case 5: few_rows_of<5, 4>(w, xp, K, n, bn, yp + n, N); break;
          case 6: few_rows_of<6, 4>(w, xp, K, n, bn, yp + n, N); break;
          case 7: few_rows_of<7, 2>(w, xp, K, n, bn, yp + n, N); break;
          default: few_rows_of<8, 2>(w, xp, K, n, bn, yp + n, N); break;
        }
      }
    });
  } else {  // more rows: each decoded panel is stored once and multiplied by all of them
    at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
      // one panel's weight rows, decoded: cache-line aligned (unaligned vector loads that straddle lines cost
      // twice the cache accesses)
      // (uninitialized: decode writes every element before a tile reads it)
      const std::unique_ptr<float[]> storage(new float[kPanelRows * K + 16]);
      float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t(63));
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * kPanelRows;
        w.decode(n, kPanelRows, panel);
        panel_rows(xp, M, K, panel, bp ? bp + n : nullptr, yp + n, N);
      }
    });
  }
  std::vector<float> row(K);
  for (int64_t n = panels * kPanelRows; n < N; ++n) {
    w.decode(n, 1, row.data());
    all_rows<1, false>(xp, M, K, row.data(), bp ? bp + n : nullptr, yp + n, N);
  }
  return y;
}

}  // namespace

// row_attention.cpp, compiled into the same module
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& lengths, const torch::Tensor& index, double scale);
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);
void rope_and_store(torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                    const torch::Tensor& sin_signed, torch::Tensor& k_cache, torch::Tensor& v_cache,
                    const torch::Tensor& slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowwise_linear", &rowwise_linear, "row-invariant fp32 x W^T + b");
  m.def("rowwise_linear_blocks", &rowwise_linear_blocks, "rowwise_linear on W given as exact block codes");
  m.def("dequantize_blocks", &dequantize_blocks, "W [N, K] in fp32 from its block codes");
  m.def("decodes_to", &decodes_to, "whether block codes decode into W [N, K] bit for bit");
  m.def("attend_rows", &attend_rows, "attention of a few query rows over a KV cache layer, each on its own");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of each row, on its own");
  m.def("rope_and_store", &rope_and_store, "RoPE on q (in place) and k, and k and v into a cache layer's slots");
  m.def("encode_blocks", &encode_blocks, "block codes of W [N, K] with 4 or 8 bits, or [] where it has none");
}
