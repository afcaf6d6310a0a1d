"""Build a ``Tokenizer`` from the tokenizer a GGUF file describes in its metadata.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, merges, token types and special ids
under llama.cpp's key names. Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2,
Llama 3, Qwen2, ...) is supported. How text is split before BPE depends on
``tokenizer.ggml.pre``; we follow llama.cpp's table so ids equal the original ``tokenizer.json``.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from kvpool.common.errors import ModelLoadError
from kvpool.model.tokenizer import Tokenizer, stop_token_ids

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are matched whole in text

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, whether merges are skipped for whole-vocabulary words)
_SPLIT_PRE = {
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "dbrx": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}
# Digits split one by one, then the GPT-2 regex (llama.cpp groups these together).
_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
_NFC_PRE = {"qwen2", "deepseek-r1-qwen"}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_PRE[pre][0]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2's split", pre)
    return gpt2


def _vocab(tokens: list[str], types: list[int]) -> tuple[dict[str, int], list[AddedToken]]:
    """Vocabulary keyed the way byte-level BPE spells tokens, and the tokens matched whole."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        key = token
        if kind in (_CONTROL, _USER_DEFINED):
            added.append(AddedToken(token, special=kind == _CONTROL, normalized=False))
        elif not set(token) <= alphabet:
            key = "".join(spelling[b] for b in token.encode("utf-8"))
        if key in vocab:
            logger.warning("GGUF vocabulary repeats token %r (ids %d, %d)", key, vocab[key], index)
            continue
        vocab[key] = index
    return vocab, added


def build_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` described by GGUF metadata ``meta``."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2', "
            "as in SmolLM2, Llama 3 and Qwen2 files) is. Load the Hugging Face folder instead."
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    pre = meta.get("tokenizer.ggml.pre")
    vocab, added = _vocab(tokens, types)
    ignore_merges = _SPLIT_PRE.get(pre, ("", False))[1]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if pre in _NFC_PRE:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([t for t in added if not t.special])
    backend.add_special_tokens([t for t in added if t.special])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelLoadError(
            f"GGUF tokenizer has {len(tokens)} tokens but rebuilding it gave "
            f"{backend.get_vocab_size(with_added_tokens=True)}"
        )
    return backend


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Our ``Tokenizer`` (ids, special tokens, chat template) from GGUF metadata."""
    backend = build_backend(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_text = backend.id_to_token(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, bos)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    template = meta.get("tokenizer.chat_template")
    declared = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=stop_token_ids(backend, declared, template),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        chat_template=template,
        add_bos_token=add_bos,
    )
