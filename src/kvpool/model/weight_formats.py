"""Which linear layer each weight format builds (``EngineConfig.weights``).

- ``float32``: dense float weights through BLAS, exactly the file's values dequantized.
- ``q4``: the GGUF file's own 4-bit blocks (Q4_0/Q4_1, exact) for the layers, read at 0.625
  bytes per weight; tensors stored otherwise are quantized to q4 here, but the output head,
  which decides every token, is kept at 8 bits (the file's Q8_0 blocks, else quantized to q8).
- ``int8``: 8-bit blocks everywhere (q8: the file's Q8_0 blocks, else quantized here).

Decode-only steps of up to ``small_rows`` rows run the block kernel; larger ones run float32
BLAS on the dequantized weights, which is faster for them (``autotune.py`` measures the limit
per shape on this machine, reading the weights from memory as a decode step does). Steps with
prompt tokens run one path on every row, the faster of the two on a 512-row batch here
(``prompt_blocks``), or of the three where the CPU has AMX tiles (``prompt_amx``: the dense
copy packed in bfloat16 halves, ``kernels/amx.cpp``; quantized formats only), so a prompt's KV
and its prompt logprobs do not depend on how the scheduler cut it into chunks. The kernel's 16-bit activations keep its results within ~1e-5
of float32 arithmetic on the same weights, so with the file's own blocks the KV is the float32
model's either way (and shares its keys). ``auto`` is ``q4`` for a
GGUF file with 4-bit blocks, ``int8`` otherwise, and ``float32`` where the kernel does not
build, the dtype is not float32, the shapes do not cut into 32-blocks, or the block kernel is
not faster than BLAS even for one row.

fbgemm's dynamic int8 GEMM (``torch.ao``) was tried and dropped: its per-tensor 7-bit
activations raised this model's perplexity from 44.6 to 121 (the block kernel's per-block
8-bit activations: 44.7; docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from kvpool.common.errors import ModelLoadError
from kvpool.model.autotune import prompt_amx, prompt_blocks, small_rows
from kvpool.model.config import ModelConfig
from kvpool.model.linear import BlockLinear, DenseLinear
from kvpool.model.quant import GGUF_BLOCKS, QK, BlockWeights, cat_rows, from_gguf_blocks, quantize

logger = logging.getLogger(__name__)

FORMATS = ("float32", "q4", "int8")
_KIND = {"q4": "q4", "int8": "q8"}


def resolve(fmt: str, cfg: ModelConfig, dtype: torch.dtype, source: str | None) -> str:
    """The format ``fmt`` stands for (``auto`` decided here, see the module docstring)."""
    if fmt != "auto":
        return fmt
    from kvpool.model.kernels import kernels

    mod = kernels()
    if mod is None or dtype != torch.float32 or not _blockable(cfg):
        return "float32"
    h, inter = cfg.hidden_size, cfg.intermediate_size
    if small_rows(mod, "q4", h, 2 * inter) < 1:
        return "float32"
    gguf = source is not None and Path(source).is_file() and _has_q4_blocks(Path(source))
    return "q4" if gguf else "int8"


def _blockable(cfg: ModelConfig) -> bool:
    return cfg.hidden_size % QK == 0 and cfg.intermediate_size % QK == 0 and \
        (cfg.num_heads * cfg.head_dim) % QK == 0  # fmt: skip


def _has_q4_blocks(path: Path) -> bool:
    from gguf import GGUFReader

    try:
        return any(GGUF_BLOCKS.get(t.tensor_type, ("",))[0] == "q4"
                   for t in GGUFReader(path).tensors)  # fmt: skip
    except (ValueError, OSError):
        return False


class LinearFactory:
    """Builds the linear layers of one model in one weight format."""

    def __init__(self, fmt: str, weights: dict[str, torch.Tensor], cfg: ModelConfig,
                 dtype: torch.dtype, source: str | None = None) -> None:  # fmt: skip
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.w, self.cfg, self.dtype = fmt, weights, cfg, dtype
        # every block is the file's own: the model computes what the float32 one does (to
        # float rounding), so its KV is the float32 model's and shares its keys
        self.exact = True
        self.kernels = None
        self.blocks: dict[str, BlockWeights] = {}
        if fmt == "float32":
            return
        if dtype != torch.float32:
            raise ModelLoadError(f"weights={fmt!r} computes in float32; use dtype float32")
        if not _blockable(cfg):
            raise ModelLoadError(f"weights={fmt!r} needs layer sizes that are multiples of "
                                 f"{QK}; use weights='float32'")  # fmt: skip
        from kvpool.model.kernels import last_error, quant_kernels

        self.kernels = quant_kernels()
        if self.kernels is None:
            why = last_error.get("kvpool_kernels", "unknown")
            raise ModelLoadError(f"weights={fmt!r} needs the compiled qgemm kernel ({why}); "
                                 "use weights='float32'")  # fmt: skip
        if source is not None and Path(source).is_file():
            self.blocks = gguf_blocks(Path(source), cfg)

    def _take(self, name: str, kind: str) -> BlockWeights:
        """The file's own blocks of ``name`` if they are of ``kind``, else quantized here
        (which makes the model another one: ``exact`` turns false)."""
        bw = self.blocks.get(name)
        if bw is not None and bw.kind == kind:
            return bw
        self.exact = False
        return quantize(self.w[name], kind)

    def dense(self, names: list[str], bias: list[str] | None = None):
        """The layer computing the rows of ``names`` stacked (fused q/k/v, gate/up)."""
        w = torch.cat([self.w[n] for n in names]) if len(names) > 1 else self.w[names[0]]
        b = torch.cat([self.w[n] for n in bias]) if bias else None
        large = DenseLinear(w, b)
        if self.fmt == "float32":
            return self._tiles(large, None)
        parts = [self._take(n, _KIND[self.fmt]) for n in names]
        return self._blocks(cat_rows(parts), b, large)

    def _tiles(self, large: DenseLinear, kind: str | None) -> DenseLinear:
        """``large`` with its prompt steps on AMX tiles where they run faster here (float32
        weights only: the tiles take float32 operands)."""
        if self.dtype != torch.float32:
            return large
        n, k = large.w_t.shape[1], large.w_t.shape[0]
        if self.amx_kernels is not None and prompt_amx(self.amx_kernels, kind, k, n):
            large.with_amx(self.amx_kernels)
        return large

    @functools.cached_property
    def amx_kernels(self) -> ModuleType | None:
        """The compiled kernels, for AMX prompt steps (None where they did not build)."""
        from kvpool.model.kernels import kernels

        return kernels()

    def _blocks(
        self, bw: BlockWeights, bias, large: DenseLinear, tiles: bool = True
    ) -> BlockLinear:
        n, k = bw.shape
        rows = small_rows(self.kernels, bw.kind, k, n)
        prompt = prompt_blocks(self.kernels, bw.kind, k, n)
        if tiles and self._tiles(large, bw.kind).amx is not None:
            prompt = False  # prompt steps go to the dense layer, on tiles
        return BlockLinear(bw, self.kernels, bias, large, rows, prompt)

    def head(self, name: str):
        """The output head (vocabulary x hidden), at 8 bits in both quantized formats; never on
        AMX tiles (a prompt step computes logits for a few rows only)."""
        large = DenseLinear(self.w[name])
        if self.fmt == "float32":
            return large
        return self._blocks(self._take(name, "q8"), None, large, tiles=False)


def gguf_blocks(path: Path, cfg: ModelConfig) -> dict[str, BlockWeights]:
    """The GGUF tensors stored in block formats taken as they are (``quant.GGUF_BLOCKS``),
    under their Hugging Face names (Q and K rows un-permuted as ``gguf_loader`` does)."""
    from gguf import GGUFReader

    from kvpool.model.gguf_loader import hf_tensor_name, read_metadata, unpermute_rope

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        logger.info("%s is not a GGUF file (%s): weights are quantized here", path, exc)
        return {}
    arch = read_metadata(reader).get("general.architecture", "llama")
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    out: dict[str, BlockWeights] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None or t.tensor_type not in GGUF_BLOCKS:
            continue
        bw = from_gguf_blocks(t.data, t.tensor_type)
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            bw = bw.rows(unpermute_rope(torch.arange(bw.shape[0]).numpy(), heads[proj]))
        out[name] = bw
    logger.info("%d block tensors of %s taken as they are", len(out), path.name)
    return out
