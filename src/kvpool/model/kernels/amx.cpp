// Dense linear layers on Intel's tile unit (AMX-BF16), for steps with prompt tokens.
//
// One AMX instruction multiplies a 16 x 32 tile of bfloat16 activations by a 32 x 16 tile of
// bfloat16 weights into 16 x 16 float32 sums (8,192 products): on the CPUs that have it, ~7x the
// products of float32 AVX-512 per cycle. bfloat16 alone keeps 8 bits of each number, not the 24
// of float32, so each operand is split in two, v = hi + lo (hi = v rounded to bfloat16, lo =
// the rest rounded again: 16 bits together), and three products are summed, hi.hi + lo.hi +
// hi.lo (lo.lo, ~2^-16 of the rest, is left out): results within ~1e-5 of float32 arithmetic,
// as the block kernel's 16-bit activations are, at ~2.5x float32 BLAS's speed (three products).
//
// Each output row is summed over K in one fixed order whatever the number of rows, the rows
// beside it or the threads, so a prompt's KV does not depend on how the scheduler cut it into
// chunks (linear.py). Weights are packed once (amx_pack) in the tiles' own layout.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVPOOL_AMX 1
#endif

namespace kvpool {

#if defined(KVPOOL_AMX)
namespace {

constexpr int64_t TR = 16;  // a tile's rows (activation rows, or weight pairs of K)
constexpr int64_t TK = 32;  // bfloat16 elements of K in one tile product
constexpr int64_t TILE = TR * TK;  // elements of one activation or weight tile

// Linux hands a process the tile registers' state only once asked (arch_prctl).
bool tiles_permitted() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  });
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile register 16 rows of 64 bytes: 0-3 sums, 4-5 activations, 6-7 weights. GCC 12's
// _tile_loadconfig declares an 8-byte operand, so the optimizer may drop the stores filling the
// rest of the 64-byte configuration: the whole struct is the asm's operand instead.
void configure_tiles() {
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

struct Aligned {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint16_t[], Aligned>;

// The calling thread's scratch of at least n 16-bit elements, kept between calls: a fresh
// allocation of a prompt step's few MB is fresh pages, whose faults cost ~as much as the tiles.
uint16_t* scratch(int64_t n) {
  thread_local Buffer buf;
  thread_local int64_t capacity = 0;
  if (n > capacity) {
    const size_t bytes = ((n * 2 + 63) / 64) * 64;
    buf.reset(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf, "amx_linear: out of memory for ", bytes, " bytes of activations");
    capacity = n;
  }
  return buf.get();
}

// The activations' hi and lo halves, [Mpad, K] each (rows past M zero), one parallel pass.
void split_rows(const float* x, int64_t lda, int64_t M, int64_t Mpad, int64_t K, uint16_t* hi,
                uint16_t* lo) {
  at::parallel_for(0, Mpad, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      uint16_t* h = hi + m * K;
      uint16_t* l = lo + m * K;
      if (m >= M) {
        std::memset(h, 0, K * 2);
        std::memset(l, 0, K * 2);
        continue;
      }
      for (int64_t k = 0; k < K; k += 16) {
        __m512i vh, vl;
        split(_mm512_loadu_ps(x + m * lda + k), &vh, &vl);
        store16(h + k, vh);
        store16(l + k, vl);
      }
    }
  });
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
void block(const uint16_t* xh, const uint16_t* xl, int64_t K, const uint16_t* w, int64_t n_tile,
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
void pack_tiles(int64_t N, int64_t Kd, Get get, uint16_t* dst) {
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

std::vector<uint16_t> halves(int64_t n) { return std::vector<uint16_t>(n); }

// e^x of 16 lanes (x <= 0 here: shifted scores), to ~1 ulp: e^x = 2^n e^f, n = round(x / ln 2),
// e^f by a degree-7 polynomial on |f| <= ln 2 / 2 (Cephes' expf coefficients).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first(int64_t count) {  // lanes below count (of 16)
  return count >= 16 ? 0xffff : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// A row of softmax weights from `valid` scores (the rest of the span's zero), unnormalized, as
// bfloat16 halves; returns 1 / their sum. Always the same lanes and order for a row's keys.
float softmax_row(const float* sr, int64_t valid, int64_t span, float scale, uint16_t* hi,
                  uint16_t* lo) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < valid; j += 16) {
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, first(valid - j), sr + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sc = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < span; j += 16) {
    const __mmask16 lanes = first(valid - j);
    __m512 e = _mm512_setzero_ps();
    if (lanes) {
      const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sr + j), m), sc);
      e = _mm512_maskz_mov_ps(lanes, exp16(x));
      sum = _mm512_add_ps(sum, e);
    }
    __m512i eh, el;
    split(e, &eh, &el);
    store16(hi + j, eh);
    store16(lo + j, el);
  }
  return valid ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
}

}  // namespace
#endif

bool has_amx() {
#if defined(KVPOOL_AMX)
  return tiles_permitted();
#else
  return false;
#endif
}

torch::Tensor amx_pack(torch::Tensor w) {
  TORCH_CHECK(has_amx(), "amx_pack: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32,
              "amx_pack: w must be a float32 [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "amx_pack: N must be a multiple of 16 and K of 32, got ",
              N, " x ", K);
  auto wc = w.contiguous();
  // [N / 16][K / 32][hi, lo][16 pairs of K][16 columns x 2]: tile (j, c) of each half is the
  // 32 x 16 block w[16 j .. 16 j + 16, 32 c .. 32 c + 32]^T, K's pairs interleaved per column
  auto packed = torch::empty({N / 16, K / 32, 2, 16, 32}, torch::kInt16);
#if defined(KVPOOL_AMX)
  const float* src = wc.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  const int64_t chunks = K / 32;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t c = 0; c < chunks; ++c) {
        uint16_t* hi = dst + ((j * chunks + c) * 2) * 512;
        uint16_t* lo = hi + 512;
        for (int64_t n = 0; n < 16; ++n) {
          const float* row = src + (16 * j + n) * K + 32 * c;
          for (int64_t half = 0; half < 2; ++half) {
            __m512i vh, vl;
            split(_mm512_loadu_ps(row + 16 * half), &vh, &vl);
            alignas(64) int32_t h[16], l[16];
            _mm512_store_si512(h, vh);
            _mm512_store_si512(l, vl);
            for (int64_t e = 0; e < 16; ++e) {
              const int64_t k = 16 * half + e;  // element k of the chunk: pair k / 2, slot k % 2
              hi[(k / 2) * 32 + 2 * n + (k % 2)] = static_cast<uint16_t>(h[e]);
              lo[(k / 2) * 32 + 2 * n + (k % 2)] = static_cast<uint16_t>(l[e]);
            }
          }
        }
      }
    }
  });
#endif
  return packed;
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> out,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_amx(), "amx_linear: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kInt16 && packed.size(2) == 2 &&
                  packed.size(3) == 16 && packed.size(4) == 32 && packed.is_contiguous(),
              "amx_linear: packed must come from amx_pack");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) == K &&
                  x.stride(1) == 1,
              "amx_linear: x must be float32 [M, ", K, "] with contiguous rows");
  const int64_t M = x.size(0);
  torch::Tensor y;
  const bool accumulate = out.has_value();
  if (accumulate) {
    y = *out;
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() &&
                    y.scalar_type() == torch::kFloat32,
                "amx_linear: out must be a contiguous float32 [M, N]");
  } else {
    y = torch::empty({M, N}, x.options());
  }
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N,
                "amx_linear: bias must be float32 [N]");
  }
  if (M == 0) return y;
#if defined(KVPOOL_AMX)
  const int64_t Mpad = (M + 31) / 32 * 32, mblocks = Mpad / 32;
  uint16_t* const xh = scratch(2 * Mpad * K);
  uint16_t* const xl = xh + Mpad * K;
  split_rows(x.data_ptr<float>(), x.stride(0), M, Mpad, K, xh, xl);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const int64_t ntiles = N / 16, nblocks = (ntiles + 1) / 2;
  // groups of weight blocks kept in L2 (up to ~1 MB of packed weights, one group a thread at
  // least) while every 32-row block of activations passes over them: the activations are read
  // from farther away once per group
  const int64_t per_block = 32 * K * 4, threads = at::get_num_threads();
  const int64_t budget = std::max<int64_t>(1, (1 << 20) / per_block);  // blocks per group
  const int64_t rounds = (nblocks + threads * budget - 1) / (threads * budget);
  const int64_t group = (nblocks + threads * rounds - 1) / (threads * rounds);
  const int64_t ngroups = (nblocks + group - 1) / group;
  at::parallel_for(0, ngroups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      const int64_t nb_end = std::min(nblocks, (g + 1) * group);
      for (int64_t mb = 0; mb < mblocks; ++mb) {
        for (int64_t nb = g * group; nb < nb_end; ++nb) {
          const int64_t t = 2 * nb;
          if (t + 1 < ntiles) {
            block<2>(xh, xl, K, w, t, yp, N, mb * 32, M, t * 16, bp, accumulate);
          } else {
            block<1>(xh, xl, K, w, t, yp, N, mb * 32, M, t * 16, bp, accumulate);
          }
        }
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace kvpool

namespace kvpool {

torch::Tensor amx_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t start_pos, double scale) {
  TORCH_CHECK(has_amx(), "amx_prefill_attention: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == torch::kFloat32 &&
                  k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "amx_prefill_attention: q [n, Hq, D], k and v [ctx, Hkv, D], all float32");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t ctx = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && k.is_contiguous() && v.is_contiguous(),
              "amx_prefill_attention: k and v must be contiguous [ctx, Hkv, ", D, "]");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "amx_prefill_attention: ", Hq, " query heads over ", Hkv,
              " KV heads");
  TORCH_CHECK(D % 32 == 0 && D <= 256, "amx_prefill_attention: head size must be a multiple of 32 "
              "up to 256, got ", D);
  TORCH_CHECK(start_pos >= 0 && ctx == start_pos + n,
              "amx_prefill_attention: ctx must be start_pos + n (", ctx, " != ", start_pos, " + ",
              n, ")");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D,
              "amx_prefill_attention: q's heads must be contiguous within a row");
  auto out = torch::empty({n, Hq, D}, q.options());
  if (n == 0) return out;
#if defined(KVPOOL_AMX)
  const int64_t G = Hq / Hkv, npad = (n + 31) / 32 * 32, qblocks = npad / 32;
  const int64_t kpad = (ctx + 31) / 32 * 32, ldq = Hq * D;
  // the queries' halves [npad, Hq, D] (rows past n zero), then the keys packed as weights
  // ([ctx, D] a head: score = q . k) and the values transposed ([D, ctx]: out = p . v)
  auto qh = halves(npad * ldq), ql = halves(npad * ldq);
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, npad, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t e = 0; e < ldq; e += 16) {
        __m512i vh = _mm512_setzero_si512(), vl = vh;
        if (i < n) split(_mm512_loadu_ps(qp + i * q.stride(0) + e), &vh, &vl);
        store16(qh.data() + i * ldq + e, vh);
        store16(ql.data() + i * ldq + e, vl);
      }
    }
  });
  const int64_t per_head = kpad * D * 2;
  auto kt = halves(Hkv * per_head), vt = halves(Hkv * per_head);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, 2 * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0) {
        pack_tiles(kpad, D, [&](int64_t j, int64_t d) {
          return j < ctx ? kp[(j * Hkv + h) * D + d] : 0.f;
        }, kt.data() + h * per_head);
      } else {
        pack_tiles(D, kpad, [&](int64_t d, int64_t j) {
          return j < ctx ? vp[(j * Hkv + h) * D + d] : 0.f;
        }, vt.data() + h * per_head);
      }
    }
  });
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one item a (query head, 32 queries): its scores over every key it may see, their
  // softmax (each row in key order), then the values weighted by it; each row alike whatever
  // the rows beside it, so a prompt's chunks give it the same bits
  at::parallel_for(0, Hq * qblocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<float> scores(32 * kpad), inv(32);
    auto ph = halves(32 * kpad), pl = halves(32 * kpad);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / qblocks, i0 = (t % qblocks) * 32, kvh = h / G;
      const int64_t rows = std::min<int64_t>(32, n - i0);
      const int64_t keys = start_pos + i0 + rows, kblocks = (keys + 31) / 32, kspan = kblocks * 32;
      const uint16_t* ah = qh.data() + i0 * ldq + h * D;
      const uint16_t* al = ql.data() + i0 * ldq + h * D;
      for (int64_t b = 0; b < kblocks; ++b) {
        block<2, true>(ah, al, D, kt.data() + kvh * per_head, 2 * b, scores.data(), kpad, 0, rows,
                 32 * b, nullptr, false, ldq);
      }
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t valid = r < rows ? start_pos + i0 + r + 1 : 0;
        inv[r] = softmax_row(scores.data() + r * kpad, valid, kspan, sc, ph.data() + r * kpad,
                             pl.data() + r * kpad);
      }
      float* o = op + i0 * ldq + h * D;
      for (int64_t c = 0; c < D / 32; ++c) {
        block<2>(ph.data(), pl.data(), kspan, vt.data() + kvh * per_head, 2 * c, o, ldq, 0, rows,
                 32 * c, nullptr, false, kpad, kpad / TK);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* orow = o + r * ldq;
        for (int64_t d = 0; d < D; ++d) orow[d] *= inv[r];
      }
    }
    _tile_release();
  });
#endif
  return out;
}

}  // namespace kvpool
