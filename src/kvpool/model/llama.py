"""Llama-family decoder (Llama, SmolLM, Qwen2) over the paged KV cache.

Plain tensors and functional ops rather than nn.Modules: the step is a straight line of
matmuls, and fusing q/k/v and gate/up into one matmul each saves half the weight passes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvpool.model.attention import AttentionMetadata, paged_attention
from kvpool.model.config import ModelConfig


def _t(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


class _Layer:
    __slots__ = ("down", "gate_up", "ln_attn", "ln_mlp", "o", "qkv", "qkv_bias")

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, bias: bool) -> None:
        a = prefix + "self_attn."
        # Weights are kept transposed ([in, out], contiguous): x @ W runs 2-3x faster on CPU
        # BLAS than F.linear's x @ W.T at the small batch sizes of decode steps.
        self.qkv = _t(
            torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        )
        self.qkv_bias = (
            torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            if bias
            else None
        )
        self.o = _t(w[a + "o_proj.weight"])
        m = prefix + "mlp."
        self.gate_up = _t(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        self.down = _t(w[m + "down_proj.weight"])
        self.ln_attn = w[prefix + "input_layernorm.weight"]
        self.ln_mlp = w[prefix + "post_attention_layernorm.weight"]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3 style scaling when the config asks for it."""
    d = cfg.head_dim
    # float32 like the reference implementation, so positions rotate bit-for-bit the same
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor, lo, hi = (
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
        )
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if kind in (None, "default"):
        return inv
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class LlamaModel:
    """Forward pass of a Llama-family decoder on flattened tokens of a whole step."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 weight_format: str = "float32", kv_cache_dtype: str = "auto") -> None:  # fmt: skip
        if weight_format not in ("float32", "auto"):
            raise NotImplementedError(f"weights={weight_format!r} is not implemented yet")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r} is not implemented yet")
        self.cfg = cfg
        self.dtype = dtype
        self.weight_format = "float32"
        self.kv_format = str(dtype).removeprefix("torch.")
        w = {k: t.to(dtype) for k, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"].contiguous()
        self.lm_head = _t(w.get("lm_head.weight", self.embed))
        self.norm = w["model.norm.weight"]
        self.layers = [
            _Layer(w, f"model.layers.{i}.", cfg.attention_bias) for i in range(cfg.num_layers)
        ]
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def fingerprint(self, file_fingerprint: str) -> str:
        """The fingerprint of the weights as computed with (KV from other weight formats
        differs slightly, so it must not share keys): the file's for float32."""
        if self.weight_format == "float32":
            return file_fingerprint
        return f"{file_fingerprint}|w-{self.weight_format}"

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
        return x * cos + rot * sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normed) for the step's T tokens."""
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        t = input_ids.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln_attn)
            qkv = _mm(x, layer.qkv, layer.qkv_bias)
            # q and k rotate together: one RoPE pass over [T, Hq + Hkv, D]
            qk = self._rope(
                qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d), cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, d)
            a = paged_attention(q, k, v, kv_cache[:, i], meta)
            h = torch.addmm(h, a, layer.o)  # residual add fused into the GEMM
            x = self._rms(h, layer.ln_mlp)
            gu = _mm(x, layer.gate_up)
            act = F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:])
            h = torch.addmm(h, act, layer.down)
        return self._rms(h, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden states."""
        return _mm(hidden, self.lm_head).float()
