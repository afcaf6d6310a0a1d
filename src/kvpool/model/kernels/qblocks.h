// The 32-element weight blocks and quantized activations shared by the quantized kernels
// (qgemm.cpp: any number of rows; gemv.cpp: a few rows over repacked weights).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvpool {
namespace qblocks {

constexpr int64_t QK = 32;  // elements per block

struct QAct {  // quantized activations of M rows
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> d;   // [M, K / QK] scales
  std::vector<float> s;   // [M, K / QK] d * sum(q): the q4 offset term's factor
};

constexpr float QMAX = 32767.f;

// One block on [-qmax, qmax] steps of its absolute maximum / qmax, rounded to nearest even.
template <typename T>
inline void quantize_scalar(const float* x, T* q, float qmax, float* d, float* s) {
  float amax = 0.f;
  for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / qmax, inv = amax > 0.f ? qmax / amax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < QK; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<T>(v);
    sum += v;
  }
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

inline void quantize_block(const float* x, int16_t* q, float* d, float* s) {
  quantize_scalar(x, q, QMAX, d, s);
}

// The same for 8-bit activations (the prompt path's lanes kernel with q4 weights): a block's
// elements on [-127, 127], the scheme llama.cpp's q8 activations use.
inline void quantize_block(const float* x, int8_t* q, float* d, float* s) {
#if defined(__AVX512F__)
  // the scalar loop's arithmetic in two vectors (prompt steps quantize every row of a chunk)
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *d = scale;
  *s = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
#else
  quantize_scalar(x, q, 127.f, d, s);
#endif
}

inline QAct quantize_rows(const float* x, int64_t M, int64_t K, int64_t lda) {
  const int64_t nb = K / QK;
  QAct a{std::vector<int16_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / nb, b = i % nb;
      quantize_block(x + m * lda + b * QK, a.q.data() + m * K + b * QK, &a.d[i], &a.s[i]);
    }
  });
  return a;
}

struct QWeights {
  const uint8_t* qs;  // q4: [N, K / 2]; q8: [N, K] (int8 bytes)
  const void* d;      // [N, nb] float32, or float16 (a GGUF's own scales, as the file holds them)
  const void* m;      // [N, nb] (q4 only), d's type
  int64_t N, K, nb;
  bool q4;
  bool half;  // d and m are float16
};

// A block scale as float: S is float, or uint16_t holding a float16.
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
#if defined(__F16C__)
  return _cvtsh_ss(v);
#else
  return c10::detail::fp16_ieee_to_fp32_value(v);
#endif
}

template <typename S>
inline const S* scales(const void* p, int64_t offset) {
  return static_cast<const S*>(p) + offset;
}

inline QWeights check(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
               const torch::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 &&
                  x.stride(0) >= x.size(1),
              "x must be a float32 [M, K] tensor with contiguous rows");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() &&
                  (qs.scalar_type() == torch::kUInt8 || qs.scalar_type() == torch::kInt8),
              "qs must be a contiguous uint8/int8 [N, K/2 or K] tensor");
  const int64_t N = qs.size(0), nb = K / QK;
  const bool q4 = m.numel() > 0;
  TORCH_CHECK(qs.size(1) == (q4 ? K / 2 : K), "qs has the wrong width for K");
  const bool half = d.scalar_type() == torch::kHalf;
  TORCH_CHECK((half || d.scalar_type() == torch::kFloat) && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == N && d.size(1) == nb,
              "d must be a contiguous float32 or float16 [N, K/32] tensor");
  TORCH_CHECK(!q4 || (m.scalar_type() == d.scalar_type() && m.is_contiguous() &&
                      m.sizes() == d.sizes()),
              "m must be empty (q8) or like d (q4)");
  return QWeights{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr(),
                  q4 ? m.data_ptr() : nullptr, N, K, nb, q4, half};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// acc + the sums of adjacent int16 products of x and w, per int32 lane (vpdpwssd with VNNI)
inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

// acc + the sums of four adjacent products of unsigned bytes u and signed bytes s, per int32
// lane (vpdpbusd with VNNI; without it, each pair's sum fits int16 for q4 weights: 2 x 15 x 128)
inline __m512i dot_quads(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// y (+)= x . W^T for any M with 16 rows in a vector's lanes (lanes.cpp); x: [M, K] floats, rows
// lda apart, quantized per block as quantize_rows does, or with `act8` (q4 weights only; q8
// weights ignore it) to 8 bits (quantize_block of int8_t).
void lanes(const QWeights& w, const float* x, int64_t lda, int64_t M, float* y, bool acc,
           bool act8);
#endif

// y (+)= x . W^T for M <= GEMV_ROWS rows over weights repacked by gemv_pack (gemv.cpp);
// false when this build has no such path (no AVX-512) or the weights do not fit it.
bool gemv(const QWeights& w, const uint8_t* packed, const QAct& a, int64_t M, float* y,
          bool acc);

}  // namespace qblocks
}  // namespace kvpool
