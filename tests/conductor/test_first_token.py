"""When the conductor streams the prefill's first token itself, and when it leaves it to the
decode worker (the cluster e2e test runs the path for real)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tokenizers
from conftest import tiny_tokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvpool.conductor.api import Conductor, Parsed
from kvpool.model.tokenizer import Tokenizer
from kvpool.protocol.decode import DecodeRequest


class Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


def conductor(tok) -> SimpleNamespace:
    return SimpleNamespace(tok=tok, _concatenative=tok.concatenative, model_name="m",
                           metrics=SimpleNamespace(first_from_prefill=Count()))  # fmt: skip


def opening(c, params: dict, first: list | None, kind: str = "chat"):
    parsed = Parsed([1, 2, 3], kind, params, True, True, int(params.get("max_tokens") or 16))
    decode = DecodeRequest("d", kind, [1, 2, 3], params, True)
    return Conductor._first_from_prefill(c, parsed, first, decode), decode


def test_a_greedy_stream_gets_its_first_token_at_once():
    tok = tiny_tokenizer()
    c = conductor(tok)
    t1 = tok.encode("H")[0]
    chunks, decode = opening(c, {"temperature": 0, "max_tokens": 8}, [t1])
    assert len(chunks) == 2 and all(x.startswith("data: ") for x in chunks)
    assert '"role":"assistant"' in chunks[0] and '"content":"H"' in chunks[1]
    assert decode.first_token == t1 and decode.response_id.startswith("chatcmpl-")
    assert DecodeRequest.from_wire(decode.to_wire()) == decode  # what the worker is sent
    assert c.metrics.first_from_prefill.n == 1


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"temperature": 0.7, "max_tokens": 8}, "sampled"),
        ({"temperature": 0, "max_tokens": 1}, "nothing left to decode"),
        ({"temperature": 0, "max_tokens": 8, "stop": ["H"]}, "a stop string"),
        ({"temperature": 0, "max_tokens": 8, "stop_token_ids": [5]}, "stop ids"),
        ({"temperature": 0, "max_tokens": 8, "n": 2}, "several answers"),
        ({"temperature": 0, "max_tokens": 8, "logprobs": 0}, "logprobs"),
    ],
)
def test_other_requests_take_the_plain_path(params, why):
    tok = tiny_tokenizer()
    c = conductor(tok)
    chunks, decode = opening(c, params, [tok.encode("H")[0]])
    assert chunks == [] and decode.first_token is None, why
    assert c.metrics.first_from_prefill.n == 0


@pytest.mark.parametrize("what", ["echo", "more prompts"])
def test_echo_and_several_prompts_take_the_plain_path(what):
    tok = tiny_tokenizer()
    c = conductor(tok)
    params = {"temperature": 0, "max_tokens": 8}
    parsed = Parsed([1, 2, 3], "completion", params, True, True, 8, echo=what == "echo",
                    more_ids=[[4, 5]] if what == "more prompts" else [])  # fmt: skip
    decode = DecodeRequest("d", "completion", [1, 2, 3], params, True)
    assert Conductor._first_from_prefill(c, parsed, [tok.encode("H")[0]], decode) == []
    assert decode.first_token is None


def test_prompt_logprobs_and_several_prompts_are_computed_by_the_decode_worker():
    plain = Parsed([1], "completion", {"n": 1}, False, False, 4)
    assert not plain.computes_on_decode
    assert Parsed([1], "completion", {"prompt_logprobs": 0}, False, False, 4).computes_on_decode
    assert Parsed([1], "completion", {}, False, False, 4, more_ids=[[2]]).computes_on_decode


def test_eos_a_partial_character_or_no_token_take_the_plain_path():
    tok = tiny_tokenizer()
    c = conductor(tok)
    greedy = {"temperature": 0, "max_tokens": 8}
    assert opening(c, greedy, [tok.eos_token_ids[0]])[0] == []
    é = tok.encode("é")  # two byte-level tokens: the first alone is not text
    assert len(é) == 2 and opening(c, greedy, [é[0]])[0] == []
    assert opening(c, greedy, None)[0] == [] and opening(c, greedy, [])[0] == []


def test_a_tokenizer_whose_decoding_depends_on_neighbours_takes_the_plain_path():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([1, 2]) != tok.decode([1]) + tok.decode([2])  # why it matters
    assert not tok.concatenative and tiny_tokenizer().concatenative
    assert opening(conductor(tok), {"temperature": 0, "max_tokens": 8}, [1])[0] == []
