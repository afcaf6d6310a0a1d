"""vLLM KV events as kvpool block hashes, over a real ZeroMQ PUB socket and vLLM's wire shape
(msgpack ``[ts, events, dp_rank]`` with tagged event maps, in ``(topic, seq, payload)``
frames; ``tests/integrations/vllm/test_vllm_conductor.py`` runs real vLLM publishers), plus
the spec parser, the metrics parser and the bodies vLLM servers get."""

from __future__ import annotations

import json
import threading
import time

import msgpack
import pytest

from kvpool.common.hashing import block_hashes, namespace_seed
from kvpool.conductor.vllm import (
    EventSubscriber,
    KVEventsView,
    VllmSpec,
    folder_namespace,
    parse_metrics,
)
from kvpool.conductor.vllm_relay import vllm_body

zmq = pytest.importorskip("zmq")
SEED = namespace_seed("test-ns")


def stored(hashes, parent, tokens, size=32, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size, "lora_id": None, "medium": "GPU",
            "lora_name": None, **extra}  # fmt: skip


def batch(*events) -> bytes:
    return msgpack.packb([time.time(), list(events), 0], use_bin_type=True)


def test_stored_blocks_become_the_chain_hashes_of_their_16_token_sub_blocks():
    tokens = list(range(100, 196))  # three 32-token vLLM blocks
    want = block_hashes(tokens, 16, SEED)
    view = KVEventsView(SEED)
    # the first two in one event, the third in a later one naming its parent
    assert view.apply_frame(0, batch(stored([b"a" * 32, b"b" * 32], None, tokens[:64])))
    assert view.apply_frame(1, batch(stored([7], b"b" * 32, tokens[64:])))
    assert view.cached == frozenset(want)
    view.apply_frame(2, batch({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}))
    assert view.cached == frozenset(want[:4])
    view.apply_frame(3, batch({"type": "AllBlocksCleared"}))
    assert view.cached == frozenset()
    assert view.gaps == 0 and view.ignored == 0
    assert not view.apply_frame(3, batch(stored([9], None, tokens[:32])))  # seen: skipped
    assert view.cached == frozenset()


def test_blocks_that_cannot_be_compared_are_ignored_not_guessed():
    tokens = list(range(32))
    view = KVEventsView(SEED)
    view.apply_frame(0, batch(
        stored([1], None, tokens, lora_name="adapter"),  # salted by a LoRA
        stored([2], None, tokens, extra_keys=[["salt"]]),  # a cache salt
        stored([3], b"never-seen", tokens),  # its parent was missed
        stored([4], None, tokens[:20], size=20),  # not a multiple of 16
        stored([5], None, tokens[:31]),  # token count does not match
        {**stored([6], None, tokens), "medium": "CPU"},  # an offloading tier, not the cache
    ))  # fmt: skip
    assert view.cached == frozenset()
    assert view.ignored == 5
    view.apply_frame(5, b"\xc1 not msgpack")  # malformed: logged, skipped
    assert view.gaps == 4 and view.cached == frozenset()


def test_a_block_shared_by_two_vllm_blocks_stays_until_both_are_removed():
    tokens = list(range(32))
    view = KVEventsView(SEED)
    view.apply_frame(0, batch(stored([1], None, tokens), stored([2], None, tokens)))
    view.apply_frame(1, batch({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}))
    assert view.cached == frozenset(block_hashes(tokens, 16, SEED))
    view.apply_frame(2, batch({"type": "BlockRemoved", "block_hashes": [2], "medium": None}))
    assert view.cached == frozenset()


def _publisher(tmp_path):
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/pub")
    router.bind(f"ipc://{tmp_path}/replay")
    return pub, router


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_subscriber_replays_what_it_missed_then_follows_the_live_stream(tmp_path):
    tokens = list(range(1000, 1128))  # four vLLM blocks
    frames = [batch(stored([i], i - 1 if i else None, tokens[32 * i : 32 * i + 32]))
              for i in range(4)]  # fmt: skip
    pub, router = _publisher(tmp_path)
    stop = threading.Event()

    def serve_replay():  # what vLLM's ZmqEventPublisher does with its buffer
        while not stop.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                for seq in range(int.from_bytes(start, "big"), 2):  # it holds batches 0 and 1
                    router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), frames[seq]])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    t = threading.Thread(target=serve_replay, daemon=True)
    t.start()
    view = KVEventsView(SEED)
    sub = EventSubscriber(f"ipc://{tmp_path}/pub", view, f"ipc://{tmp_path}/replay").start()
    try:
        assert _wait(lambda: view.last_seq == 1), "the replay did not arrive"
        want = block_hashes(tokens, 16, SEED)
        assert view.cached == frozenset(want[:4])
        # live: PUB drops what is sent before the subscription lands, so send until it is seen
        assert _wait(lambda: (pub.send_multipart([b"", (2).to_bytes(8, "big"), frames[2]]),
                              view.last_seq >= 2)[1])  # fmt: skip
        pub.send_multipart([b"", (3).to_bytes(8, "big"), frames[3]])
        assert _wait(lambda: view.last_seq == 3)
        assert view.cached == frozenset(want) and view.gaps == 0
        assert sub.received == 4
    finally:
        sub.close()
        stop.set()
        t.join(2)
        pub.close(0)
        router.close(0)


def test_spec_parsing():
    s = VllmSpec.parse("http://10.0.0.5:8100,role=prefill,events=tcp://10.0.0.5:5557")
    assert (s.address, s.role, s.events, s.replay) == ("10.0.0.5:8100", "prefill",
                                                       "tcp://10.0.0.5:5557", None)  # fmt: skip
    assert VllmSpec.parse("127.0.0.1:8000").role == "both"
    for bad in ("", "8000", "host:x", "h:1,role=boss", "h:1,colour=red", "h:1,replay=ipc://r",
                "role=both", "h:70000"):  # fmt: skip
        with pytest.raises(ValueError):
            VllmSpec.parse(bad)


def test_metrics_parsing_sums_label_sets_and_skips_comments():
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.25\nnot a metric line\n'
            'vllm:num_requests_waiting 1\n')  # fmt: skip
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 5.0
    assert m["vllm:kv_cache_usage_perc"] == 0.25 and m["vllm:num_requests_waiting"] == 1.0


def test_vllm_bodies_keep_the_request_and_cut_a_prefill_to_one_token():
    body = json.dumps({"model": "ours", "prompt": [1, 2], "max_tokens": 50, "stream": True,
                       "stream_options": {"include_usage": True}, "min_tokens": 5,
                       "temperature": 0.7}).encode()  # fmt: skip
    relayed = json.loads(vllm_body(body, "/models/smollm2-hf"))
    assert relayed == {**json.loads(body), "model": "/models/smollm2-hf"}
    pre = json.loads(vllm_body(body, "m", prefill=True))
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["n"] == 1
    assert "stream_options" not in pre and "min_tokens" not in pre
    assert pre["prompt"] == [1, 2] and pre["temperature"] == 0.7


def test_folder_namespace_matches_the_engines_and_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "num_hidden_layers": 30}))  # fmt: skip
    ns, block_bytes = folder_namespace(tmp_path, "float32")
    assert ns.endswith("|kv-v1|float32|bs16|L30|H3|D64")
    assert block_bytes == 2 * 30 * 16 * 3 * 64 * 4
    with pytest.raises(ValueError, match="dtype"):
        folder_namespace(tmp_path, "int4")
    with pytest.raises(ValueError, match=r"config\.json"):
        folder_namespace(tmp_path / "missing", "float32")
