// One decode step of a Llama-family decoder in one call: every layer's RMSNorm, q/k/v
// projection, RoPE, KV write into the paged cache, attention, output projection, MLP and
// residual adds, without going back to Python between ops. At one or a few sequences a step
// is short (milliseconds) and made of ~300 small ops; dispatching each from Python costs more
// than the arithmetic of most of them. The math is the Python path's (model/llama.py), which
// still runs prefill chunks and mixed steps, with this file's RoPE and MLP activation
// (rope_rows_, silu_mul_rows) where the kernels are built.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvpool {
namespace {

void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* yr = y + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

// rotate_half RoPE of `heads` heads of dimension d in place: x * cos + rotate_half(x) * sin.
void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// One token's keys (or values) of every KV head into its cache slot: as they are into a float
// cache, as D int8 values and a float32 scale per head into an int8 one (kv_quant.py).
void store_row(const float* x, int64_t heads, int64_t d, float* slot) {
  std::copy(x, x + heads * d, slot);
}

void store_row(const float* x, int64_t heads, int64_t d, int8_t* slot) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* v = x + h * d;
    int8_t* out = slot + h * (d + 4);
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax / 127.f;
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<int8_t>(std::nearbyint(amax > 0.f ? v[i] / scale : 0.f));
    std::memcpy(out + d, &scale, sizeof(float));
  }
}

template <typename KV>
void store_kv(const float* row, int64_t qsize, int64_t kv_heads, int64_t d, KV* slot,
              int64_t kv_stride) {
  store_row(row + qsize, kv_heads, d, slot);                            // keys
  store_row(row + qsize + kv_heads * d, kv_heads, d, slot + kv_stride);  // values
}

void silu_mul(const float* gu, float* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

c10::optional<torch::Tensor> packed(const DecodeModel::Linear& l) {
  return l.packed.defined() ? c10::optional<torch::Tensor>(l.packed) : c10::nullopt;
}

bool use_blocks(const DecodeModel::Linear& l, int64_t rows) {
  return l.qs.defined() && rows <= l.small_rows;
}

torch::Tensor linear(const DecodeModel::Linear& l, const torch::Tensor& x) {
  if (use_blocks(l, x.size(0))) {
    torch::Tensor y = qlinear(x, l.qs, l.d, l.m, c10::nullopt, false, true, LANES_FROM, packed(l));
    return l.bias.defined() ? y.add_(l.bias) : y;
  }
  return l.bias.defined() ? at::addmm(l.bias, x, l.w_t) : at::mm(x, l.w_t);
}

void linear_add(const DecodeModel::Linear& l, const torch::Tensor& x, torch::Tensor& h) {
  if (use_blocks(l, x.size(0))) {
    qlinear(x, l.qs, l.d, l.m, h, false, true, LANES_FROM, packed(l));
  } else {
    h.addmm_(x, l.w_t);
  }
}

DecodeModel::Linear read_linear(const py::dict& d) {
  DecodeModel::Linear l;
  l.w_t = d["w_t"].cast<torch::Tensor>();
  if (!d["bias"].is_none()) l.bias = d["bias"].cast<torch::Tensor>();
  if (!d["qs"].is_none()) {
    l.qs = d["qs"].cast<torch::Tensor>();
    l.d = d["d"].cast<torch::Tensor>();
    l.m = d["m"].cast<torch::Tensor>();
    l.small_rows = d["small_rows"].cast<int64_t>();
    if (d.contains("packed") && !d["packed"].is_none()) l.packed = d["packed"].cast<torch::Tensor>();
  }
  TORCH_CHECK(l.w_t.scalar_type() == torch::kFloat && l.w_t.dim() == 2,
              "DecodeModel computes in float32");
  return l;
}

}  // namespace

DecodeModel::DecodeModel(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                         double eps, torch::Tensor cos, torch::Tensor sin, torch::Tensor norm)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(inter),
      eps_(static_cast<float>(eps)), cos_(cos.contiguous()), sin_(sin.contiguous()),
      norm_(norm.contiguous()) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "bad head shapes");
  TORCH_CHECK(cos_.scalar_type() == torch::kFloat && cos_.dim() == 2 &&
                  cos_.size(1) == head_dim && sin_.sizes() == cos_.sizes(),
              "cos/sin must be float32 [positions, head_dim]");
}

void DecodeModel::add_layer(py::dict layer) {
  Layer l{read_linear(layer["qkv"].cast<py::dict>()), read_linear(layer["o"].cast<py::dict>()),
          read_linear(layer["gate_up"].cast<py::dict>()),
          read_linear(layer["down"].cast<py::dict>()),
          layer["ln_attn"].cast<torch::Tensor>().contiguous(),
          layer["ln_mlp"].cast<torch::Tensor>().contiguous()};
  layers_.push_back(std::move(l));
}

// The prompt path's RoPE (model/llama.py): q and k of every row of `qkv` ([T, (Hq + 2 Hkv) d])
// rotated in place at `positions`, rows split over the threads; one pass instead of torch's
// five (negate, concatenate, two products, a sum), which ran on one thread at a prompt chunk's
// sizes while the other core waited.
void DecodeModel::rope_rows_(torch::Tensor qkv, torch::Tensor positions) const {
  const int64_t d = cos_.size(1), heads = heads_ + kv_heads_;
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= heads * d,
              "qkv must be a float32 [T, >= (heads + kv_heads) * head_dim] tensor with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions must be a contiguous int64 [T] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "position out of range");
  float* x = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  const float* cs = cos_.data_ptr<float>();
  const float* sn = sin_.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope(x + t * ld, heads, d, cs + pos[t] * d, sn + pos[t] * d);
  });
}

// RMSNorm of every row of the prompt path's hidden states ([T, hidden]) with weight `w`, rows
// split over the threads, as the fused decode step computes it (torch's ran ~3x slower on a
// prompt chunk, on one thread, in four passes).
torch::Tensor DecodeModel::rms_rows(torch::Tensor x, torch::Tensor w) const {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "x must be a contiguous float32 [T, n] tensor and w a float32 [n] one");
  auto y = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    rms_norm(xp + begin * n, wp, yp + begin * n, end - begin, n, eps_);
  });
  return y;
}

// silu(gate) * up of the prompt path's MLP ([T, 2 inter] -> [T, inter]), rows split over the
// threads (torch's silu_ and mul_ were two passes).
torch::Tensor DecodeModel::silu_mul_rows(torch::Tensor gu) const {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat && gu.dim() == 2 && gu.is_contiguous() &&
                  gu.size(1) == 2 * inter_,
              "gu must be a contiguous float32 [T, 2 * intermediate_size] tensor");
  auto act = torch::empty({gu.size(0), inter_}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* a = act.data_ptr<float>();
  at::parallel_for(0, gu.size(0), 8, [&](int64_t begin, int64_t end) {
    kvpool::silu_mul(g + begin * 2 * inter_, a + begin * inter_, end - begin, inter_);
  });
  return act;
}

DecodeModel::~DecodeModel() {
  if (ledger_ != nullptr) munmap(const_cast<uint8_t*>(ledger_), ledger_len_);
}

void DecodeModel::share_cores(const std::string& path, int64_t first, int64_t slots,
                              int64_t cores, int64_t share) {
  TORCH_CHECK(first >= 0 && slots >= 1 && cores >= 1 && share >= 1,
              "share_cores: bad ledger layout or counts");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "share_cores: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  const size_t len = static_cast<size_t>(first + slots);
  void* at = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= len)
    at = mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(at != MAP_FAILED, "share_cores: ", path, " is shorter than its ", slots,
              " slots, or cannot be mapped");
  if (ledger_ != nullptr) munmap(const_cast<uint8_t*>(ledger_), ledger_len_);
  ledger_ = static_cast<const volatile uint8_t*>(at);
  ledger_len_ = len;
  ledger_first_ = first, ledger_slots_ = slots, ledger_cores_ = cores, ledger_share_ = share;
}

void DecodeModel::narrow_to_ledger() {
  if (ledger_ == nullptr) return;
  int64_t busy = 0;
  for (int64_t i = 0; i < ledger_slots_; ++i) busy += ledger_[ledger_first_ + i];
  const int64_t want = std::max(ledger_share_, ledger_cores_ / std::max<int64_t>(1, busy));
  if (want < at::get_num_threads()) {
    at::set_num_threads(static_cast<int>(want));
    ++narrowed_;
  }
}

torch::Tensor DecodeModel::forward(torch::Tensor h, torch::Tensor positions,
                                   torch::Tensor kv_cache, torch::Tensor block_table,
                                   torch::Tensor lens, torch::Tensor slot_blocks,
                                   torch::Tensor slot_offsets) {
  const int64_t B = h.size(0), hidden = h.size(1), d = head_dim_;
  const int64_t qsize = heads_ * d;
  TORCH_CHECK(h.scalar_type() == torch::kFloat && h.is_contiguous() && h.dim() == 2,
              "h must be a contiguous float32 [B, hidden] tensor");
  const bool q8 = kv_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 6 &&
                  (q8 || kv_cache.scalar_type() == torch::kFloat) &&
                  kv_cache.size(1) == static_cast<int64_t>(layers_.size()) &&
                  kv_cache.size(4) == kv_heads_ && kv_cache.size(5) == d + (q8 ? 4 : 0),
              "kv_cache must be a contiguous float32 [blocks, layers, 2, bs, kv_heads, d] "
              "(or int8 with d + 4 bytes per row)");
  for (const auto* t : {&positions, &slot_blocks, &slot_offsets})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->numel() == B,
                "positions and slots must be contiguous int64 [B] tensors");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sb = slot_blocks.data_ptr<int64_t>();
  const int64_t* so = slot_offsets.data_ptr<int64_t>();
  const int64_t nblocks = kv_cache.size(0), bs = kv_cache.size(3);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0) && sb[b] >= 0 && sb[b] < nblocks &&
                    so[b] >= 0 && so[b] < bs,
                "position or KV slot out of range");
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float* cs = cos_.data_ptr<float>();
  const float* sn = sin_.data_ptr<float>();
  const auto st = kv_cache.strides();
  auto x = torch::empty_like(h);
  auto q = torch::empty({B, heads_, d}, h.options());
  auto act = torch::empty({B, inter_}, h.options());
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    narrow_to_ledger();
    rms_norm(hp, L.ln_attn.data_ptr<float>(), xp, B, hidden, eps_);
    torch::Tensor qkv = linear(L.qkv, x);
    float* qkvp = qkv.data_ptr<float>();
    const int64_t row = qkv.size(1);
    for (int64_t b = 0; b < B; ++b) {
      float* r = qkvp + b * row;
      rope(r, heads_ + kv_heads_, d, cs + pos[b] * d, sn + pos[b] * d);  // q and k
      std::copy(r, r + qsize, q.data_ptr<float>() + b * qsize);
      const int64_t at = sb[b] * st[0] + li * st[1] + so[b] * st[3];
      if (q8) {
        store_kv(r, qsize, kv_heads_, d, kv_cache.data_ptr<int8_t>() + at, st[2]);
      } else {
        store_kv(r, qsize, kv_heads_, d, kv_cache.data_ptr<float>() + at, st[2]);
      }
    }
    torch::Tensor a = paged_decode_attention(q, kv_cache.select(1, li), block_table, lens,
                                             scale);
    linear_add(L.o, a.view({B, qsize}), h);
    rms_norm(hp, L.ln_mlp.data_ptr<float>(), xp, B, hidden, eps_);
    torch::Tensor gu = linear(L.gate_up, x);
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), B, inter_);
    linear_add(L.down, act, h);
  }
  rms_norm(hp, norm_.data_ptr<float>(), xp, B, hidden, eps_);
  return x;
}

}  // namespace kvpool
