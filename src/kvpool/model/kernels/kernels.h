// kvpool's C++ kernels, one extension module (kvpool.model.kernels builds it on first use).
#pragma once

#include <torch/extension.h>

namespace kvpool {

// Decode attention over the paged, block-major KV cache (paged_attention.cpp).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_layer,
                                     torch::Tensor block_table, torch::Tensor lens,
                                     double scale);

// y = x . W^T over 32-block quantized weights; with `out`, y is added to it (qgemm.cpp).
// `wide`: the AVX-512 paths where built in; from `lanes_from` rows on (0: never) the one that
// puts 16 activation rows in a vector's lanes.
constexpr int64_t LANES_FROM = 12;
// `act8`: the lanes path quantizes activations to 8 bits instead of 16 where the weights are
// q4 (twice the products per instruction: prompt steps, which are compute-bound).
// `packed`: the same weights repacked by gemv_pack, which up to GEMV_ROWS rows run (gemv.cpp),
// in groups of at most GEMV_GROUP rows over each weight row.
constexpr int64_t GEMV_GROUP = 4;
constexpr int64_t GEMV_ROWS = LANES_FROM - 1;
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                      c10::optional<torch::Tensor> out, bool portable, bool wide = true,
                      int64_t lanes_from = LANES_FROM,
                      c10::optional<torch::Tensor> packed = c10::nullopt, bool act8 = false);
// qs repacked for the few-row kernel, or an empty tensor where it does not run (gemv.cpp).
torch::Tensor gemv_pack(torch::Tensor qs, bool q4);
bool has_avx2();
bool has_avx512();

// Dense float32 linear layers on AMX-BF16 tiles, each operand split in two bfloat16 halves
// (amx.cpp): y = x . W^T (+ bias), added to `out` where given; W packed once by amx_pack.
bool has_amx();
torch::Tensor amx_pack(torch::Tensor w);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> out,
                         c10::optional<torch::Tensor> bias);
// Causal attention of a prompt chunk's n queries [n, Hq, D] over its sequence's ctx =
// start_pos + n keys and values [ctx, Hkv, D] on the same tiles (amx.cpp).
torch::Tensor amx_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t start_pos, double scale);

// A whole decode step of a Llama-family model in one call (decode.cpp).
class DecodeModel {
 public:
  struct Linear {  // blocks (qs, d, m) below `small_rows` rows, else dense (w_t, bias)
    torch::Tensor qs, d, m, w_t, bias, packed;
    int64_t small_rows = 0;
  };
  struct Layer {
    Linear qkv, o, gate_up, down;
    torch::Tensor ln_attn, ln_mlp;
  };
  DecodeModel(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps,
              torch::Tensor cos, torch::Tensor sin, torch::Tensor norm);
  ~DecodeModel();
  DecodeModel(const DecodeModel&) = delete;
  DecodeModel& operator=(const DecodeModel&) = delete;
  void add_layer(py::dict layer);
  torch::Tensor forward(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_cache,
                        torch::Tensor block_table, torch::Tensor lens, torch::Tensor slot_blocks,
                        torch::Tensor slot_offsets);
  // Before each layer, narrow torch's threads to what the host's core ledger allows now
  // (engine/core_share.py: the busy bytes of `slots` workers from byte `first` of the file at
  // `path`, `cores` over them, never below `share`), so a step begun wide while the other
  // workers idled gives their cores back within a layer of one of them waking. Never widens
  // (a step that began narrow stays so: its time is a step-cost sample). `narrowed` counts the
  // narrowings.
  void share_cores(const std::string& path, int64_t first, int64_t slots, int64_t cores,
                   int64_t share);
  int64_t narrowed() const { return narrowed_; }
  // The prompt path's RoPE (in place), silu(gate) * up and RMSNorm, with this model's tables.
  void rope_rows_(torch::Tensor qkv, torch::Tensor positions) const;
  torch::Tensor silu_mul_rows(torch::Tensor gu) const;
  torch::Tensor rms_rows(torch::Tensor x, torch::Tensor w) const;

 private:
  int64_t heads_, kv_heads_, head_dim_, inter_;
  float eps_;
  torch::Tensor cos_, sin_, norm_;
  std::vector<Layer> layers_;
  const volatile uint8_t* ledger_ = nullptr;  // the ledger file, mapped read-only
  size_t ledger_len_ = 0;
  int64_t ledger_first_ = 0, ledger_slots_ = 0, ledger_cores_ = 1, ledger_share_ = 1;
  int64_t narrowed_ = 0;
  void narrow_to_ledger();
};

}  // namespace kvpool
