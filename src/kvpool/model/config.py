"""Architecture description of a Llama-family model (Llama, SmolLM, Qwen2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """What the decoder needs to know about a model; built from GGUF metadata or config.json."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: dict | None = field(default=None, hash=False)  # HF "rope_scaling" (llama3 type)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)
