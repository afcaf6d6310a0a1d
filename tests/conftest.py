"""Shared fixtures: a tiny random-weight Llama with a byte-level tokenizer (fast unit tests)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from kvpool.model.tokenizer import Tokenizer

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eos = backend.token_to_id("<|im_end|>")
    return Tokenizer(backend, eos_token_ids=[eos], chat_template=CHATML)


def tiny_loaded_model(seed: int = 0, layers: int = 2, max_pos: int = 512):
    """A random-weight 2-layer Llama (GQA 4/2 heads) with HF parameter names."""
    from kvpool.model.config import ModelConfig
    from kvpool.model.loader import LoadedModel

    tok = tiny_tokenizer()
    vocab, hidden, inter = tok.vocab_size, 64, 128
    cfg = ModelConfig(
        name="tiny-llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_pos,
        eos_token_ids=tok.eos_token_ids,
    )
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {
        "model.embed_tokens.weight": rnd(vocab, hidden, scale=0.5),
        "model.norm.weight": 1 + rnd(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(64, hidden)
        w[p + "self_attn.k_proj.weight"] = rnd(32, hidden)
        w[p + "self_attn.v_proj.weight"] = rnd(32, hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, 64)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        w[p + "input_layernorm.weight"] = 1 + rnd(hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden)
    return LoadedModel(
        config=cfg, weights=w, tokenizer=tok, fingerprint=f"tiny-{seed}", path="<random>"
    )


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_loaded_model()


@pytest.fixture
def tiny_engine_factory(tiny_model):
    """Build an LLMEngine on the tiny model with any EngineConfig overrides."""
    from kvpool.config import EngineConfig
    from kvpool.engine.llm_engine import LLMEngine

    engines = []

    def make(connector=None, **overrides):
        cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 128, **overrides})
        eng = LLMEngine(cfg, tiny_model, connector)
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.close()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """A real etcd server for the whole session (``.endpoint`` is ``127.0.0.1:PORT``)."""
    from support.etcd import EtcdProcess

    server = EtcdProcess(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()
