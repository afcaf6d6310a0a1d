// Linear layers over block-quantized weights: y[M, N] (+)= x[M, K] . W[N, K]^T.
//
// Weights are kept in 32-element blocks along K, as GGUF files hold them:
//   q4: per block a float scale d and offset m, 16 bytes of nibbles (byte j: element j in the
//       low nibble, element j + 16 in the high one); w = d * q + m (GGUF's Q4_1).
//   q8: per block a float scale d and 32 signed bytes; w = d * q (GGUF's Q8_0).
// Activations are quantized per 32-block to int16 (scale dx = max|x| / 32767) once per call,
// so each block's dot product is integer arithmetic (AVX2: the weights widened to int16, two
// vpmaddwd), scaled once:
//   q4: d * dx * sum(q * qx) + m * dx * sum(qx)        q8: d * dx * sum(q * qx)
// 16-bit activations (not llama.cpp's 8) keep the result within ~1e-5 of float32 arithmetic
// on the same weights: a GGUF's blocks give the float32 model's logits, not a noisier model's
// (8-bit activations flipped this model's greedy answers where two tokens were within 0.1 of
// each other), and cost the same number of multiplies (vpmaddubsw + vpmaddwd before).
// Decode is bound by the bytes of the weights each step streams; these read 0.75 (q4) and
// 1.125 (q8) bytes per weight instead of float32's 4.
// Where the compiler targets AVX-512 (BW, and VNNI where present), a wider path runs the same
// integer arithmetic with twice the lanes (tile512_*; `wide=False` forces the AVX2 path, which
// tests compare it with); its sums differ from the AVX2 path's only by float rounding order.
// From LANES_FROM rows on (a decode batch), the AVX-512 path turns the tile around: lanes are
// 16 activation rows, so a block's float scaling is paid once per 16 rows (lanes.cpp).
// Up to GEMV_ROWS rows (kernels.h), a caller that passes the weights repacked by gemv_pack runs
// gemv.cpp instead, where a chunk of 16 blocks is scaled once per row.
#include "kernels.h"
#include "qblocks.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kvpool::qblocks;

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block widened to int16, elements 0-15 in lo and 16-31 in hi.
// One widening of the 16 bytes: each int16 lane holds a whole byte, whose low nibble is one
// element and whose high nibble (the lane shifted right by 4) is the element 16 further.
inline void q4_block(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i bytes =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
  hi = _mm256_srli_epi16(bytes, 4);
}

inline void q8_block(const uint8_t* p, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float v = hsum(acc);
  for (; i < n; ++i) v += a[i] * b[i];
  return v;
}

// sum(m[i] * s[i]): the q4 offset term of one weight row against one activation row
inline float dot_scales(const float* m, const float* s, int64_t n) { return dot_f32(m, s, n); }
inline float dot_scales(const uint16_t* m, const float* s, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i))),
        _mm256_loadu_ps(s + i), acc);
  float v = hsum(acc);
  for (; i < n; ++i) v += to_f32(m[i]) * s[i];
  return v;
}

// NT weight rows x MT activation rows: NT * MT accumulators of 8 lanes. Pairs of int16
// products sum into int32 (vpmaddwd): |q| <= 127 and |qx| <= 32767, so nothing overflows.
template <bool Q4, typename S, int NT, int MT>
void tile(const QWeights& w, const QAct& a, int64_t n0, int64_t m0, float* y, int64_t ldy,
          bool accumulate) {
  __m256 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K = w.K, nb = w.nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xlo[MT], xhi[MT];
    float xd[MT];
    for (int j = 0; j < MT; ++j) {
      const int16_t* xq = a.q.data() + (m0 + j) * K + b * QK;
      xlo[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      xhi[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
      xd[j] = a.d[(m0 + j) * nb + b];
    }
    for (int i = 0; i < NT; ++i) {
      const int64_t n = n0 + i;
      const float wd = to_f32(*scales<S>(w.d, n * nb + b));
      __m256i wlo, whi;
      if constexpr (Q4) {
        q4_block(w.qs + n * (K / 2) + b * (QK / 2), wlo, whi);
      } else {
        q8_block(w.qs + n * K + b * QK, wlo, whi);
      }
      for (int j = 0; j < MT; ++j) {
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wlo, xlo[j]),
                                           _mm256_madd_epi16(whi, xhi[j]));
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd * xd[j]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NT; ++i) {
    const int64_t n = n0 + i;
    for (int j = 0; j < MT; ++j) {
      float v = hsum(acc[i][j]);
      if constexpr (Q4) v += dot_scales(scales<S>(w.m, n * nb), a.s.data() + (m0 + j) * nb, nb);
      float* out = y + (m0 + j) * ldy + n;
      *out = accumulate ? *out + v : v;
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVPOOL_QGEMM_AVX512 1
// AVX-512 (Zen 4, Ice Lake and later): a zmm holds a whole 32-element block of int16 (q8), or
// the same half of two q4 blocks, so a step covers twice the weights of the AVX2 path; with
// VNNI the two products of a lane pair accumulate in one instruction (vpdpwssd).
inline __m512i pair_dot(__m512i a0, __m512i b0, __m512i a1, __m512i b1) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(a0, b0), a1, b1);
#else
  return _mm512_add_epi32(_mm512_madd_epi16(a0, b0), _mm512_madd_epi16(a1, b1));
#endif
}

// Two adjacent float scales (blocks b and b + 1) spread over lanes 0-7 and 8-15.
inline __m512 spread_two(__m128 v) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}
inline __m512 two_scales(const float* p) {
  return spread_two(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))));
}
inline __m512 two_scales(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return spread_two(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

template <int NT, int MT>
inline void zero_all(__m512 (&acc)[NT][MT]) {
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
}

template <typename S, int NT, int MT>
void finish512(const QWeights& w, const QAct& a, __m512 (&acc)[NT][MT], int64_t n0, int64_t m0,
               float* y, int64_t ldy, bool accumulate) {
  for (int i = 0; i < NT; ++i) {
    const int64_t n = n0 + i;
    for (int j = 0; j < MT; ++j) {
      float v = _mm512_reduce_add_ps(acc[i][j]);
      if (w.q4) v += dot_scales(scales<S>(w.m, n * w.nb), a.s.data() + (m0 + j) * w.nb, w.nb);
      float* out = y + (m0 + j) * ldy + n;
      *out = accumulate ? *out + v : v;
    }
  }
}

// q4: blocks b and b + 1 at once. Their 32 nibble bytes widen to one zmm of int16 (lanes 0-15:
// block b's bytes, 16-31: block b + 1's); the low nibbles are elements 0-15 of each block, the
// high ones 16-31, so the activations are regrouped the same way (two 128-bit-lane shuffles).
template <typename S, int NT, int MT>
void tile512_q4(const QWeights& w, const QAct& a, int64_t n0, int64_t m0, float* y, int64_t ldy,
                bool accumulate) {
  __m512 acc[NT][MT];
  zero_all(acc);
  const int64_t K = w.K, nb = w.nb;
  const __m512i low = _mm512_set1_epi16(0x0F);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i xlo[MT], xhi[MT];
    __m512 xd[MT];
    for (int j = 0; j < MT; ++j) {
      const int16_t* xq = a.q.data() + (m0 + j) * K + b * QK;
      const __m512i z0 = _mm512_loadu_si512(xq), z1 = _mm512_loadu_si512(xq + QK);
      xlo[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(1, 0, 1, 0));
      xhi[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(3, 2, 3, 2));
      xd[j] = two_scales(a.d.data() + (m0 + j) * nb + b);
    }
    for (int i = 0; i < NT; ++i) {
      const int64_t n = n0 + i;
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * (K / 2) + b * (QK / 2))));
      const __m512i wlo = _mm512_and_si512(bytes, low), whi = _mm512_srli_epi16(bytes, 4);
      const __m512 wd = two_scales(scales<S>(w.d, n * nb + b));
      for (int j = 0; j < MT; ++j) {
        const __m512i p = pair_dot(wlo, xlo[j], whi, xhi[j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd, xd[j]), acc[i][j]);
      }
    }
  }
  if (b < nb) {  // an odd last block: its 16 bytes in the low half, zeros above
    __m512i xlo[MT], xhi[MT];
    for (int j = 0; j < MT; ++j) {
      const int16_t* xq = a.q.data() + (m0 + j) * K + b * QK;
      xlo[j] = _mm512_maskz_loadu_epi16(0xFFFF, xq);
      xhi[j] = _mm512_maskz_loadu_epi16(0xFFFF, xq + 16);
    }
    for (int i = 0; i < NT; ++i) {
      const int64_t n = n0 + i;
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (K / 2) + b * (QK / 2)))));
      const __m512i wlo = _mm512_and_si512(bytes, low), whi = _mm512_srli_epi16(bytes, 4);
      for (int j = 0; j < MT; ++j) {
        const __m512i p = pair_dot(wlo, xlo[j], whi, xhi[j]);
        const float s = to_f32(*scales<S>(w.d, n * nb + b)) * a.d[(m0 + j) * nb + b];
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(s), acc[i][j]);
      }
    }
  }
  finish512<S, NT, MT>(w, a, acc, n0, m0, y, ldy, accumulate);
}

// q8: one block per zmm, weights and activations in their natural order.
template <typename S, int NT, int MT>
void tile512_q8(const QWeights& w, const QAct& a, int64_t n0, int64_t m0, float* y, int64_t ldy,
                bool accumulate) {
  __m512 acc[NT][MT];
  zero_all(acc);
  const int64_t K = w.K, nb = w.nb;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i x[MT];
    __m512 xd[MT];
    for (int j = 0; j < MT; ++j) {
      x[j] = _mm512_loadu_si512(a.q.data() + (m0 + j) * K + b * QK);
      xd[j] = _mm512_set1_ps(a.d[(m0 + j) * nb + b]);
    }
    for (int i = 0; i < NT; ++i) {
      const int64_t n = n0 + i;
      const __m512i wv = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * K + b * QK)));
      const __m512 wd = _mm512_set1_ps(to_f32(*scales<S>(w.d, n * nb + b)));
      for (int j = 0; j < MT; ++j) {
#if defined(__AVX512VNNI__)
        const __m512i p = _mm512_dpwssd_epi32(zero, wv, x[j]);
#else
        const __m512i p = _mm512_madd_epi16(wv, x[j]);
#endif
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd, xd[j]), acc[i][j]);
      }
    }
  }
  (void)zero;
  finish512<S, NT, MT>(w, a, acc, n0, m0, y, ldy, accumulate);
}

template <bool Q4, typename S, int NT, int MT>
void tile512(const QWeights& w, const QAct& a, int64_t n0, int64_t m0, float* y, int64_t ldy,
             bool accumulate) {
  if constexpr (Q4) {
    tile512_q4<S, NT, MT>(w, a, n0, m0, y, ldy, accumulate);
  } else {
    tile512_q8<S, NT, MT>(w, a, n0, m0, y, ldy, accumulate);
  }
}
#endif

// Portable reference of one output (machines without AVX2; tests compare the two paths).
float dot_scalar(const QWeights& w, const QAct& a, int64_t n, int64_t m) {
  float v = 0.f;
  for (int64_t b = 0; b < w.nb; ++b) {
    const int16_t* xq = a.q.data() + m * w.K + b * QK;
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      int32_t q;
      if (w.q4) {
        const uint8_t byte = w.qs[n * (w.K / 2) + b * (QK / 2) + (i % 16)];
        q = i < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        q = static_cast<int8_t>(w.qs[n * w.K + b * QK + i]);
      }
      sum += q * xq[i];
    }
    const int64_t at = n * w.nb + b;
    const float wd = w.half ? to_f32(*scales<uint16_t>(w.d, at)) : *scales<float>(w.d, at);
    v += wd * a.d[m * w.nb + b] * static_cast<float>(sum);
    if (w.q4) {
      const float wm = w.half ? to_f32(*scales<uint16_t>(w.m, at)) : *scales<float>(w.m, at);
      v += wm * a.s[m * w.nb + b];
    }
  }
  return v;
}

template <bool Q4, typename S, int NT>
void rows_avx2(const QWeights& w, const QAct& a, int64_t n0, int64_t M, float* y, int64_t ldy,
               bool acc, bool wide) {
#if defined(KVPOOL_QGEMM_AVX512)
  if (wide) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile512<Q4, S, NT, 4>(w, a, n0, m, y, ldy, acc);
    for (; m + 2 <= M; m += 2) tile512<Q4, S, NT, 2>(w, a, n0, m, y, ldy, acc);
    for (; m < M; ++m) tile512<Q4, S, NT, 1>(w, a, n0, m, y, ldy, acc);
    return;
  }
#endif
  (void)wide;
#if defined(__AVX2__) && defined(__FMA__)
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<Q4, S, NT, 4>(w, a, n0, m, y, ldy, acc);
  for (; m + 2 <= M; m += 2) tile<Q4, S, NT, 2>(w, a, n0, m, y, ldy, acc);
  for (; m < M; ++m) tile<Q4, S, NT, 1>(w, a, n0, m, y, ldy, acc);
#endif
}

// The rows' kernel for the weights' kind (q4 / q8) and scale type (float32 / float16).
template <int NT>
void rows(const QWeights& w, const QAct& a, int64_t n0, int64_t M, float* y, bool acc,
          bool wide) {
  if (w.q4) {
    w.half ? rows_avx2<true, uint16_t, NT>(w, a, n0, M, y, w.N, acc, wide)
           : rows_avx2<true, float, NT>(w, a, n0, M, y, w.N, acc, wide);
  } else {
    w.half ? rows_avx2<false, uint16_t, NT>(w, a, n0, M, y, w.N, acc, wide)
           : rows_avx2<false, float, NT>(w, a, n0, M, y, w.N, acc, wide);
  }
}

void run(const QWeights& w, const QAct& a, int64_t M, float* y, bool acc, bool portable,
         bool wide) {
  // Threads split the weight rows: each row is read from memory once per call.
  const int64_t step = 4;
  const int64_t tiles = (w.N + step - 1) / step;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * step, nt = std::min(step, w.N - n0);
#if defined(__AVX2__) && defined(__FMA__)
      if (!portable) {
        if (nt == 4) {
          rows<4>(w, a, n0, M, y, acc, wide);
        } else {
          for (int64_t n = n0; n < n0 + nt; ++n) rows<1>(w, a, n, M, y, acc, wide);
        }
        continue;
      }
#endif
      for (int64_t n = n0; n < n0 + nt; ++n)
        for (int64_t m = 0; m < M; ++m) {
          const float v = dot_scalar(w, a, n, m);
          y[m * w.N + n] = acc ? y[m * w.N + n] + v : v;
        }
    }
  });
}

}  // namespace

namespace kvpool {

// y = x . W^T (+ out when given: the residual add of a layer, fused).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                      c10::optional<torch::Tensor> out, bool portable, bool wide,
                      int64_t lanes_from, c10::optional<torch::Tensor> packed, bool act8) {
  const QWeights w = check(x, qs, d, m);
  const int64_t M = x.size(0);
  torch::Tensor y;
  const bool acc = out.has_value();
  if (acc) {
    y = *out;
    TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 &&
                    y.size(0) == M && y.size(1) == w.N,
                "out must be a contiguous float32 [M, N] tensor");
  } else {
    y = torch::empty({M, w.N}, x.options());
  }
  if (M == 0) return y;
#if defined(KVPOOL_QGEMM_AVX512)
  if (wide && !portable && lanes_from > 0 && M >= lanes_from) {  // quantizes x itself
    lanes(w, x.data_ptr<float>(), x.stride(0), M, y.data_ptr<float>(), acc, act8);
    return y;
  }
#endif
  const QAct a = quantize_rows(x.data_ptr<float>(), M, w.K, x.stride(0));
  if (packed.has_value() && packed->defined() && packed->numel() > 0 && wide && !portable &&
      !(lanes_from > 0 && M >= lanes_from)) {
    TORCH_CHECK(packed->sizes() == qs.sizes() && packed->scalar_type() == qs.scalar_type() &&
                    packed->is_contiguous(),
                "packed must be gemv_pack(qs): the same shape and type as qs");
    if (gemv(w, static_cast<const uint8_t*>(packed->data_ptr()), a, M, y.data_ptr<float>(), acc))
      return y;
  }
  run(w, a, M, y.data_ptr<float>(), acc, portable, wide);
  return y;
}

bool has_avx512() {
#if defined(KVPOOL_QGEMM_AVX512)
  return true;
#else
  return false;
#endif
}

bool has_avx2() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

}  // namespace kvpool
