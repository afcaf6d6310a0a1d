"""Tiny synthetic Llama/Qwen2 models written as GGUF files or HF folders, for the loader tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from safetensors.torch import save_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    "Numbers 1234567890 and prices $12.50",
    "Unicode: héllo wörld, 你好世界, emoji 😀 👍",
] * 20
_LAYER_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


@dataclass
class TinySpec:
    """A tiny Llama/Qwen2 model (2 layers, hidden 64)."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    inter: int = 96
    heads: int = 4
    kv_heads: int = 2
    tie: bool = True
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
    pre: str = "gpt2"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def bias(self) -> bool:
        return self.arch == "qwen2"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _GLOBAL_GGUF:
        return f"{_GLOBAL_GGUF[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER_GGUF[rest]}.{suffix}"


def random_hf_weights(spec: TinySpec, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights with Hugging Face names and shapes."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (spec.inter, h),
            p + "mlp.up_proj.weight": (spec.inter, h),
            p + "mlp.down_proj.weight": (h, spec.inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if spec.bias:
            for proj, n in (("q", q), ("k", kv), ("v", kv)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n,)
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}


class TinyModels:
    """Writes tiny GGUF files and HF folders from random weights and the tiny BPE tokenizer."""

    def __init__(self, bpe: tokenizers.Tokenizer) -> None:
        self.bpe = bpe
        data = json.loads(bpe.to_str())
        vocab = data["model"]["vocab"]
        self.tokens = sorted(vocab, key=vocab.__getitem__)
        self.merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        self.types = [3 if t in SPECIALS else 1 for t in self.tokens]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def write_gguf(self, path: Path, spec: TinySpec, extra_tensors: dict | None = None) -> dict:
        """Write ``path``; return the HF-named float32 weights it should load back as."""
        weights = random_hf_weights(spec, self.vocab_size)
        w = gguf.GGUFWriter(str(path), spec.arch)
        self._write_metadata(w, spec)
        for name, tensor in weights.items():
            array = tensor.numpy()
            proj = name.split(".")[-2]
            if spec.arch == "llama" and proj in ("q_proj", "k_proj"):
                array = llama_cpp_permute(array, spec.heads if proj == "q_proj" else spec.kv_heads)
            self._add_tensor(w, gguf_name(name), array, spec.qtype)
        for name, (array, qtype) in (extra_tensors or {}).items():
            w.add_tensor(name, array, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return weights

    @staticmethod
    def _add_tensor(w: gguf.GGUFWriter, name: str, array: np.ndarray, qtype) -> None:
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    def _write_metadata(self, w: gguf.GGUFWriter, spec: TinySpec) -> None:
        w.add_name("Tiny Test Model")
        w.add_block_count(spec.layers)
        w.add_context_length(256)
        w.add_embedding_length(spec.hidden)
        w.add_feed_forward_length(spec.inter)
        w.add_head_count(spec.heads)
        w.add_head_count_kv(spec.kv_heads)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        w.add_token_merges(self.merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    def write_hf_dir(self, folder: Path, spec: TinySpec) -> dict:
        """Write a HF-format folder; return its weights."""
        folder.mkdir(parents=True, exist_ok=True)
        weights = random_hf_weights(spec, self.vocab_size, seed=1)
        save_file(weights, str(folder / "model.safetensors"))
        config = {
            "architectures": ["Qwen2ForCausalLM" if spec.arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": spec.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.inter,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 50000.0,
            "tie_word_embeddings": spec.tie,
            "bos_token_id": 1,
            "eos_token_id": 0,
        }
        (folder / "config.json").write_text(json.dumps(config))
        self.bpe.save(str(folder / "tokenizer.json"))
        tok_config = {
            "bos_token": "<|im_start|>",
            "eos_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
        return weights
