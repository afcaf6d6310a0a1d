// The lanes path of the block kernel (qgemm.cpp runs it from LANES_FROM rows on, and for
// every row of a prompt step): vector lanes are 16 activation rows.
#include "kernels.h"
#include "qblocks.h"

#include <cstring>
#include <memory>
#include <type_traits>

namespace kvpool {
namespace qblocks {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

// Many rows (a decode batch of 16 and more): qgemm.cpp's per-row tiles spend three float
// instructions (convert, scale, add) on every 32-element block of every (weight row, activation
// row) pair beside its two integer ones. Here vector lanes are 16 activation rows instead: a
// broadcast pair of weights multiplies the same pair of elements of 16 rows (one vpdpwssd per 32
// products), a block's scale is applied once per 16 rows, and a weight row is widened to int16
// once per call and reused by every group of rows. Same integer products and scales as the other
// paths; only the float rounding order differs. With 8-bit activations (act8, q4 weights only) a
// broadcast quad of weight nibbles multiplies four signed-byte elements of 16 rows (vpdpbusd: 64
// products an instruction); those products are of another, coarser quantization of x.
struct LaneAct {  // activations quantized (quantize_block) straight into lane order
  // [groups][K / E][16]: E = 2 int16 (16-bit) or 4 int8 (8-bit) elements x[k..k + E) of the
  // group's 16 rows in each int32 lane; rows past M hold zeros
  std::unique_ptr<int32_t[]> x;
  std::unique_ptr<float[]> d, s;  // [groups][nb][16]
  int64_t groups;
};

// Elements a lane's int32 holds: int16 pairs, or int8 quads (8-bit activations).
template <bool A8>
constexpr int64_t UNIT = A8 ? 4 : 2;

// One parallel pass from float rows to lane order: each (group, block) unit quantizes its 16
// rows' blocks and writes them to their lanes, so no [M, K] copy is made, zeroed or regrouped
// on one thread (which, in engine A/Bs, made decode steps of 16-32 rows 3-6 % slower).
template <bool A8>
LaneAct lanes_of(const float* x, int64_t lda, int64_t M, int64_t K) {
  constexpr int64_t E = UNIT<A8>;
  const int64_t groups = (M + 15) / 16, units = K / E, nb = K / QK;
  LaneAct t{std::unique_ptr<int32_t[]>(new int32_t[groups * units * 16]),
            std::unique_ptr<float[]>(new float[groups * nb * 16]),
            std::unique_ptr<float[]>(new float[groups * nb * 16]), groups};
  at::parallel_for(0, groups * nb, 8, [&](int64_t begin, int64_t end) {
    alignas(64) std::conditional_t<A8, int8_t, int16_t> q[QK];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / nb, b = i % nb;
      int32_t* dst = t.x.get() + (g * units + b * (QK / E)) * 16;
      float* dd = t.d.get() + (g * nb + b) * 16;
      float* ds = t.s.get() + (g * nb + b) * 16;
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t m = g * 16 + l;
        if (m < M) {
          quantize_block(x + m * lda + b * QK, q, dd + l, ds + l);
        } else {
          std::memset(q, 0, sizeof(q));
          dd[l] = ds[l] = 0.f;
        }
        for (int64_t u = 0; u < QK / E; ++u) std::memcpy(dst + u * 16 + l, q + E * u, 4);
      }
    }
  });
  return t;
}

// NT weight rows, widened to int16 in element order, into `w16` ([NT][K]).
template <bool Q4>
void widen_rows(const QWeights& w, int64_t n0, int NT, int16_t* w16) {
  const int64_t K = w.K;
  for (int i = 0; i < NT; ++i) {
    const int64_t n = n0 + i;
    for (int64_t b = 0; b < w.nb; ++b) {
      int16_t* dst = w16 + i * K + b * QK;
      if constexpr (Q4) {
        const __m256i bytes = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (K / 2) + b * (QK / 2))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                            _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_srli_epi16(bytes, 4));
      } else {
        _mm512_storeu_si512(dst, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(w.qs + n * K + b * QK))));
      }
    }
  }
}

// NT q4 weight rows as unsigned bytes (0-15) in element order, into `w8` ([NT][K]): the
// 8-bit-activation kernel multiplies them as they are (vpdpbusd: unsigned x signed bytes).
void widen_rows8(const QWeights& w, int64_t n0, int NT, uint8_t* w8) {
  const int64_t K = w.K;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int i = 0; i < NT; ++i) {
    const uint8_t* src = w.qs + (n0 + i) * (K / 2);
    uint8_t* dst = w8 + i * K;
    for (int64_t b = 0; b < w.nb; ++b) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b * (QK / 2)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * QK), _mm_and_si128(bytes, low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * QK + 16),
                       _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    }
  }
}

// The next tile's weight rows (and their scales) into L2 while this tile computes: widening
// a tile was where a decode batch waited for its weights to come from memory (the rows are
// contiguous, but a tile's short read between long stretches of arithmetic left the hardware
// prefetcher behind).
template <bool Q4>
void prefetch_rows(const QWeights& w, int64_t n0, int NT) {
  if (n0 >= w.N) return;
  const int64_t rows = std::min<int64_t>(NT, w.N - n0), width = Q4 ? w.K / 2 : w.K;
  const char* p = reinterpret_cast<const char*>(w.qs + n0 * width);
  for (int64_t off = 0; off < rows * width; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  const int64_t scale_bytes = w.half ? 2 : 4;
  const char* d = static_cast<const char*>(w.d) + n0 * w.nb * scale_bytes;
  for (int64_t off = 0; off < rows * w.nb * scale_bytes; off += 64) _mm_prefetch(d + off, _MM_HINT_T1);
  if constexpr (Q4) {
    const char* m = static_cast<const char*>(w.m) + n0 * w.nb * scale_bytes;
    for (int64_t off = 0; off < rows * w.nb * scale_bytes; off += 64)
      _mm_prefetch(m + off, _MM_HINT_T1);
  }
}

// Where the lanes kernel writes: output (m, n) at p[(m - m0) * ld + n - n0] (a thread's
// buffer for a slice of rows and a block of columns, copied to y once complete).
struct LaneOut {
  float* p;
  int64_t ld, m0, n0;
};

// NT weight rows (widened in wbuf: int16, or unsigned bytes with 8-bit activations) against
// G groups of 16 rows starting at group g0.
template <bool Q4, typename S, int NT, int G, bool A8>
void lanes512(const QWeights& w, const void* wbuf, const LaneAct& t, int64_t n0, int64_t g0,
              int64_t M, const LaneOut& out) {
  constexpr int64_t E = UNIT<A8>;
  const int64_t K = w.K, nb = w.nb, units = K / E;
  __m512 acc[NT][G];
  for (int i = 0; i < NT; ++i)
    for (int g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum[NT][G];
    for (int i = 0; i < NT; ++i)
      for (int g = 0; g < G; ++g) sum[i][g] = _mm512_setzero_si512();
    const int32_t* xb = t.x.get() + (g0 * units + b * (QK / E)) * 16;
    // a unit of E weights is 4 bytes either way: 2 int16 or 4 unsigned bytes
    const char* wb = static_cast<const char*>(wbuf) + b * QK * (A8 ? 1 : 2);
#pragma GCC unroll 16
    for (int p = 0; p < QK / E; ++p) {
      __m512i x[G];
      for (int g = 0; g < G; ++g) {
        x[g] = _mm512_loadu_si512(xb + (g * units + p) * 16);
        asm("" : "+v"(x[g]));  // one load, kept in a register (else folded into every product)
      }
      for (int i = 0; i < NT; ++i) {
        int32_t unit;
        std::memcpy(&unit, wb + i * K * (A8 ? 1 : 2) + 4 * p, sizeof(unit));
        const __m512i wv = _mm512_set1_epi32(unit);
        for (int g = 0; g < G; ++g)
          sum[i][g] = A8 ? dot_quads(sum[i][g], wv, x[g]) : dot_pairs(sum[i][g], x[g], wv);
      }
    }
    __m512 xd[G], xs[G];
    for (int g = 0; g < G; ++g) {
      xd[g] = _mm512_loadu_ps(t.d.get() + ((g0 + g) * nb + b) * 16);
      if constexpr (Q4) xs[g] = _mm512_loadu_ps(t.s.get() + ((g0 + g) * nb + b) * 16);
    }
    for (int i = 0; i < NT; ++i) {
      const __m512 wd = _mm512_set1_ps(to_f32(*scales<S>(w.d, (n0 + i) * nb + b)));
      for (int g = 0; g < G; ++g)
        acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][g]), _mm512_mul_ps(wd, xd[g]),
                                    acc[i][g]);
      if constexpr (Q4) {
        const __m512 wm = _mm512_set1_ps(to_f32(*scales<S>(w.m, (n0 + i) * nb + b)));
        for (int g = 0; g < G; ++g) acc[i][g] = _mm512_fmadd_ps(wm, xs[g], acc[i][g]);
      }
    }
  }
  alignas(64) float v[16];
  for (int i = 0; i < NT; ++i)
    for (int g = 0; g < G; ++g) {
      _mm512_store_ps(v, acc[i][g]);
      const int64_t m0 = (g0 + g) * 16, rows = std::min<int64_t>(16, M - m0);
      float* dst = out.p + (m0 - out.m0) * out.ld + (n0 + i - out.n0);
      for (int64_t l = 0; l < rows; ++l) dst[l * out.ld] = v[l];
    }
}

// NT weight rows against the groups [g0, g1).
template <bool Q4, typename S, int NT, bool A8>
void lanes_rows(const QWeights& w, const LaneAct& t, int16_t* wbuf, int64_t n0, int64_t g0,
                int64_t g1, int64_t M, const LaneOut& out) {
  if constexpr (A8) {
    widen_rows8(w, n0, NT, reinterpret_cast<uint8_t*>(wbuf));
  } else {
    widen_rows<Q4>(w, n0, NT, wbuf);
  }
  prefetch_rows<Q4>(w, n0 + NT, NT);
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) lanes512<Q4, S, NT, 2, A8>(w, wbuf, t, n0, g, M, out);
  if (g < g1) lanes512<Q4, S, NT, 1, A8>(w, wbuf, t, n0, g, M, out);
}

// The lanes kernel for the weights' kind and scale type (as rows<NT> for the per-row tiles);
// 8-bit activations only with q4 weights (A8 is false for q8).
template <int NT, bool A8>
void lanes_tile(const QWeights& w, const LaneAct& t, int16_t* wbuf, int64_t n0, int64_t g0,
                int64_t g1, int64_t M, const LaneOut& out) {
  if (w.q4) {
    w.half ? lanes_rows<true, uint16_t, NT, A8>(w, t, wbuf, n0, g0, g1, M, out)
           : lanes_rows<true, float, NT, A8>(w, t, wbuf, n0, g0, g1, M, out);
  } else if constexpr (!A8) {
    w.half ? lanes_rows<false, uint16_t, NT, false>(w, t, wbuf, n0, g0, g1, M, out)
           : lanes_rows<false, float, NT, false>(w, t, wbuf, n0, g0, g1, M, out);
  }
}

// Groups of 16 rows whose activations (int16) take about LANES_SLICE bytes: a prompt's
// thousands of rows are run a slice at a time, all of a thread's weight rows against each,
// so the slice stays in the core's L2 cache instead of being streamed once per weight tile.
constexpr int64_t LANES_SLICE = 384 * 1024;

int64_t slice_groups(int64_t K, int64_t bytes) {  // bytes per activation element
  return std::max<int64_t>(2, LANES_SLICE / (K * bytes * 16) / 2 * 2);
}

// Tiles whose outputs a thread collects before writing them to y: 16 columns, a cache line
// of each row. Written straight from the kernel, four floats at a time, rows whose stride is a
// multiple of 4 KiB (N = 1,024 or 3,072) all fall in one cache set and evict each other.
constexpr int64_t LANES_BLOCK = 4;

template <bool A8>
void lanes_run(const QWeights& w, const float* x, int64_t lda, int64_t M, float* y, bool acc) {
  // Threads split the weight rows: each row is read from memory once per call.
  const int64_t step = 4;
  const int64_t tiles = (w.N + step - 1) / step;
  const LaneAct t = lanes_of<A8>(x, lda, M, w.K);
  const int64_t slice = slice_groups(w.K, A8 ? 1 : 2), cols = LANES_BLOCK * step;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> w16(step * w.K);
    std::vector<float> buf(slice * 16 * cols);
    for (int64_t g0 = 0; g0 < t.groups; g0 += slice) {
      const int64_t g1 = std::min(t.groups, g0 + slice);
      const int64_t m0 = g0 * 16, m1 = std::min(M, g1 * 16);
      for (int64_t b0 = begin; b0 < end; b0 += LANES_BLOCK) {
        const int64_t c0 = b0 * step, c1 = std::min(w.N, std::min(end, b0 + LANES_BLOCK) * step);
        const LaneOut out{buf.data(), cols, m0, c0};
        for (int64_t n0 = c0; n0 < c1; n0 += step) {
          if (c1 - n0 >= step) {
            lanes_tile<4, A8>(w, t, w16.data(), n0, g0, g1, M, out);
          } else {
            for (int64_t n = n0; n < c1; ++n) lanes_tile<1, A8>(w, t, w16.data(), n, g0, g1, M, out);
          }
        }
        for (int64_t m = m0; m < m1; ++m) {
          const float* src = buf.data() + (m - m0) * cols;
          float* dst = y + m * w.N + c0;
          for (int64_t c = 0; c < c1 - c0; ++c) dst[c] = acc ? dst[c] + src[c] : src[c];
        }
      }
    }
  });
}
}  // namespace

void lanes(const QWeights& w, const float* x, int64_t lda, int64_t M, float* y, bool acc,
           bool act8) {
  if (act8 && w.q4) return lanes_run<true>(w, x, lda, M, y, acc);
  lanes_run<false>(w, x, lda, M, y, acc);
}
#endif

}  // namespace qblocks
}  // namespace kvpool
