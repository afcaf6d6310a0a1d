"""The prefill-to-decode hand-off messages: typed, checked when decoded."""

from __future__ import annotations

import pytest

from kvpool.common.errors import ProtocolError
from kvpool.common.rpc import pack, unpack
from kvpool.protocol.decode import DecodeRequest, HandleBlock, HandleTail, KVHandle

HANDLE = KVHandle("kv-abc", "owner1", 4096, (HandleBlock(0, 7, b"\x01" * 16, 123),
                                              HandleBlock(1, 9, b"\x02" * 16, 2**63)))  # fmt: skip


def test_round_trip():
    req = DecodeRequest("r1", "chat", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0},
                        True, True, 2, HANDLE)  # fmt: skip
    back = DecodeRequest.from_wire(unpack(pack(req.to_wire())))
    assert back == req and back.kv_handle.by_index()[1].block_id == 9
    bare = DecodeRequest("r2", "completion", [5], {})
    assert DecodeRequest.from_wire(bare.to_wire()) == bare
    going_on = DecodeRequest("r3", "chat", [5], {"max_tokens": 4}, True, first_token=11,
                             response_id="chatcmpl-1", created=1700000000)  # fmt: skip
    assert DecodeRequest.from_wire(unpack(pack(going_on.to_wire()))) == going_on
    wide = DecodeRequest("r4", "completion", [5, 6], {"n": 3, "logprobs": 1},
                         more_token_ids=[[7], [8, 9]], echo=True, prompt_only=True)  # fmt: skip
    assert DecodeRequest.from_wire(unpack(pack(wide.to_wire()))) == wide
    tailed = DecodeRequest("r5", "chat", [1, 2, 3], {}, kv_handle=KVHandle(
        "kv-abc", "owner1", 4096, HANDLE.blocks, HandleTail(2, 11, 3, 2**64 - 1)))  # fmt: skip
    assert DecodeRequest.from_wire(unpack(pack(tailed.to_wire()))) == tailed
    old = bare.to_wire()  # from a conductor that knows none of these fields
    for key in ("more_token_ids", "echo", "prompt_only"):
        del old[key]
    assert DecodeRequest.from_wire(old) == bare


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(kind="embeddings"),
        lambda d: d.update(token_ids=[]),
        lambda d: d.update(token_ids=["a"]),
        lambda d: d.update(request_id=""),
        lambda d: d.update(params=[1]),
        lambda d: d.update(cached_tokens=-1),
        lambda d: d["kv_handle"].update(block_bytes=0),
        lambda d: d["kv_handle"].update(segment=""),
        lambda d: d["kv_handle"].update(blocks=[[0, 1, "zz", 5]]),
        lambda d: d["kv_handle"].update(blocks=[[0, -1, "00", 5]]),
        lambda d: d["kv_handle"].update(blocks=[[0, 1, "00"]]),
        lambda d: d.update(kv_handle="here"),
        lambda d: d["kv_handle"].update(tail=[2, 11, 0, 5]),  # a tail of no tokens
        lambda d: d["kv_handle"].update(tail=[2, 11, 3]),
        lambda d: d["kv_handle"].update(tail=[2, -1, 3, 5]),
        lambda d: d["kv_handle"].update(tail=[2, True, 3, 5]),
        lambda d: d["kv_handle"].update(tail={"index": 2}),
        lambda d: d.update(first_token=3, response_id="c", created=1),  # not a stream
        lambda d: d.update(stream=True, first_token=3),  # no id and time to go on with
        lambda d: d.update(stream=True, first_token=-3, response_id="c", created=1),
        lambda d: d.update(stream=True, first_token=True, response_id="c", created=1),
        lambda d: d.update(stream=True, first_token=3, response_id="", created=1),
        lambda d: d.update(stream=True, first_token=3, response_id="c", created="now"),
        lambda d: d.update(more_token_ids=[[1]]),  # several prompts: completions only
        lambda d: d.update(kind="completion", more_token_ids=[[]]),
        lambda d: d.update(kind="completion", more_token_ids=[["a"]]),
        lambda d: d.update(kind="completion", more_token_ids=[1, 2]),
        lambda d: d.update(kind="completion", more_token_ids=[[1]] * 200),
        lambda d: d.update(echo="yes"),
        lambda d: d.update(prompt_only=True),  # without echo
    ],
)
def test_malformed_is_a_protocol_error(change):
    wire = DecodeRequest("r1", "chat", [1], {}, kv_handle=HANDLE).to_wire()
    change(wire)
    with pytest.raises(ProtocolError):
        DecodeRequest.from_wire(wire)
