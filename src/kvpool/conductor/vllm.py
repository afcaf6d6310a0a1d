"""vLLM servers behind the conductor: their KV events as kvpool block hashes, their load from
``/metrics``, and the namespace of the pool objects their ``KVPoolConnector`` writes.

A vLLM instance is named by ``HOST:PORT[,role=both|prefill|decode][,events=ENDPOINT]
[,replay=ENDPOINT]`` (``VllmSpec.parse``): its OpenAI server, the ZeroMQ endpoint of its
``--kv-events-config`` publisher and, optionally, that publisher's replay endpoint. The
conductor subscribes to the events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
msgpack in ``(topic, seq, payload)`` frames) and turns each stored vLLM block into the kvpool
chain hashes of its 16-token sub-blocks: a ``BlockStored`` carries its token ids and its
parent's hash, so the chain continues from the parent's last kvpool hash. That makes a vLLM
instance's prefix cache comparable with the conductor's request hashes and with kvpool
workers' caches, and the cache-aware policy routes over both unchanged. Blocks whose hash
mixes in more than tokens (LoRA, multimodal inputs, a cache salt) are not comparable and are
ignored; so are events of other media (CPU/disk offloading tiers).

Events are a hint, as every block hash is (DESIGN.md §3): a missed event (the conductor
started late, the publisher dropped a batch) makes the view stale, never a wrong answer. With a
replay endpoint, the subscriber asks for what it missed (from sequence 0 when it starts, from
the gap when it sees one); without one it counts the gap and goes on.

Nothing here imports vLLM: the conductor runs in kvpool's environment.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack

from kvpool.common.errors import UnavailableError
from kvpool.common.hashing import hash_block, kv_namespace, namespace_seed
from kvpool.conductor.cluster_state import WorkerLoad

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
_GPU_MEDIA = (None, "GPU", "gpu")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True, slots=True)
class VllmSpec:
    """One vLLM OpenAI server as the conductor reaches it."""

    address: str  # host:port of its OpenAI server
    role: str = "both"
    events: str | None = None  # ZeroMQ endpoint of its KV-events publisher
    replay: str | None = None  # that publisher's replay endpoint

    @classmethod
    def parse(cls, text: str) -> VllmSpec:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or "=" in parts[0]:
            raise ValueError(f"vLLM spec {text!r}: expected HOST:PORT[,role=..][,events=..]")
        address = parts[0].removeprefix("http://").rstrip("/")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"vLLM spec {text!r}: {address!r} is not HOST:PORT")
        opts: dict[str, str] = {}
        for p in parts[1:]:
            key, sep, value = p.partition("=")
            if not sep or key not in ("role", "events", "replay") or not value:
                raise ValueError(f"vLLM spec {text!r}: unknown option {p!r} "
                                 "(role=, events=, replay=)")  # fmt: skip
            opts[key] = value
        role = opts.get("role", "both")
        if role not in ROLES:
            raise ValueError(f"vLLM spec {text!r}: role must be one of {', '.join(ROLES)}")
        if "replay" in opts and "events" not in opts:
            raise ValueError(f"vLLM spec {text!r}: replay= needs events=")
        return cls(address, role, opts.get("events"), opts.get("replay"))


def folder_namespace(folder: str | Path, dtype: str, kv_block: int = 16) -> tuple[str, int]:
    """The pool namespace ``KVPoolConnector`` writes for the model in ``folder`` (a Hugging
    Face folder, e.g. from ``kvpool export-hf``) at ``dtype`` -- the same string its
    ``pool_namespace`` builds from vLLM's config, so the conductor finds the same objects --
    and the bytes of one pool block."""
    from kvpool.model.loader import folder_fingerprint, kv_dims

    path = Path(folder)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from None
    layers, kv_heads, head_dim = kv_dims(config.get)
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"vLLM dtype {dtype!r}: one of {', '.join(_DTYPE_BYTES)}")
    ns = kv_namespace(folder_fingerprint(str(path)), dtype=dtype, block_size=kv_block,
                      num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    return ns, 2 * layers * kv_block * kv_heads * head_dim * _DTYPE_BYTES[dtype]


class KVEventsView:
    """One vLLM instance's cached blocks, as kvpool chain hashes. Batches are applied on the
    subscriber's thread; ``cached`` (a frozenset, never changed) is rebuilt only when read
    after a change, so a server publishing every step costs one set per poll, not per step."""

    def __init__(self, seed: bytes, kv_block: int = 16) -> None:
        self.seed, self.kv_block = seed, kv_block
        self._subs: dict[bytes | int, tuple[bytes, ...]] = {}  # vLLM hash -> its kvpool hashes
        self._count: dict[bytes, int] = {}  # kvpool hash -> vLLM blocks holding it
        self._cached: frozenset[bytes] = frozenset()
        self._stale = False
        self._lock = threading.Lock()  # the subscriber writes, the poller reads
        self.last_seq = -1
        self.gaps = 0  # batches known to be missed
        self.ignored = 0  # stored blocks not comparable (salted, unknown parent, odd sizes)

    def apply_frame(self, seq: int, payload: bytes) -> bool:
        """Apply one published batch; False (and nothing applied) if it was already seen."""
        if seq <= self.last_seq:
            return False
        self.gaps += seq - self.last_seq - 1  # from -1: a subscriber that joined late
        self.last_seq = seq
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = batch[1] if isinstance(batch, list | tuple) else batch["events"]
        except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
            logger.warning("ignoring a malformed vLLM KV event batch (seq %d): %s", seq, exc)
            return True
        with self._lock:
            for event in events if isinstance(events, list) else ():
                if isinstance(event, dict):
                    self._apply(event)
            self._stale = True
        return True

    @property
    def cached(self) -> frozenset[bytes]:
        with self._lock:
            if self._stale:
                self._cached, self._stale = frozenset(self._count), False
            return self._cached

    def _apply(self, e: dict) -> None:
        kind = e.get("type")
        if kind == "AllBlocksCleared":
            self._subs.clear()
            self._count.clear()
        elif e.get("medium") not in _GPU_MEDIA:
            return
        elif kind == "BlockStored":
            self._stored(e)
        elif kind == "BlockRemoved":
            for h in e.get("block_hashes") or ():
                for sub in self._subs.pop(h, ()):
                    n = self._count.get(sub, 0) - 1
                    if n > 0:
                        self._count[sub] = n
                    else:
                        self._count.pop(sub, None)

    def _stored(self, e: dict) -> None:
        hashes, tokens = e.get("block_hashes") or [], e.get("token_ids") or []
        size = e.get("block_size")
        salted = e.get("lora_name") or e.get("lora_id") or any(e.get("extra_keys") or ())
        if (salted or not isinstance(size, int) or size <= 0 or size % self.kv_block
                or len(tokens) != size * len(hashes)):  # fmt: skip
            self.ignored += len(hashes)
            return
        parent = e.get("parent_block_hash")
        if parent is None:
            prev = self.seed
        elif self._subs.get(parent):
            prev = self._subs[parent][-1]
        else:  # its parent's event was missed: the chain cannot be continued
            self.ignored += len(hashes)
            return
        kb = self.kv_block
        for i, h in enumerate(hashes):
            subs = []
            for j in range(i * size, (i + 1) * size, kb):
                prev = hash_block(prev, tokens[j : j + kb])
                subs.append(prev)
            for sub in self._subs.get(h, ()):  # stored again: replace, do not double-count
                self._count[sub] -= 1
                if not self._count[sub]:
                    del self._count[sub]
            self._subs[h] = tuple(subs)
            for sub in subs:
                self._count[sub] = self._count.get(sub, 0) + 1


class EventSubscriber:
    """A thread that subscribes to one publisher and feeds a ``KVEventsView``."""

    def __init__(self, endpoint: str, view: KVEventsView, replay: str | None = None,
                 name: str = "vllm") -> None:  # fmt: skip
        try:
            import zmq
        except ImportError:
            raise RuntimeError("vLLM KV events need pyzmq: pip install 'kvpool[vllm]'") from None
        self.zmq, self.endpoint, self.replay, self.view = zmq, endpoint, replay, view
        self.received = 0
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-events-{name}",
                                        daemon=True)  # fmt: skip

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(3)

    def _run(self) -> None:
        zmq = self.zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        try:
            if self.replay:
                self._replay_from(0)
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                missed = self.view.last_seq >= 0 and seq > self.view.last_seq + 1
                if missed and self.replay:
                    self._replay_from(self.view.last_seq + 1)
                self._apply(seq, frames[2])
        except Exception:  # the subscriber must not take the conductor down
            logger.exception("KV events from %s: subscriber stopped", self.endpoint)
        finally:
            sub.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        with self._lock:
            if self.view.apply_frame(seq, payload):
                self.received += 1

    def _replay_from(self, start: int, timeout_ms: int = 2000) -> None:
        """Ask the publisher's replay endpoint for every batch from ``start`` (bounded)."""
        zmq = self.zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(100_000):  # the publisher keeps at most its buffer_steps batches
                if self._stop.is_set() or not sock.poll(timeout_ms):
                    logger.warning("KV events replay from %s timed out", self.replay)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:  # end of the replay
                    return
                self._apply(seq, frames[3])
        finally:
            sock.close(0)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over its label sets} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _METRIC.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


class VllmBackend:
    """One vLLM server as the conductor polls it: its model card (served name, context
    length) once, its load from ``/metrics`` each poll, its cache from the KV events."""

    def __init__(self, spec: VllmSpec, namespace: str, kv_block: int = 16,
                 api_key: str | None = None, timeout: float = 1.0) -> None:  # fmt: skip
        self.spec, self.id = spec, f"vllm@{spec.address}"
        self.events = KVEventsView(namespace_seed(namespace), kv_block)
        self.subscriber = None
        if spec.events:
            self.subscriber = EventSubscriber(spec.events, self.events, spec.replay,
                                              spec.address).start()  # fmt: skip
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=f"http://{spec.address}", timeout=timeout,
                                 headers=self.headers)  # fmt: skip
        self.model_id: str | None = None
        self.max_model_len: int | None = None

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self.http.close()

    @property
    def cached(self) -> frozenset[bytes]:
        return self.events.cached

    def poll(self) -> WorkerLoad:
        """Its load now (UnavailableError when it does not answer as a vLLM server)."""
        try:
            if self.model_id is None:
                card = self._get("/v1/models").json()["data"][0]
                self.model_id = str(card["id"])
                self.max_model_len = int(card.get("max_model_len") or 0) or None
            m = parse_metrics(self._get("/metrics").text)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise UnavailableError(
                f"vLLM {self.spec.address}: {type(exc).__name__}: {exc}"
            ) from None
        return WorkerLoad(running=int(m.get("vllm:num_requests_running", 0)),
                          waiting=int(m.get("vllm:num_requests_waiting", 0)),
                          kv_usage=float(m.get("vllm:kv_cache_usage_perc", 0.0)))  # fmt: skip

    def _get(self, path: str) -> httpx.Response:
        resp = self.http.get(path)
        if resp.status_code != 200:
            raise UnavailableError(f"vLLM {self.spec.address}: GET {path} answered HTTP "
                                   f"{resp.status_code}")  # fmt: skip
        return resp

    def describe(self) -> dict:
        sub = self.subscriber
        return {"engine": "vllm", "model": self.model_id, "events": self.spec.events,
                "events_received": sub.received if sub else 0, "events_missed": self.events.gaps,
                "blocks_ignored": self.events.ignored}  # fmt: skip
