// A few rows (a decode step of 1-GEMV_ROWS sequences) against block weights repacked so that
// each vector lane accumulates one block. More than GEMV_GROUP rows run in groups over each
// weight row (run_groups).
//
// qgemm.cpp's per-row tiles hold two blocks in a zmm (8 int32 lanes each) and so must convert,
// scale and add their sums in float for every two blocks of every weight row: five float
// instructions beside five integer ones, and the core's time goes to arithmetic while the
// weights stream from memory (about 12 of the 32 GB/s two cores read on a Zen 4). Repacked,
// a chunk of 16 blocks is 16 vectors whose lane l only ever holds elements of block l, so a
// chunk's integer sums stay in two accumulators and are scaled once, with the chunk's 16
// scales loaded as one vector and the q4 offset term folded into the same accumulator.
//
// The packed layout (gemv_pack, built once when the model loads; qs keeps the file's layout
// for the other paths): a row is cut into chunks of 16 blocks, then of 2 (nb must be even).
// In a chunk of c blocks, vector v (v < c, 32 int16 lanes) lane k holds element
// 2 * (v * L + (k / 2) % L) + k % 2 of block k / 2 / L, with L = 16 / c lanes pairs per block.
// q8 stores vector v's 32 signed bytes; q4 stores vectors 2u and 2u + 1 in 32 bytes (byte k:
// vector 2u's lane k in the low nibble, vector 2u + 1's in the high one), which for c = 2 is
// exactly the file's own layout. Activations are regrouped the same way once per call.
// Same integer products and scales as qgemm.cpp; only the float rounding order differs.
#include "kernels.h"
#include "qblocks.h"

#include <algorithm>
#include <cstring>

namespace kvpool {
namespace qblocks {

namespace {

constexpr int CHUNK = 16;  // blocks per main chunk (one per lane)

// The block and element of vector v's int16 lane k in a chunk of c blocks (layout above).
inline void lane_source(int c, int v, int k, int& block, int& element) {
  const int pairs = 16 / c, l = k / 2;
  block = l / pairs;
  element = 2 * (v * pairs + l % pairs) + k % 2;
}

template <typename F>
void for_chunks(int64_t nb, F&& f) {  // f(first block, blocks) over a row's chunks in order
  int64_t b = 0;
  for (; b + CHUNK <= nb; b += CHUNK) f(b, CHUNK);
  for (; b + 2 <= nb; b += 2) f(b, 2);
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

struct GemvAct {  // the activations of M rows, regrouped like the weights
  std::vector<int16_t> q;   // [M, K], chunk by chunk, vector by vector
  std::vector<float> d, s;  // [M, chunks, 16]: per lane, its block's scale (s: on one lane)
  int64_t chunks;
};

GemvAct regroup(const QAct& a, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  int64_t chunks = 0;
  for_chunks(nb, [&](int64_t, int) { ++chunks; });
  GemvAct g{std::vector<int16_t>(M * K), std::vector<float>(M * chunks * 16, 0.f),
            std::vector<float>(M * chunks * 16, 0.f), chunks};
  for (int64_t m = 0; m < M; ++m) {
    int64_t ci = 0;
    for_chunks(nb, [&](int64_t b0, int c) {
      // element pairs move as one int32: pair p of block b goes to vector p / L, lane
      // b * L + p % L (the layout above, L = 16 / c pairs per block)
      int32_t* dst = reinterpret_cast<int32_t*>(g.q.data() + m * K + b0 * QK);
      const int32_t* src = reinterpret_cast<const int32_t*>(a.q.data() + m * K + b0 * QK);
      const int pairs = 16 / c;
      for (int b = 0; b < c; ++b)
        for (int p = 0; p < 16; ++p) dst[(p / pairs) * 16 + b * pairs + p % pairs] = src[b * 16 + p];
      float* d = g.d.data() + (m * chunks + ci) * 16;
      float* s = g.s.data() + (m * chunks + ci) * 16;
      const int lanes = 16 / c;  // int32 lanes per block
      for (int l = 0; l < 16; ++l) {
        d[l] = a.d[m * nb + b0 + l / lanes];
        if (l % lanes == 0) s[l] = a.s[m * nb + b0 + l / lanes];
      }
      ++ci;
    });
  }
  return g;
}

// A chunk's block scales over the 16 lanes: one per lane (C = 16) or each on 8 lanes (C = 2).
template <int C>
inline __m512 chunk_scales(const float* p) {
  if constexpr (C == CHUNK) {
    return _mm512_loadu_ps(p);
  } else {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(
        idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)))));
  }
}
template <int C>
inline __m512 chunk_scales(const uint16_t* p) {
  if constexpr (C == CHUNK) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    int32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(bits))));
  }
}

// How far ahead of the current read the weights are prefetched: the step's arithmetic keeps
// the core's load queue from running far enough ahead on its own (measured at 1 row: ~1.3x
// over none). At one or two rows the weights stream from memory at the rate the core reads
// them, and 4 KB ahead beat 1 KB (in-process A/Bs on a Zen 4 with weights far beyond L3, two
// threads: 1.03-1.18x at one row, 1.04x at two; one thread, one row: 1.12x); from three rows on
// the arithmetic sets the pace and the distance hardly matters (1.02-1.05x, kept at 1 KB).
template <int MT>
constexpr int64_t PREFETCH = MT <= 2 ? 4096 : 1024;

// NT weight rows x MT activation rows over one chunk of C blocks starting at block b0.
// Activation rows m0 .. m0 + MT - 1.
template <bool Q4, typename S, int NT, int MT, int C>
inline void chunk(const QWeights& w, const uint8_t* pk, const GemvAct& x, int64_t n0, int64_t m0,
                  int64_t b0, int64_t ci, __m512 (&acc)[NT][MT]) {
  const int64_t K = w.K, rowb = Q4 ? K / 2 : K;
  __m512i s0[NT][MT], s1[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) s0[i][j] = s1[i][j] = _mm512_setzero_si512();
  const int16_t* xc = x.q.data() + m0 * K + b0 * QK;
  const int64_t wc = b0 * (Q4 ? QK / 2 : QK);  // the chunk's first byte in a packed row
#pragma GCC unroll 8
  for (int u = 0; u < C / 2; ++u) {  // vectors 2u and 2u + 1
    __m512i x0[MT], x1[MT];
    for (int j = 0; j < MT; ++j) {
      x0[j] = _mm512_loadu_si512(xc + j * K + (2 * u) * 32);
      x1[j] = _mm512_loadu_si512(xc + j * K + (2 * u + 1) * 32);
    }
    for (int i = 0; i < NT; ++i) {
      const uint8_t* p = pk + (n0 + i) * rowb + wc + u * (Q4 ? 32 : 64);
      __m512i v0, v1;
      if constexpr (Q4) {
        if (u % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH<MT>), _MM_HINT_T0);
        const __m512i bytes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        v0 = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
        v1 = _mm512_srli_epi16(bytes, 4);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH<MT>), _MM_HINT_T0);
        v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      }
      for (int j = 0; j < MT; ++j) {
        s0[i][j] = dot_pairs(s0[i][j], v0, x0[j]);
        s1[i][j] = dot_pairs(s1[i][j], v1, x1[j]);
      }
    }
  }
  __m512 xd[MT], xs[MT];
  for (int j = 0; j < MT; ++j) {
    xd[j] = _mm512_loadu_ps(x.d.data() + ((m0 + j) * x.chunks + ci) * 16);
    if constexpr (Q4) xs[j] = _mm512_loadu_ps(x.s.data() + ((m0 + j) * x.chunks + ci) * 16);
  }
  for (int i = 0; i < NT; ++i) {
    const int64_t at = (n0 + i) * w.nb + b0;
    const __m512 wd = chunk_scales<C>(scales<S>(w.d, at));
    for (int j = 0; j < MT; ++j)
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[i][j], s1[i][j])),
                                  _mm512_mul_ps(wd, xd[j]), acc[i][j]);
    if constexpr (Q4) {
      const __m512 wm = chunk_scales<C>(scales<S>(w.m, at));
      for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_fmadd_ps(wm, xs[j], acc[i][j]);
    }
  }
}

template <bool Q4, typename S, int NT, int MT>
void tile(const QWeights& w, const uint8_t* pk, const GemvAct& x, int64_t n0, int64_t m0, float* y,
          bool accumulate) {
  __m512 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t b = 0, ci = 0;
  for (; b + CHUNK <= w.nb; b += CHUNK, ++ci)
    chunk<Q4, S, NT, MT, CHUNK>(w, pk, x, n0, m0, b, ci, acc);
  for (; b + 2 <= w.nb; b += 2, ++ci) chunk<Q4, S, NT, MT, 2>(w, pk, x, n0, m0, b, ci, acc);
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) {
      const float v = _mm512_reduce_add_ps(acc[i][j]);
      float* out = y + (m0 + j) * w.N + n0 + i;
      *out = accumulate ? *out + v : v;
    }
}

template <bool Q4, typename S, int MT>
void run_rows(const QWeights& w, const uint8_t* pk, const GemvAct& x, float* y, bool acc) {
  constexpr int NT = MT <= 2 ? 2 : 1;  // two weight rows a tile while registers allow
  const int64_t tiles = (w.N + NT - 1) / NT;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT;
      if (n0 + NT <= w.N) {
        tile<Q4, S, NT, MT>(w, pk, x, n0, 0, y, acc);
      } else {
        for (int64_t n = n0; n < w.N; ++n) tile<Q4, S, 1, MT>(w, pk, x, n, 0, y, acc);
      }
    }
  });
}

// More than GEMV_GROUP rows: each weight row is read from memory once and runs the row groups
// of GEMV_GROUP (and the rest) one after the other while it sits in L1, so every row computes
// exactly as it would in a call of its own group's size.
template <bool Q4, typename S>
void run_groups(const QWeights& w, const uint8_t* pk, const GemvAct& x, int64_t M, float* y,
                bool acc) {
  at::parallel_for(0, w.N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += GEMV_GROUP) {
        switch (std::min<int64_t>(GEMV_GROUP, M - m0)) {
          case 1: tile<Q4, S, 1, 1>(w, pk, x, n, m0, y, acc); break;
          case 2: tile<Q4, S, 1, 2>(w, pk, x, n, m0, y, acc); break;
          case 3: tile<Q4, S, 1, 3>(w, pk, x, n, m0, y, acc); break;
          default: tile<Q4, S, 1, GEMV_GROUP>(w, pk, x, n, m0, y, acc);
        }
      }
  });
}

template <bool Q4, typename S>
void run_kind(const QWeights& w, const uint8_t* pk, const GemvAct& x, int64_t M, float* y,
              bool acc) {
  if (M > GEMV_GROUP) return run_groups<Q4, S>(w, pk, x, M, y, acc);
  switch (M) {
    case 1: return run_rows<Q4, S, 1>(w, pk, x, y, acc);
    case 2: return run_rows<Q4, S, 2>(w, pk, x, y, acc);
    case 3: return run_rows<Q4, S, 3>(w, pk, x, y, acc);
    default: return run_rows<Q4, S, 4>(w, pk, x, y, acc);
  }
}

}  // namespace

bool gemv(const QWeights& w, const uint8_t* packed, const QAct& a, int64_t M, float* y,
          bool acc) {
  if (M < 1 || M > GEMV_ROWS || w.nb % 2) return false;
  const GemvAct x = regroup(a, M, w.K);
  if (w.q4) {
    w.half ? run_kind<true, uint16_t>(w, packed, x, M, y, acc)
           : run_kind<true, float>(w, packed, x, M, y, acc);
  } else {
    w.half ? run_kind<false, uint16_t>(w, packed, x, M, y, acc)
           : run_kind<false, float>(w, packed, x, M, y, acc);
  }
  return true;
}
#else
bool gemv(const QWeights&, const uint8_t*, const QAct&, int64_t, float*, bool) { return false; }
#endif

}  // namespace qblocks

torch::Tensor gemv_pack(torch::Tensor qs, bool q4) {
  using namespace qblocks;
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() &&
                  (qs.scalar_type() == torch::kUInt8 || qs.scalar_type() == torch::kInt8),
              "qs must be a contiguous uint8/int8 [N, K/2 or K] tensor");
  const int64_t N = qs.size(0), K = qs.size(1) * (q4 ? 2 : 1), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  if (!has_avx512() || nb % 2) return torch::empty({0}, qs.options());  // the tiles serve
  auto out = torch::empty_like(qs);
  const uint8_t* src = static_cast<const uint8_t*>(qs.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t rowb = qs.size(1);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* s = src + n * rowb;
      uint8_t* o = dst + n * rowb;
      for_chunks(nb, [&](int64_t b0, int c) {
        for (int v = 0; v < c; ++v)
          for (int k = 0; k < 32; ++k) {
            int block, element;
            lane_source(c, v, k, block, element);
            const int64_t blk = b0 + block;
            if (q4) {
              const uint8_t byte = s[blk * (QK / 2) + element % 16];
              const uint8_t q = element < 16 ? (byte & 0x0F) : (byte >> 4);
              uint8_t& to = o[b0 * (QK / 2) + (v / 2) * 32 + k];
              to = v % 2 ? static_cast<uint8_t>(to | (q << 4)) : q;
            } else {
              o[b0 * QK + v * 32 + k] = s[blk * QK + element];
            }
          }
      });
    }
  });
  return out;
}

}  // namespace kvpool
