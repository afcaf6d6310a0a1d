// Causal attention of a prompt chunk on AMX-BF16 tiles (the halves of amx.cpp): keys and
// values packed per KV head, each block of 32 queries' scores on the tiles, an AVX-512 softmax
// in key order, then the weighted values on the tiles. Each query's row is computed alike
// whatever the rows beside it, so a prompt's chunks give it the same bits.
#include "amx.h"

#include <cmath>
#include <vector>

namespace kvpool {

#if defined(KVPOOL_AMX)
namespace {

using namespace amx;

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
  // every element below is written before it is read: scratch, not zeroed vectors
  uint16_t* const qh = scratch(2 * npad * ldq, 0);
  uint16_t* const ql = qh + npad * ldq;
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, npad, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t e = 0; e < ldq; e += 16) {
        __m512i vh = _mm512_setzero_si512(), vl = vh;
        if (i < n) split(_mm512_loadu_ps(qp + i * q.stride(0) + e), &vh, &vl);
        store16(qh + i * ldq + e, vh);
        store16(ql + i * ldq + e, vl);
      }
    }
  });
  const int64_t per_head = kpad * D * 2;
  uint16_t* const kt = scratch(2 * Hkv * per_head, 1);
  uint16_t* const vt = kt + Hkv * per_head;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, 2 * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0) {
        pack_tiles(kpad, D, [&](int64_t j, int64_t d) {
          return j < ctx ? kp[(j * Hkv + h) * D + d] : 0.f;
        }, kt + h * per_head);
      } else {
        pack_tiles(D, kpad, [&](int64_t d, int64_t j) {
          return j < ctx ? vp[(j * Hkv + h) * D + d] : 0.f;
        }, vt + h * per_head);
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
    uint16_t* const ph = scratch(2 * 32 * kpad, 2);  // this thread's own
    uint16_t* const pl = ph + 32 * kpad;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / qblocks, i0 = (t % qblocks) * 32, kvh = h / G;
      const int64_t rows = std::min<int64_t>(32, n - i0);
      const int64_t keys = start_pos + i0 + rows, kblocks = (keys + 31) / 32, kspan = kblocks * 32;
      const uint16_t* ah = qh + i0 * ldq + h * D;
      const uint16_t* al = ql + i0 * ldq + h * D;
      for (int64_t b = 0; b < kblocks; ++b) {
        block<2, true>(ah, al, D, kt + kvh * per_head, 2 * b, scores.data(), kpad, 0, rows,
                 32 * b, nullptr, false, ldq);
      }
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t valid = r < rows ? start_pos + i0 + r + 1 : 0;
        inv[r] = softmax_row(scores.data() + r * kpad, valid, kspan, sc, ph + r * kpad,
                             pl + r * kpad);
      }
      float* o = op + i0 * ldq + h * D;
      for (int64_t c = 0; c < D / 32; ++c) {
        block<2>(ph, pl, kspan, vt + kvh * per_head, 2 * c, o, ldq, 0, rows,
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
