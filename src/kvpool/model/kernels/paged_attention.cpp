// Decode attention straight over the paged, block-major KV cache (no gather copy).
//
// One query token per sequence. A task is every query head of one sequence against a chunk of
// its cached tokens (whole blocks), all KV heads at once (GQA: each KV head serves its group
// of query heads). A sequence is cut into several chunks when there are few sequences, so one
// long sequence still keeps every thread busy; its chunks' softmax states (max score, sum of
// exponentials, weighted value sum) are merged at the end, as split-K / flash-decoding does.
// Where the CPU has AVX-512 and the head size is 64 or 128, the passes serve the query rows of
// a KV head together (GQA: each key and value row is loaded once for up to four of them, not
// once per row), keep their value accumulators in registers, and reduce four tokens' dot
// products together; elsewhere portable loops that the compiler vectorizes compute the same
// sums.
//
// An int8 cache (kv_cache_dtype="int8", model/kv_quant.py) holds each token's head as D signed
// bytes then its float32 scale (4 bytes): a key's score is scale * (q . k), a value's weight
// in the sum is its probability times its scale.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;


// Lane-wise partial sums (vectorizes without -ffast-math), reduced once at the end.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += q[i + j] * static_cast<float>(k[i + j]);
  float s = 0.f;
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  for (int64_t j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}

// The factor of a stored row: 1 for float rows, the trailing float32 scale of int8 rows.
template <typename KV>
inline float row_scale(const KV* row, int64_t d) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    float scale;
    std::memcpy(&scale, row + d, sizeof(float));
    return scale;
  } else {
    return 1.f;
  }
}

struct Shape {
  int64_t batch, q_heads, kv_heads, head_dim, block_size, max_blocks;
  int64_t s_block, s_kv, s_tok, s_head;  // strides of the [blocks, 2, bs, Hkv, D] layer view
  float scale;
};

// Brings the next task's keys and values (this layer's part of each of its blocks: 2 * s_kv
// contiguous elements) into L2 while the current task computes, a few cache lines at a time
// from inside the passes' loops. The loads of a task otherwise wait on memory: 30 layers at
// batch 32 and 192 tokens read their KV at ~14 GB/s from memory, ~45 GB/s from cache, and
// 1.16-1.21x faster with this (1.05x at 512 tokens, where a task nearly fills L2). With few
// tasks a thread of different sequences (batch 4-8) it cost 0-25 %: it runs from
// PREFETCH_FROM tasks a thread on, and wherever the next task is the next chunk of the same
// sequence (one or two long sequences cut in chunks: the attention of one sequence of 2,048
// tokens ~1.2x faster, informal A/B on a Zen 4).
constexpr int64_t PREFETCH_FROM = 8;

struct Prefetcher {
  const char* base = nullptr;  // the layer view's first byte
  const int64_t* blocks = nullptr;
  int64_t nblocks = 0, block_stride = 0, bytes = 0;  // bytes per block's K + V; strides in bytes
  int64_t j = 0, at = 0;
  inline void step(int lines) {
    while (lines > 0 && j < nblocks) {  // a tight run of lines within the current block
      const char* p = base + blocks[j] * block_stride;
      const int64_t end = std::min<int64_t>(bytes, at + 64 * static_cast<int64_t>(lines));
      lines -= static_cast<int>((end - at + 63) / 64);
      for (; at < end; at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
      if (at >= bytes) at = 0, ++j;
    }
  }
};

// Where the cached rows of token i (of the chunk's sequence) start: keys; values are s_kv on.
template <typename KV>
inline const KV* token_row(const KV* kv, const int64_t* blocks, int64_t i, const Shape& s) {
  return kv + blocks[i / s.block_size] * s.s_block + (i % s.block_size) * s.s_tok;
}

// Portable passes (any dtype, any head size): scores[r, i - t0] = q_r . k_i, then
// acc_r += p[r, i - t0] * v_i, one token's [Hkv, D] row at a time.
template <typename KV>
void scores_pass(const float* qf, const KV* kv, const int64_t* blocks, int64_t t0, int64_t t1,
                 const Shape& s, float* scores) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads, n = t1 - t0;
  for (int64_t i = t0; i < t1; ++i) {
    const KV* row = token_row(kv, blocks, i, s);
    for (int64_t hh = 0; hh < s.kv_heads; ++hh) {
      const KV* k = row + hh * s.s_head;
      const float ks = row_scale(k, d);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = hh * group + g;
        scores[r * n + i - t0] = dot(qf + r * d, k, d) * ks;
      }
    }
  }
}

template <typename KV>
void values_pass(const float* probs, const KV* kv, const int64_t* blocks, int64_t t0,
                 int64_t t1, const Shape& s, float* acc) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads, n = t1 - t0;
  for (int64_t i = t0; i < t1; ++i) {
    const KV* row = token_row(kv, blocks, i, s) + s.s_kv;
    for (int64_t hh = 0; hh < s.kv_heads; ++hh) {
      const KV* v = row + hh * s.s_head;
      const float vs = row_scale(v, d);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = hh * group + g;
        axpy(probs[r * n + i - t0] * vs, v, acc + r * d, d);
      }
    }
  }
}

#if defined(__AVX512F__)
// AVX-512 passes for float32 or int8 rows of DC * 16 elements: a query row stays in registers
// while the keys stream past, four tokens' dot products reduce together (one shuffle tree for
// four sums instead of one each), and a row's accumulators stay in registers over a block.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The horizontal sums of four vectors, in order.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(halves(a), halves(b)),
                                     _mm256_hadd_ps(halves(c), halves(d)));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Scores of NG query rows r0 .. r0 + NG - 1, all of KV head hh (GQA: they share its keys),
// four tokens at a time: each key chunk is loaded once for the NG rows. Each (row, token) sum
// runs in the same order as one row alone would (chunk 0's product, then chunks 1.. fused in
// order, then the same four-way reduction), so grouping changes no bit of a score.
template <int DC, int NG, typename KV>
void scores_group(const float* qf, const KV* kv, const int64_t* blocks, int64_t t0, int64_t t1,
                  const Shape& s, float* scores, Prefetcher& pf, int64_t hh, int64_t r0) {
  const int64_t d = s.head_dim, n = t1 - t0;
  const float* q = qf + r0 * d;
  int64_t i = t0;
  for (; i + 4 <= t1; i += 4) {
    pf.step(6 * NG);
    const KV* k[4];
    for (int u = 0; u < 4; ++u) k[u] = token_row(kv, blocks, i + u, s) + hh * s.s_head;
    __m512 acc[NG][4];
    for (int u = 0; u < 4; ++u) {
      const __m512 kc = load16(k[u]);
      for (int g = 0; g < NG; ++g) acc[g][u] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d), kc);
    }
    for (int c = 1; c < DC; ++c)
      for (int u = 0; u < 4; ++u) {
        const __m512 kc = load16(k[u] + 16 * c);
        for (int g = 0; g < NG; ++g)
          acc[g][u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * c), kc, acc[g][u]);
      }
    __m128 ks = _mm_set1_ps(1.f);
    if constexpr (std::is_same_v<KV, int8_t>)
      ks = _mm_setr_ps(row_scale(k[0], d), row_scale(k[1], d), row_scale(k[2], d),
                       row_scale(k[3], d));
    for (int g = 0; g < NG; ++g) {
      __m128 sums = hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      if constexpr (std::is_same_v<KV, int8_t>) sums = _mm_mul_ps(sums, ks);
      _mm_storeu_ps(scores + (r0 + g) * n + i - t0, sums);
    }
  }
  for (; i < t1; ++i) {
    const KV* k = token_row(kv, blocks, i, s) + hh * s.s_head;
    for (int g = 0; g < NG; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * d), load16(k));
      for (int c = 1; c < DC; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * c), load16(k + 16 * c), acc);
      scores[(r0 + g) * n + i - t0] = _mm512_reduce_add_ps(acc) * row_scale(k, d);
    }
  }
}

// The weighted value sums of NG query rows of KV head hh: each value row is loaded once for
// the NG rows, whose accumulators stay in registers over the tokens (same order per row).
template <int DC, int NG, typename KV>
void values_group(const float* probs, const KV* kv, const int64_t* blocks, int64_t t0,
                  int64_t t1, const Shape& s, float* acc_out, Prefetcher& pf, int64_t hh,
                  int64_t r0) {
  const int64_t d = s.head_dim, n = t1 - t0;
  __m512 acc[NG][DC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  const float* p = probs + r0 * n - t0;
  for (int64_t i = t0; i < t1; ++i) {
    pf.step(2 * NG);
    const KV* v = token_row(kv, blocks, i, s) + s.s_kv + hh * s.s_head;
    const float vs = row_scale(v, d);
    __m512 w[NG];
    for (int g = 0; g < NG; ++g) w[g] = _mm512_set1_ps(p[g * n + i] * vs);
    for (int c = 0; c < DC; ++c) {
      const __m512 vc = load16(v + 16 * c);
      for (int g = 0; g < NG; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], vc, acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc_out + (r0 + g) * d + 16 * c, acc[g][c]);
}

// Every query row against tokens [t0, t1): KV head by KV head, its group's rows NG at a time
// (at most 4 scores rows, and NG * DC <= 16 value accumulators, stay in registers).
template <int DC, typename KV>
void scores_pass512(const float* qf, const KV* kv, const int64_t* blocks, int64_t t0,
                    int64_t t1, const Shape& s, float* scores, Prefetcher& pf) {
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t hh = 0; hh < s.kv_heads; ++hh)
    for (int64_t g = 0; g < group;) {
      const int64_t r = hh * group + g, ng = std::min<int64_t>(group - g, 4);
      switch (ng) {
        case 4: scores_group<DC, 4>(qf, kv, blocks, t0, t1, s, scores, pf, hh, r); break;
        case 3: scores_group<DC, 3>(qf, kv, blocks, t0, t1, s, scores, pf, hh, r); break;
        case 2: scores_group<DC, 2>(qf, kv, blocks, t0, t1, s, scores, pf, hh, r); break;
        default: scores_group<DC, 1>(qf, kv, blocks, t0, t1, s, scores, pf, hh, r);
      }
      g += ng;
    }
}

template <int DC, typename KV>
void values_pass512(const float* probs, const KV* kv, const int64_t* blocks, int64_t t0,
                    int64_t t1, const Shape& s, float* acc_out, Prefetcher& pf) {
  constexpr int64_t MAXG = 16 / DC;  // 4 rows at head size 64, 2 at 128
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t hh = 0; hh < s.kv_heads; ++hh)
    for (int64_t g = 0; g < group;) {
      const int64_t r = hh * group + g, ng = std::min(group - g, MAXG);
      // groups above MAXG rows are never built (their accumulators would not fit)
      if constexpr (MAXG >= 4) {
        if (ng == 4) {
          values_group<DC, 4>(probs, kv, blocks, t0, t1, s, acc_out, pf, hh, r);
        } else if (ng == 3) {
          values_group<DC, 3>(probs, kv, blocks, t0, t1, s, acc_out, pf, hh, r);
        }
      }
      if (ng == 2) {
        values_group<DC, 2>(probs, kv, blocks, t0, t1, s, acc_out, pf, hh, r);
      } else if (ng == 1) {
        values_group<DC, 1>(probs, kv, blocks, t0, t1, s, acc_out, pf, hh, r);
      }
      g += ng;
    }
}
#endif

// Both passes over tokens [t0, t1) of one sequence, the wide ones where they apply.
template <typename KV>
void passes(const float* qf, const KV* kv, const int64_t* blocks, int64_t t0, int64_t t1,
            const Shape& s, float* scores, float* acc, bool values, Prefetcher& pf) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<KV, float> || std::is_same_v<KV, int8_t>) {
    if (s.head_dim == 64 || s.head_dim == 128) {
      if (s.head_dim == 64) {
        values ? values_pass512<4>(scores, kv, blocks, t0, t1, s, acc, pf)
               : scores_pass512<4>(qf, kv, blocks, t0, t1, s, scores, pf);
      } else {
        values ? values_pass512<8>(scores, kv, blocks, t0, t1, s, acc, pf)
               : scores_pass512<8>(qf, kv, blocks, t0, t1, s, scores, pf);
      }
      return;
    }
  }
#endif
  (void)pf;
  if (values) {
    std::fill(acc, acc + s.q_heads * s.head_dim, 0.f);
    values_pass(scores, kv, blocks, t0, t1, s, acc);
  } else {
    scores_pass(qf, kv, blocks, t0, t1, s, scores);
  }
}

// One task: every query head of one sequence against its cached tokens [t0, t1), all KV heads
// at once. Leaves the chunk's softmax state: per query row its max score `mx`, the sum of
// exp(score - mx) `l`, and the sum of exp(score - mx) * value `acc` (unnormalized).
template <typename KV>
void chunk(const float* qf, const KV* kv, const int64_t* blocks, int64_t t0, int64_t t1,
           const Shape& s, float* scores, float* mx, float* l, float* acc, Prefetcher& pf) {
  const int64_t n = t1 - t0;
  passes(qf, kv, blocks, t0, t1, s, scores, acc, false, pf);
  for (int64_t r = 0; r < s.q_heads; ++r) {
    float* row = scores + r * n;
    const float m = *std::max_element(row, row + n);
    float sum = 0.f;
    // vectorized through glibc's libmvec (-ffast-math declares its SIMD expf)
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - m);
      sum += row[i];
    }
    mx[r] = m;
    l[r] = sum;
  }
  passes(qf, kv, blocks, t0, t1, s, scores, acc, true, pf);
}

// Work split: a sequence's tokens are cut into chunks of whole blocks so that there are a few
// tasks per thread even for one sequence (at batch 1 a single task would leave every other
// core idle); chunks of one sequence are merged by their softmax states (max-rescaled sums).
template <typename T, typename KV>
void decode(const T* q, const KV* kv, const int64_t* table, const int64_t* lens, T* out,
            const Shape& s) {
  const int64_t d = s.head_dim, rows = s.q_heads, threads = at::get_num_threads();
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < s.batch; ++b) total_blocks += (lens[b] + s.block_size - 1) / s.block_size;
  const int64_t per_task = std::max<int64_t>(1, total_blocks / (4 * threads));  // blocks
  std::vector<int64_t> first(s.batch + 1, 0);  // tasks of sequence b: [first[b], first[b + 1])
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t nblk = (lens[b] + s.block_size - 1) / s.block_size;
    first[b + 1] = first[b] + (nblk + per_task - 1) / per_task;
  }
  const int64_t tasks = first[s.batch], state = rows * (d + 2);
  std::vector<float> states(tasks * state);  // per task: mx[rows], l[rows], acc[rows, d]
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), scores;
    int64_t b = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    const auto span = [&](int64_t task, int64_t b, int64_t& t0, int64_t& t1) {
      t0 = (task - first[b]) * per_task * s.block_size;
      t1 = std::min(lens[b], t0 + per_task * s.block_size);
    };
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[b + 1]) ++b;
      int64_t t0, t1;
      span(task, b, t0, t1);
      Prefetcher pf;
      int64_t nb = b;  // the thread's next task's sequence
      while (task + 1 < end && task + 1 >= first[nb + 1]) ++nb;
      if (task + 1 < end && (end - begin >= PREFETCH_FROM || nb == b)) {
        int64_t n0, n1;
        span(task + 1, nb, n0, n1);
        pf = Prefetcher{reinterpret_cast<const char*>(kv), table + nb * s.max_blocks + n0 / s.block_size,
                        (n1 - n0 + s.block_size - 1) / s.block_size,
                        s.s_block * static_cast<int64_t>(sizeof(KV)),
                        2 * s.s_kv * static_cast<int64_t>(sizeof(KV))};
      }
      for (int64_t i = 0; i < rows * d; ++i) qf[i] = static_cast<float>(q[b * rows * d + i]) * s.scale;
      scores.resize(rows * (t1 - t0));
      float* st = states.data() + task * state;
      chunk(qf.data(), kv, table + b * s.max_blocks, t0, t1, s, scores.data(), st, st + rows,
            st + 2 * rows, pf);
      if (first[b + 1] - first[b] == 1)  // the whole sequence: normalize in place
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < d; ++i)
            out[(b * rows + r) * d + i] = static_cast<T>(st[2 * rows + r * d + i] / st[rows + r]);
    }
  });
  // merge the chunks of cut sequences (few: cutting only happens when sequences are few):
  // out = sum_c e^(mx_c - M) acc_c / sum_c e^(mx_c - M) l_c
  std::vector<float> acc(d);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t r = 0; first[b + 1] - first[b] > 1 && r < rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = first[b]; c < first[b + 1]; ++c) m = std::max(m, states[c * state + r]);
      float l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = first[b]; c < first[b + 1]; ++c) {
        const float* st = states.data() + c * state;
        const float w = std::exp(st[r] - m);
        l += w * st[rows + r];
        axpy(w, st + 2 * rows + r * d, acc.data(), d);
      }
      T* o = out + (b * rows + r) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(acc[i] / l);
    }
}

}  // namespace

namespace kvpool {

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_layer,
                                     torch::Tensor block_table, torch::Tensor lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, Hq, D] tensor");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2, "kv_layer must be [N, 2, BS, H, D]");
  TORCH_CHECK(kv_layer.stride(4) == 1 && kv_layer.stride(3) == kv_layer.size(4),
              "kv_layer heads must be contiguous");
  const bool q8 = kv_layer.scalar_type() == torch::kChar;  // int8 rows: D bytes + a scale
  TORCH_CHECK(q8 || q.scalar_type() == kv_layer.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == q.size(0),
              "block_table must be a contiguous int64 [B, max_blocks] tensor");
  TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.is_contiguous() &&
                  lens.numel() == q.size(0), "lens must be a contiguous int64 [B] tensor");
  Shape s{q.size(0), q.size(1), kv_layer.size(3), q.size(2), kv_layer.size(2),
          block_table.size(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
          kv_layer.stride(3), static_cast<float>(scale)};
  TORCH_CHECK(s.head_dim + (q8 ? 4 : 0) == kv_layer.size(4) && s.q_heads % s.kv_heads == 0,
              "bad head shapes");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= s.max_blocks * s.block_size, "length out of range");
    for (int64_t j = 0; j < (lp[b] + s.block_size - 1) / s.block_size; ++j)
      TORCH_CHECK(tp[b * s.max_blocks + j] >= 0 && tp[b * s.max_blocks + j] < kv_layer.size(0),
                  "block id out of range");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    if (q8) {
      decode<scalar_t, int8_t>(q.data_ptr<scalar_t>(), kv_layer.data_ptr<int8_t>(), tp, lp,
                               out.data_ptr<scalar_t>(), s);
    } else {
      decode<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), kv_layer.data_ptr<scalar_t>(), tp, lp,
                                 out.data_ptr<scalar_t>(), s);
    }
  });
  return out;
}

}  // namespace kvpool
