"""Tokenizer built from GGUF metadata, chat templates and incremental detokenization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tiny_models import CHAT_TEMPLATE, TinyModels, TinySpec

from kvpool.common.errors import BadRequestError
from kvpool.model.gguf_loader import open_gguf, read_metadata
from kvpool.model.gguf_tokenizer import build_gguf_tokenizer
from kvpool.model.tokenizer import IncrementalDetokenizer, Tokenizer, stop_token_ids

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello  world!\n\n  indented\ttab",
    "def add(a, b):\n    return a + b\n",
    "Numbers 1234567890 and 3.14159",
    "Unicode: héllo wörld, 你好世界, emoji 😀 👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    "   ",
]
STREAM_TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界！我们今天学习中文。",
    "Emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧‍👦 done.",
    "Mixed: naïve café — 東京 🗼 and code `x = 1`\n\n",
    "ZWJ and combining: e\u0301 a\u0308 ñ",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModels) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())
    return build_gguf_tokenizer(read_metadata(open_gguf(path)))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_reference(
    gguf_tokenizer: Tokenizer, tiny_bpe: tokenizers.Tokenizer, text: str
) -> None:
    expected = tiny_bpe.encode(text).ids
    assert gguf_tokenizer.encode(text) == expected
    assert gguf_tokenizer.decode(expected, skip_special_tokens=False) == text


def test_special_tokens(gguf_tokenizer: Tokenizer) -> None:
    ids = gguf_tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert gguf_tokenizer.decode(ids) == "hi"
    assert gguf_tokenizer.vocab_size == 400
    assert gguf_tokenizer.bos_token_id == 1
    assert gguf_tokenizer.eos_token_ids == (0, 2)
    assert gguf_tokenizer.encode("hi", add_special_tokens=True) == gguf_tokenizer.encode("hi")


def test_add_bos_token(tiny_bpe: tokenizers.Tokenizer) -> None:
    tok = Tokenizer(tiny_bpe, bos_token_id=1, eos_token_ids=(0,), add_bos_token=True)
    plain = tok.encode("hello")
    assert tok.encode("hello", add_special_tokens=True) == [1, *plain]
    assert tok.encode("<|im_start|>hello", add_special_tokens=True) == [1, *plain]


def test_stop_token_ids(tiny_bpe: tokenizers.Tokenizer) -> None:
    assert stop_token_ids(tiny_bpe, [0, None], CHAT_TEMPLATE) == (0, 2)
    assert stop_token_ids(tiny_bpe, [2], CHAT_TEMPLATE) == (2,)
    assert stop_token_ids(tiny_bpe, [0], None) == (0,)


def test_chat_template(gguf_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert gguf_tokenizer.chat_template == CHAT_TEMPLATE
    rendered = gguf_tokenizer.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_chat_template_features(tiny_bpe: tokenizers.Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ eos_token }}"
    )
    tok = Tokenizer(tiny_bpe, bos_token_id=1, eos_token_ids=(2,), chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert out == '<|im_start|>{"role": "user", "content": "<é>"}<|im_end|>'
    with pytest.raises(BadRequestError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny_bpe).apply_chat_template([])


def test_sandbox_blocks_attribute_access(tiny_bpe: tokenizers.Tokenizer) -> None:
    tok = Tokenizer(tiny_bpe, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(BadRequestError):
        tok.apply_chat_template([])


def test_real_tokenizer_splits_digits_like_llama_cpp(real_tokenizer: Tokenizer) -> None:
    """SmolLM2's pre-tokenizer ('smollm') splits digits one by one before the GPT-2 regex."""
    ids = real_tokenizer.encode("a  1 x12")
    assert [real_tokenizer.token_text(i) for i in ids] == ["a", "ĠĠ", "1", "Ġx", "1", "2"]


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.push(ids[pos:]))
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_one_by_one(real_tokenizer: Tokenizer, text: str) -> None:
    ids = real_tokenizer.encode(text)
    deltas = _stream(real_tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == real_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_random_chunks(real_tokenizer: Tokenizer) -> None:
    text = " ".join(STREAM_TEXTS)
    ids = real_tokenizer.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        chunks = [rng.randint(0, 4) for _ in range(len(ids))]
        assert "".join(_stream(real_tokenizer, ids, chunks)) == text


def test_incremental_detokenizer_with_prompt_and_specials(real_tokenizer: Tokenizer) -> None:
    prompt = real_tokenizer.encode("<|im_start|>user\nSay 你好<|im_end|>\n<|im_start|>assistant\n")
    output = real_tokenizer.encode("你好 😀!<|im_end|>")
    for skip in (True, False):
        deltas = _stream(
            real_tokenizer, output, [1] * len(output), prompt_ids=prompt, skip_special_tokens=skip
        )
        assert "".join(deltas) == real_tokenizer.decode(output, skip_special_tokens=skip)


def test_incremental_detokenizer_holds_incomplete_utf8(real_tokenizer: Tokenizer) -> None:
    ids = real_tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(real_tokenizer)
    partial = ids[:-1]  # the emoji's bytes span several byte-level tokens
    assert real_tokenizer.decode(partial).endswith("\ufffd")
    assert "\ufffd" not in "".join(detok.push([i]) for i in partial)
    tail = detok.finish()
    assert detok.text == real_tokenizer.decode(partial) and tail.endswith("\ufffd")


def test_incremental_detokenizer_decodes_small_windows(real_tokenizer: Tokenizer) -> None:
    sizes: list[int] = []
    decode = real_tokenizer.decode

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[override]
            sizes.append(len(ids))
            return decode(ids, skip_special_tokens)

    spy = Spy(real_tokenizer.backend)
    prompt = real_tokenizer.encode("A prompt of a few words to start with. " * 5)
    ids = real_tokenizer.encode(" ".join(STREAM_TEXTS) * 10)
    detok = IncrementalDetokenizer(spy, prompt_ids=prompt)
    for i in ids:
        detok.push([i])
    assert detok.text == real_tokenizer.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 12


def test_gguf_metadata_file(tmp_path: Path, tiny: TinyModels) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())
    meta = read_metadata(open_gguf(path))
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert meta["tokenizer.ggml.add_bos_token"] is False
