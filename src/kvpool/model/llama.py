"""Llama-family decoder (Llama, SmolLM, Qwen2) over the paged KV cache.

Plain tensors and functional ops rather than nn.Modules: the step is a straight line of
matmuls, and fusing q/k/v and gate/up into one matmul each saves half the weight passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpool.model import hugepages, linear
from kvpool.model.attention import AttentionMetadata, paged_attention
from kvpool.model.config import ModelConfig
from kvpool.model.kernels import kernels
from kvpool.model.weight_formats import LinearFactory, resolve


class _Layer:
    __slots__ = ("down", "gate_up", "ln_attn", "ln_mlp", "o", "qkv")

    def __init__(self, make: LinearFactory, w: dict[str, torch.Tensor], prefix: str,
                 bias: bool) -> None:  # fmt: skip
        a, m = prefix + "self_attn.", prefix + "mlp."
        qkv = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        qkv_bias = [n.replace(".weight", ".bias") for n in qkv] if bias else None
        self.qkv = make.dense(qkv, qkv_bias)  # q, k and v in one GEMM
        self.o = make.dense([a + "o_proj.weight"])
        self.gate_up = make.dense([m + "gate_proj.weight", m + "up_proj.weight"])
        self.down = make.dense([m + "down_proj.weight"])
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
                 weight_format: str = "float32", kv_cache_dtype: str = "auto",
                 source: str | None = None) -> None:  # fmt: skip
        """``weight_format``: the linear layers' (``weight_formats.py``); ``source``: the
        model's file, whose own quantized blocks are used where the format allows."""
        weight_format = resolve(weight_format, cfg, dtype, source)
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {kv_cache_dtype!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.weight_format = weight_format
        self.kv_dtype = torch.int8 if kv_cache_dtype == "int8" else dtype
        # in the KV namespace: float and int8 blocks never share keys
        self.kv_format = (
            "int8-tokscale" if kv_cache_dtype == "int8" else str(dtype).removeprefix("torch.")
        )
        w = {k: t.to(dtype) for k, t in weights.items()}
        make = LinearFactory(weight_format, w, cfg, dtype, source)
        self.embed = w["model.embed_tokens.weight"].contiguous()
        self.lm_head = make.head("lm_head.weight" if "lm_head.weight" in w else
                                 "model.embed_tokens.weight")  # fmt: skip
        self.norm = w["model.norm.weight"]
        self.layers = [
            _Layer(make, w, f"model.layers.{i}.", cfg.attention_bias) for i in range(cfg.num_layers)
        ]
        self.weights_exact = make.exact
        # prompt chunks attend on AMX tiles where the prompt linears run on them
        self.prompt_tiles = (
            cfg.head_dim % 32 == 0
            and cfg.head_dim <= 256
            and any(map(linear.prompts_on_tiles, self._layer_linears()))
        )
        if hugepages.enabled():  # one stream on huge pages, in the order a step reads
            linear.to_huge_pages([*self._layer_linears(), self.lm_head])
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.fused = self._fused_decode(make.kernels if make.kernels is not None else kernels())
        # called before each layer of a step with prompt tokens (the host's core ledger sets
        # the threads there: engine/core_share.py)
        self.between_layers: Callable[[], object] | None = None

    def _fused_decode(self, mod):
        """The whole decode step in one C++ call (``kernels/decode.cpp``), or None (no
        kernels, or not float32)."""
        if mod is None or self.dtype != torch.float32 or not hasattr(mod, "DecodeModel"):
            return None
        c = self.cfg
        fused = mod.DecodeModel(c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                                c.rms_norm_eps, self.cos, self.sin, self.norm)  # fmt: skip
        for layer in self.layers:
            fused.add_layer({"qkv": layer.qkv.spec(), "o": layer.o.spec(),
                             "gate_up": layer.gate_up.spec(), "down": layer.down.spec(),
                             "ln_attn": layer.ln_attn, "ln_mlp": layer.ln_mlp})  # fmt: skip
        return fused

    def linears(self):
        """Every linear layer: the head, then each layer's q/k/v, o, gate/up and down."""
        yield self.lm_head
        yield from self._layer_linears()

    def _layer_linears(self):
        for layer in self.layers:
            yield from (layer.qkv, layer.o, layer.gate_up, layer.down)

    def fingerprint(self, file_fingerprint: str) -> str:
        """The fingerprint of the weights as computed with: the file's, unless the format
        changed them (blocks quantized here: their KV differs, so it must not share keys), or
        prompt steps quantize activations to 8 bits (``KVPOOL_PROMPT_ACT8=1``: not the float32
        model's KV either)."""
        fp = (
            file_fingerprint if self.weights_exact else f"{file_fingerprint}|w-{self.weight_format}"
        )
        return f"{fp}|a8" if self.prompt_act8() else fp

    def prompt_act8(self) -> bool:
        """Whether prompt steps run any layer on 8-bit activations (q4 blocks on the kernel)."""
        return linear.PROMPT_ACT8 and any(
            isinstance(lin, linear.BlockLinear) and lin.prompt_blocks and lin.weights.kind == "q4"
            for lin in self.linears())  # fmt: skip

    def _rms(self, x: torch.Tensor, w: torch.Tensor, fused=None) -> torch.Tensor:
        if fused is not None and x.is_contiguous():  # rows over the threads, as decode does
            return fused.rms_rows(x, w)
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
        if self.fused is not None and not meta.prefills and meta.kernels is not None:
            return self.fused.forward(h, positions, kv_cache, meta.decode_block_table,
                                      meta.decode_lens, meta.slot_blocks, meta.slot_offsets)  # fmt: skip
        # a step with prompt tokens runs every row on one path (``linear.py``), so a prompt's
        # KV and its logprobs do not depend on how the scheduler cut it into chunks
        prompt = bool(meta.prefills)
        tiles = prompt and self.prompt_tiles
        # the fused step's C++ RoPE and MLP activation serve this path too, where built
        fused = self.fused if meta.kernels is not None else None
        if fused is None:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        t = input_ids.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = cfg.intermediate_size
        hook = self.between_layers
        for i, layer in enumerate(self.layers):
            if hook is not None:
                hook()
            x = self._rms(h, layer.ln_attn, fused)
            qkv = layer.qkv(x, prompt)
            if fused is not None:  # in place, one pass (kernels/decode.cpp)
                fused.rope_rows_(qkv, positions)
                qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d)
            else:  # q and k rotate together: one RoPE pass over [T, Hq + Hkv, D]
                qk = self._rope(
                    qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d), cos, sin
                )
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, d)
            a = paged_attention(q, k, v, kv_cache[:, i], meta, tiles)
            h = layer.o.add_to(h, a, prompt)  # residual add fused into the GEMM
            x = self._rms(h, layer.ln_mlp, fused)
            gu = layer.gate_up(x, prompt)
            if fused is not None:
                act = fused.silu_mul_rows(gu)
            else:
                act = F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:])
            h = layer.down.add_to(h, act, prompt)
        return self._rms(h, self.norm, fused)

    def logits(self, hidden: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden states (``prompt``: on the prompt
        path whatever N, as steps with prompt tokens and prompt logprobs ask)."""
        return self.lm_head(hidden, prompt).float()
