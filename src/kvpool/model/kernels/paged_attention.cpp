// Decode attention straight over the paged, block-major KV cache (no gather copy).
//
// One query token per sequence. Each (sequence, KV head) pair is one task: the task reads the
// sequence's keys and values block by block where they lie in the cache, once each, for all
// query heads of its group (GQA), so shared prefix blocks stay hot in cache across sequences.
//
// An int8 cache (kv_cache_dtype="int8", model/kv_quant.py) holds each token's head as D signed
// bytes then its float32 scale (4 bytes): a key's score is scale * (q . k), a value's weight
// in the sum is its probability times its scale.
#include "kernels.h"

#include <ATen/Parallel.h>

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

// Scores of `heads` consecutive KV heads' query groups (rows ordered head, then group) against
// every cached key of one sequence. With all heads in one task, each token's contiguous
// [Hkv, D] key row is read once, front to back.
template <typename T>
void task_scores(const float* qf, const T* kv, const int64_t* blocks, int64_t len, int64_t h0,
                 int64_t heads, int64_t group, const Shape& s, float* scores) {
  const int64_t d = s.head_dim;
  for (int64_t t0 = 0, j = 0; t0 < len; t0 += s.block_size, ++j) {
    const T* kb = kv + blocks[j] * s.s_block + h0 * s.s_head;
    const int64_t n = std::min(s.block_size, len - t0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hh = 0; hh < heads; ++hh) {
        const T* k = kb + t * s.s_tok + hh * s.s_head;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = hh * group + g;
          scores[r * len + t0 + t] = dot(qf + r * d, k, d) * row_scale(k, d);
        }
      }
  }
}

// Softmax of each row in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * len;
    const float m = *std::max_element(row, row + len);
    float sum = 0.f;
    // vectorized through glibc's libmvec (-ffast-math declares its SIMD expf)
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - m);
      sum += row[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) row[t] *= inv;
  }
}

template <typename T>
void task_values(const float* probs, const T* kv, const int64_t* blocks, int64_t len,
                 int64_t h0, int64_t heads, int64_t group, const Shape& s, float* acc) {
  const int64_t d = s.head_dim;
  for (int64_t t0 = 0, j = 0; t0 < len; t0 += s.block_size, ++j) {
    const T* vb = kv + blocks[j] * s.s_block + s.s_kv + h0 * s.s_head;
    const int64_t n = std::min(s.block_size, len - t0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = hh * group + g;
          const T* v = vb + t * s.s_tok + hh * s.s_head;
          axpy(probs[r * len + t0 + t] * row_scale(v, d), v, acc + r * d, d);
        }
  }
}

template <typename T, typename KV>
void decode(const T* q, const KV* kv, const int64_t* table, const int64_t* lens, T* out,
            const Shape& s) {
  const int64_t group = s.q_heads / s.kv_heads, d = s.head_dim;
  // A task is a whole sequence when there are enough of them to keep every thread busy
  // (streams its KV rows), else one (sequence, KV head) pair.
  const int64_t heads = s.batch >= 2 * at::get_num_threads() ? s.kv_heads : 1;
  const int64_t per_seq = s.kv_heads / heads, rows = heads * group;
  at::parallel_for(0, s.batch * per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), acc(rows * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_seq, h0 = (task % per_seq) * heads, len = lens[b];
      const int64_t* blocks = table + b * s.max_blocks;
      const int64_t first = (b * s.q_heads + h0 * group) * d;  // q/out rows are contiguous
      for (int64_t i = 0; i < rows * d; ++i) qf[i] = static_cast<float>(q[first + i]) * s.scale;
      scores.resize(rows * len);
      task_scores(qf.data(), kv, blocks, len, h0, heads, group, s, scores.data());
      softmax_rows(scores.data(), rows, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      task_values(scores.data(), kv, blocks, len, h0, heads, group, s, acc.data());
      for (int64_t i = 0; i < rows * d; ++i) out[first + i] = static_cast<T>(acc[i]);
    }
  });
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
