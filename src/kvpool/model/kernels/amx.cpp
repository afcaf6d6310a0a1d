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
#include "amx.h"

#include <mutex>

#if defined(KVPOOL_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvpool {

#if defined(KVPOOL_AMX)
namespace amx {

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

}  // namespace amx

namespace {

using namespace amx;

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

}  // namespace
#endif

bool has_amx() {
#if defined(KVPOOL_AMX)
  return amx::tiles_permitted();
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
  uint16_t* const xh = scratch(2 * Mpad * K, 0);
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
