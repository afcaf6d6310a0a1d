"""Huge-page arenas for the weights and the KV cache (model/hugepages.py): alignment, the
kernel's advice really set on the mapping, copies in order, the switch, and a model whose
weights moved computing exactly what it computed before."""

from pathlib import Path

import pytest
import torch

from kvpool.model import hugepages
from kvpool.model.kernels import kernels
from kvpool.model.linear import BlockLinear
from kvpool.model.llama import LlamaModel

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process holding ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")
def test_empty_is_aligned_and_advised(monkeypatch):
    monkeypatch.delenv("KVPOOL_HUGEPAGES", raising=False)
    t = hugepages.empty(5 << 20)
    assert t.numel() == 5 << 20 and t.dtype == torch.uint8
    assert t.data_ptr() % hugepages.HUGE == 0
    assert "hg" in vm_flags(t.data_ptr()), "MADV_HUGEPAGE was not set on the arena"
    t.fill_(7)  # writable over its whole length
    assert int(t[-1]) == 7


def test_switch_off_gives_plain_memory(monkeypatch):
    monkeypatch.setenv("KVPOOL_HUGEPAGES", "0")

    def fail(*_):
        raise AssertionError("advised while switched off")

    monkeypatch.setattr(hugepages, "_madvise", fail)
    assert not hugepages.enabled()
    assert hugepages.empty(4 << 20).numel() == 4 << 20
    z = hugepages.zeros((3, 5), torch.int8)
    assert z.shape == (3, 5) and z.dtype == torch.int8 and not z.any()


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="positive"):
        hugepages.empty(0)


def test_zeros_is_zeroed_and_shaped(monkeypatch):
    monkeypatch.delenv("KVPOOL_HUGEPAGES", raising=False)
    real = hugepages.empty

    def dirty(n):  # memory that held something before (a reused heap block)
        return real(n).fill_(0x5A)

    monkeypatch.setattr(hugepages, "empty", dirty)
    monkeypatch.setattr(hugepages, "enabled", lambda: True)
    z = hugepages.zeros((256, 2, 16, 3, 68), torch.int8)  # 3.3 MB: the arena's path
    assert z.shape == (256, 2, 16, 3, 68) and z.is_contiguous() and not z.any()
    f = hugepages.zeros((2, 3), torch.float32)
    assert f.dtype == torch.float32 and f.sum() == 0


def test_arena_copies_in_order_on_cache_lines(monkeypatch):
    monkeypatch.delenv("KVPOOL_HUGEPAGES", raising=False)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(300, 17, generator=g), torch.randint(0, 255, (1001,), dtype=torch.uint8,
           generator=g), torch.empty(0, dtype=torch.float16),
           torch.randn(1 << 20, generator=g).half(), torch.randn(3, 1 << 18, generator=g)]  # fmt: skip
    arena = hugepages.Arena([hugepages.nbytes(t) for t in src])
    out = [arena.place(t) for t in src]
    ptrs = [t.data_ptr() for t in out if t.numel()]
    assert ptrs == sorted(ptrs)
    for a, b in zip(src, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if a.numel():
            assert b.is_contiguous() and b.data_ptr() % 64 == 0
            assert b.data_ptr() != a.data_ptr()
    src[0].zero_()  # copies, not views of the originals
    assert out[0].abs().sum() > 0


@pytest.mark.skipif(kernels() is None, reason="no C++ compiler for the kernels")
def test_model_on_arenas_computes_the_same(tiny_model, monkeypatch):
    """The q4 model with its weights moved into arenas gives the same hidden states and
    logits, bit for bit, as the one that kept torch's own tensors; the step's tensors lie in
    one arena in the order a decode step reads them."""
    from kvpool.model.attention import AttentionMetadata, PrefillSeq

    cfg = tiny_model.config

    def run(on: str):
        monkeypatch.setenv("KVPOOL_HUGEPAGES", on)
        model = LlamaModel(cfg, tiny_model.weights, torch.float32, "q4")
        kv = torch.zeros(8, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)
        ids = torch.tensor([5, 17, 99, 3, 42, 8, 61])
        pos = torch.arange(len(ids))
        table = torch.arange(0, 2)
        meta = AttentionMetadata(table[pos // 4], pos % 4, 0, None, None, None,
                                 [PrefillSeq(0, len(ids), 0, table, None)], kernels())  # fmt: skip
        hidden = model.forward(ids, pos, meta, kv)
        return model, hidden, model.logits(hidden[-1:])

    monkeypatch.setattr(hugepages, "enabled", lambda: True)  # whatever this kernel's THP mode
    moved, h1, l1 = run("1")
    monkeypatch.setattr(hugepages, "enabled", lambda: False)
    _, h0, l0 = run("0")
    assert torch.equal(h0, h1) and torch.equal(l0, l1)
    order = [lin for layer in moved.layers for lin in (layer.qkv, layer.o, layer.gate_up,
             layer.down)] + [moved.lm_head]  # fmt: skip
    blocks = [lin for lin in order if isinstance(lin, BlockLinear)]
    assert blocks, "the q4 model has block layers"
    ptrs = [t.data_ptr() for lin in blocks for t in lin.stream() if t.numel()]
    assert ptrs == sorted(ptrs), "the arena is not in the step's order"


def test_arena_refuses_more_than_its_room():
    a = hugepages.Arena([64, 64])
    a.place(torch.zeros(16))
    with pytest.raises(ValueError, match="full"):
        a.place(torch.zeros(40))


def test_enabled_follows_the_kernels_mode(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPOOL_HUGEPAGES", raising=False)
    mode = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "_THP", str(mode))
    assert not hugepages.enabled()  # no such file: no transparent huge pages
    for text, want in (("always [madvise] never", True), ("[always] madvise never", True),
                       ("always madvise [never]", False)):  # fmt: skip
        mode.write_text(text)
        assert hugepages.enabled() is want
    monkeypatch.setenv("KVPOOL_HUGEPAGES", "0")
    mode.write_text("[always] madvise never")
    assert not hugepages.enabled()
