// Shared parts of the AMX-BF16 kernels (amx.cpp: linear layers; amx_attention.cpp: prompt
// attention): tile configuration, the split of floats into bfloat16 halves, the packed layout
// and the 32-row block product. KVPOOL_AMX is defined where the build has the tiles.
#pragma once

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVPOOL_AMX 1
#endif

#if defined(KVPOOL_AMX)
namespace kvpool {
namespace amx {

constexpr int64_t TR = 16;  // a tile's rows (activation rows, or weight pairs of K)
constexpr int64_t TK = 32;  // bfloat16 elements of K in one tile product
constexpr int64_t TILE = TR * TK;  // elements of one activation or weight tile

// Whether Linux let this process use the tile registers (asked once: amx.cpp).
bool tiles_permitted();

struct Aligned {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint16_t[], Aligned>;

// The calling thread's scratch `slot` (0-3) of at least n 16-bit elements, kept between calls
// (its contents are not): a fresh allocation of a prompt step's few MB is fresh pages, whose
// faults cost ~as much as the tiles.
inline uint16_t* scratch(int64_t n, int slot) {
  thread_local Buffer bufs[4];
  thread_local int64_t capacities[4] = {};
  Buffer& buf = bufs[slot];
  int64_t& capacity = capacities[slot];
  if (n > capacity) {
    const size_t bytes = ((n * 2 + 63) / 64) * 64;
    buf.reset(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf, "amx: out of memory for ", bytes, " bytes of scratch");
    capacity = n;
  }
  return buf.get();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile register 16 rows of 64 bytes: 0-3 sums, 4-5 activations, 6-7 weights. GCC 12's
// _tile_loadconfig declares an 8-byte operand, so the optimizer may drop the stores filling the
// rest of the 64-byte configuration: the whole struct is the asm's operand instead.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = TR;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// bfloat16 bits of v rounded to nearest even (no NaN in activations or weights here).
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd),
                           16);
}

// 16 floats split into bfloat16 hi and lo (v ~ hi + lo), as int32 lanes holding 16 bits each.
inline void split(__m512 v, __m512i* hi, __m512i* lo) {
  *hi = bf16_bits(v);
  const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(*hi, 16));
  *lo = bf16_bits(_mm512_sub_ps(v, hv));
}

inline void store16(uint16_t* dst, __m512i lanes) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(lanes));
}

// y[m0 + r, n0 + 16 t + c] = sums (+ y where accumulating) (+ bias), for the rows below M.
inline void write_tile(const float* sums, float* y, int64_t ldy, int64_t rows, const float* bias,
                       bool accumulate) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(sums + r * 16);
    if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(y + r * ldy), v);
    if (bias) v = _mm512_add_ps(v, b);
    _mm512_storeu_ps(y + r * ldy, v);
  }
}

// The sums (tiles 0-3) += the activation tiles (4, 5) times the weight tiles at w0 (and w1).
template <int NT>
inline void products(const uint16_t* w0, const uint16_t* w1) {
  _tile_loadd(6, w0, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  if constexpr (NT == 2) {
    _tile_loadd(7, w1, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// One 32-row x (NT * 16)-column block of y over all of K: tiles 0-3 the sums (2 x NT), 4-5 the
// two 16-row halves of the activations, 6-7 the weights.
// Activation rows lie ldx elements apart (K where not given). DIRECT: the sums are stored as
// they are into y, all 32 rows (a scratch of scores), with no bias or accumulation.
template <int NT, bool DIRECT = false>
inline void block(const uint16_t* xh, const uint16_t* xl, int64_t K, const uint16_t* w, int64_t n_tile,
           float* y, int64_t ldy, int64_t m0, int64_t M, int64_t n0, const float* bias,
           bool accumulate, int64_t ldx = 0, int64_t wchunks = 0) {
  if (ldx == 0) ldx = K;
  const int64_t chunks = K / TK, stride_x = ldx * 2;
  // elements between weight tiles of N (the packed matrix may hold more of K than is summed)
  const int64_t tile_stride = (wchunks ? wchunks : chunks) * 2 * TILE;
  const uint16_t* w0 = w + n_tile * tile_stride;
  const uint16_t* w1 = w0 + tile_stride;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* ah = xh + m0 * ldx;
  const uint16_t* al = xl + m0 * ldx;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t kx = c * TK, kw = c * 2 * TILE;
    _tile_loadd(4, ah + kx, stride_x);
    _tile_loadd(5, ah + TR * ldx + kx, stride_x);
    products<NT>(w0 + kw, w1 + kw);                // hi . hi
    products<NT>(w0 + kw + TILE, w1 + kw + TILE);  // hi . lo
    _tile_loadd(4, al + kx, stride_x);
    _tile_loadd(5, al + TR * ldx + kx, stride_x);
    products<NT>(w0 + kw, w1 + kw);  // lo . hi
  }
  if constexpr (DIRECT) {
    float* y0 = y + m0 * ldy + n0;
    _tile_stored(0, y0, ldy * 4);
    _tile_stored(1, y0 + TR * ldy, ldy * 4);
    if constexpr (NT == 2) {
      _tile_stored(2, y0 + 16, ldy * 4);
      _tile_stored(3, y0 + TR * ldy + 16, ldy * 4);
    }
    return;
  }
  alignas(64) float sums[TR * 16];
  const int64_t rows0 = std::min<int64_t>(TR, M - m0), rows1 = std::min<int64_t>(TR, M - m0 - TR);
  const float* b0 = bias ? bias + n0 : nullptr;
  const float* b1 = bias ? bias + n0 + 16 : nullptr;
  float* y0 = y + m0 * ldy + n0;
  _tile_stored(0, sums, 64);
  write_tile(sums, y0, ldy, rows0, b0, accumulate);
  if constexpr (NT == 2) {
    _tile_stored(2, sums, 64);
    write_tile(sums, y0 + 16, ldy, rows0, b1, accumulate);
  }
  if (rows1 > 0) {
    _tile_stored(1, sums, 64);
    write_tile(sums, y0 + TR * ldy, ldy, rows1, b0, accumulate);
    if constexpr (NT == 2) {
      _tile_stored(3, sums, 64);
      write_tile(sums, y0 + TR * ldy + 16, ldy, rows1, b1, accumulate);
    }
  }
}

// Scalar bfloat16 rounding, to the bit as bf16_bits.
inline uint16_t bf16_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline float float_of(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// A logical [N, Kd] matrix, get(n, k), packed as amx_pack packs weights (N % 16 == 0, Kd % 32
// == 0; get gives zeros past the source).
template <class Get>
inline void pack_tiles(int64_t N, int64_t Kd, Get get, uint16_t* dst) {
  const int64_t chunks = Kd / TK;
  for (int64_t j = 0; j < N / 16; ++j) {
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* hi = dst + (j * chunks + c) * 2 * TILE;
      uint16_t* lo = hi + TILE;
      for (int64_t n = 0; n < 16; ++n) {
        for (int64_t kk = 0; kk < TK; ++kk) {
          const float v = get(16 * j + n, TK * c + kk);
          const uint16_t h = bf16_of(v);
          const int64_t at = (kk / 2) * 32 + 2 * n + (kk % 2);
          hi[at] = h;
          lo[at] = bf16_of(v - float_of(h));
        }
      }
    }
  }
}

}  // namespace amx
}  // namespace kvpool
#endif
