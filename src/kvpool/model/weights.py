"""The weight names and shapes a Llama-family model must have (Hugging Face naming)."""

from __future__ import annotations

import torch

from kvpool.common.errors import ModelLoadError
from kvpool.model.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor ``LoadedModel.weights`` holds for ``config``, with its shape."""
    h, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``weights`` has exactly the expected names and shapes."""
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    extra = sorted(weights.keys() - expected.keys())
    wrong = [
        f"{name}: {tuple(weights[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if extra:
        problems.append(f"unexpected tensors {_few(extra)}")
    if wrong:
        problems.append(f"wrong shapes {_few(wrong)}")
    if problems:
        raise ModelLoadError(f"{source}: weights do not match the config: " + "; ".join(problems))


def _few(items: list[str], limit: int = 5) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
