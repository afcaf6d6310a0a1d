"""``KVPoolConnector``: vLLM's ``KVConnectorBase_V1`` on kvpool's pool.

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"master": "127.0.0.1:50051"}}'

Extra config: ``master`` (``HOST:PORT`` or ``etcd://...``, required), ``token`` (default: the
environment's ``KVPOOL_AUTH_TOKEN``), ``kv_block`` (tokens per pool object, 16: kvpool's
engine default; must divide vLLM's block size), ``partial_blocks`` (true, the default: a load
may end inside a vLLM block, at any pool object, and a prompt found whole is loaded whole;
false: whole vLLM blocks only, one prompt token left, as vLLM's ExampleConnector loads),
``pool_dtype`` (the pool objects' dtype, default vLLM's: e.g. ``float32`` lets a bfloat16
vLLM share prefixes with float32 engines; loads round to vLLM's dtype, saves widen exactly),
``staging_blocks`` (256), ``transport`` (``auto``), ``timeout`` (seconds per pool call, 10),
``stats_file`` (the worker writes its counters there as JSON after each step that moved
blocks).

Pool objects are kvpool's own (``protocol/kv_object.py``): key from the chain hash of the
prompt in kvpool's namespace (model fingerprint, dtype, block size, layers, heads), a header
with the block's token ids, the payload in kvpool's block layout (``layout.py``). So a prefix
computed by a kvpool worker is loadable here, and the reverse.

**Scheduler side** (vLLM's scheduler process): the first ``get_num_new_matched_tokens`` of a
request starts a pool lookup on a background thread and answers None ("ask again"); once it
has the answer, the matched tokens are loaded asynchronously: the request waits in
``WAITING_FOR_REMOTE_KVS`` while others run. A request with a ``cache_salt`` or a LoRA
adapter is never loaded nor saved (its KV is not the plain prompt's, and a salt asks for
isolation). ``build_connector_meta`` names each step's loads and the prompt blocks that
became full (saves).

**Worker side** (vLLM's worker): the connector core is kvpool's engine connector
(``engine/connectors/store.StoreConnector``) bound to a staging tensor in the pool layout:
the same loads (token ids verified), saves (a background thread), object format and stats.
Loads run on a thread: pool -> staging -> vLLM's blocks; done ones are reported by
``get_finished``, blocks that did not arrive by ``get_block_ids_with_load_errors`` (vLLM
recomputes them; a load failure never fails a request). Saves copy the new full blocks into
staging in ``wait_for_save`` (so vLLM may free its blocks at once) and write in the
background; with no free staging slot a save is dropped (a future miss), never waited for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool.common.errors import KVPoolError
from kvpool.common.hashing import block_hashes, leading_true, namespace_seed
from kvpool.engine.connectors.base import BlockRef
from kvpool.integrations.vllm.layout import (
    POOL_DTYPES,
    gather,
    pool_namespace,
    probe_block_map,
    scatter,
)
from kvpool.protocol.kv_object import block_key

logger = logging.getLogger("kvpool.integrations.vllm")
CHUNK = 128  # kvpool blocks per staged load step


@dataclass(slots=True)
class _Blocks:
    """kvpool blocks of one request: ``(vLLM block id, sub-block, chain hash, token ids)``."""

    req_id: str
    items: list[tuple[int, int, bytes, tuple[int, ...]]]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[_Blocks] = field(default_factory=list)
    saves: list[_Blocks] = field(default_factory=list)


@dataclass(slots=True)
class _Req:
    """The scheduler side's view of one request."""

    tokens: list[int]
    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    handled: int = 0  # kvpool blocks loaded, present or saved: never saved again
    local: int = 0  # tokens vLLM had computed itself when we were last asked
    lookup: Future | None = None
    present: int | None = None  # leading kvpool blocks the pool holds


def _settings(vllm_config) -> dict:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    if not extra.get("master"):
        raise ValueError("KVPoolConnector needs kv_connector_extra_config.master (HOST:PORT of "
                         "kvpool store master, or etcd://HOST:PORT)")  # fmt: skip
    return extra


def _client(extra: dict, compute_process: bool):
    from kvpool.config import TransferConfig
    from kvpool.store.client import StoreClient

    timeout = float(extra.get("timeout", 10.0))
    token = extra.get("token")
    config = TransferConfig(transport=extra.get("transport", "auto"), request_timeout=timeout,
                            connect_timeout=min(timeout, 5.0), auth_token=token,
                            spin_us=0 if compute_process else 500)  # fmt: skip
    return StoreClient(extra["master"], config, token=token, timeout=timeout,
                       failover_timeout=timeout)  # fmt: skip


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    if found is None:
        raise ValueError(f"cannot tell the layer index of vLLM KV tensor {name!r}")
    return int(found.group(1))


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM's KV connector on kvpool's pool (both roles: see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra = _settings(vllm_config)
        self._kv_block = int(self._extra.get("kv_block", 16))
        self._partial = bool(self._extra.get("partial_blocks", True))
        self._pool_dtype = self._extra.get("pool_dtype")
        self.namespace, self.layout = pool_namespace(vllm_config, self._kv_block,
                                                     self._pool_dtype)  # fmt: skip
        self._seed = namespace_seed(self.namespace)
        self._client = _client(self._extra, compute_process=role == KVConnectorRole.WORKER)
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _Req] = {}
            self._pending: dict[str, _Blocks] = {}
            self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-lookup")
        else:
            self._store = None  # the connector core, bound at register_kv_caches
            self._layers: list[torch.Tensor] = []
            self._lock = threading.Lock()
            self._free: list[int] = []
            self._done_loads: set[str] = set()
            self._load_errors: set[int] = set()
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-load")
        logger.info("KVPoolConnector (%s): pool %s, namespace %s", role.name,
                    self._extra["master"], self.namespace)  # fmt: skip

    # -- scheduler side ----------------------------------------------------------------------

    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            st = _Req(tokens, block_hashes(tokens, self._kv_block, self._seed))
            if getattr(request, "cache_salt", None) or getattr(request, "lora_request", None):
                st.present, st.handled = 0, len(st.hashes)  # isolated: never loaded nor saved
            self._reqs[request.request_id] = st
        return st

    def _lookup(self, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        return leading_true(self._client.batch_exists([block_key(h) for h in hashes]))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self._state(request)
        st.local = num_computed_tokens
        if st.present is None:
            if st.lookup is None:
                st.lookup = self._lookups.submit(self._lookup, st.hashes)
            if not st.lookup.done():
                return None, False  # asked again next step; other requests run meanwhile
            try:
                st.present = st.lookup.result()
            except KVPoolError as exc:
                logger.warning("KVPoolConnector: pool lookup failed (%s): computing locally", exc)
                st.present = 0
            st.handled = max(st.handled, st.present)  # never saved again
        vb = self.layout.vllm_block
        if self._partial:  # whole pool objects (a full hit: vLLM recomputes the last token)
            usable = min(st.present * self._kv_block, len(st.tokens))
        else:  # ExampleConnector's rule: whole vLLM blocks, one prompt token left to compute
            usable = min(st.present * self._kv_block, len(st.tokens) - 1) // vb * vb
        n = usable - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._state(request)
        st.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        kb, subs = self._kv_block, self.layout.subs
        first = st.local // kb
        last = (st.local + num_external_tokens) // kb
        items = [(st.block_ids[j // subs], j % subs, st.hashes[j], tuple(st.tokens[j * kb : (j + 1) * kb]))
                 for j in range(first, last)]  # fmt: skip
        self._pending[request.request_id] = _Blocks(request.request_id, items)
        st.handled = max(st.handled, last)

    def build_connector_meta(self, scheduler_output) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                tokens = list(new.prompt_token_ids or [])
                st = self._reqs[new.req_id] = _Req(tokens, block_hashes(tokens, self._kv_block,
                                                                         self._seed))  # fmt: skip
            st.block_ids = list(new.block_ids[0])
            self._saves(meta, new.req_id, st, new.num_computed_tokens + steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._saves(meta, rid, st, cached.num_computed_tokens[i] + steps.get(rid, 0))
        return meta

    def _saves(self, meta: KVPoolConnectorMetadata, rid: str, st: _Req, computed: int) -> None:
        """The prompt's kvpool blocks that this step completes (not loaded, not in the pool)."""
        kb, subs = self._kv_block, self.layout.subs
        full = min(computed, len(st.tokens)) // kb
        full = min(full, len(st.block_ids) * subs)
        if full <= st.handled:
            return
        items = [(st.block_ids[j // subs], j % subs, st.hashes[j], tuple(st.tokens[j * kb : (j + 1) * kb]))
                 for j in range(st.handled, full)]  # fmt: skip
        st.handled = full
        meta.saves.append(_Blocks(rid, items))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None  # saves copy their blocks to staging at once: free them now

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvpool.engine.connectors.store import StoreConnector

        named = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        if len(named) != self.layout.num_layers:
            raise ValueError(f"vLLM registered {len(named)} KV tensors for a model of "
                             f"{self.layout.num_layers} layers")  # fmt: skip
        for name, t in named:
            self.layout.check_layer(name, t)
        self._layers = [t for _, t in named]
        cache_dtype = self._vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            raise ValueError(f"KVPoolConnector stores float KV; kv_cache_dtype {cache_dtype!r} "
                             "is not supported")  # fmt: skip
        self._map = probe_block_map(self.layout, self._layers[0].dtype, "auto")
        slots = int(self._extra.get("staging_blocks", 256))
        dtype = POOL_DTYPES[self._pool_dtype] if self._pool_dtype else self._layers[0].dtype
        staging = torch.empty((slots, *self.layout.block_shape()), dtype=dtype)
        staging.fill_(0)  # touch every page now, not on the first load
        self._store = StoreConnector(self._client, async_load=False, fetch_policy=False,
                                     direct=False)  # fmt: skip
        self._store.bind(staging, self._kv_block, self.namespace)
        self._staging = staging
        self._free = list(range(slots))

    @property
    def stats(self):
        """The connector core's counters (loaded / saved blocks and bytes, ...)."""
        return self._store.stats if self._store is not None else None

    def _take(self, n: int) -> list[int]:
        with self._lock:
            self._free.extend(self._store.poll_saved())
            self._free.sort()  # ascending slots: mostly one run, copied without an index
            got, self._free = self._free[:n], self._free[n:]
        return got

    def _give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata) or self._store is None:
            return
        for job in meta.loads:
            self._loader.submit(self._load, job)

    def _load(self, job: _Blocks) -> None:
        """pool -> staging -> vLLM's blocks, ``CHUNK`` blocks at a time; the blocks from the
        first that did not arrive on are reported as load errors (vLLM recomputes them)."""
        done = 0
        try:
            while done < len(job.items):
                part = job.items[done : done + CHUNK]
                slots = self._take(len(part))
                if not slots:
                    break
                part = part[: len(slots)]
                try:
                    refs = [
                        BlockRef(s, h, toks) for s, (_, _, h, toks) in zip(slots, part, strict=True)
                    ]
                    n = self._store.load(refs, slots)
                    if n:
                        scatter(self.layout, self._map, self._staging, slots[:n], self._layers,
                                [v for v, _, _, _ in part[:n]], [s for _, s, _, _ in part[:n]])  # fmt: skip
                finally:
                    self._give(slots)
                done += n
                if n < len(part):
                    break
        except Exception:  # a load is best effort: what did not arrive is recomputed
            logger.exception("KVPoolConnector: loading %s failed", job.req_id)
        with self._lock:
            self._load_errors.update(v for v, _, _, _ in job.items[done:])
            self._done_loads.add(job.req_id)
        self._write_stats()

    def _write_stats(self) -> None:
        path = self._extra.get("stats_file")
        if not path or self._store is None:
            return
        now = dataclasses.asdict(self._store.stats)
        if now == getattr(self, "_written", None):
            return
        self._written = now
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(now, f)
        os.replace(tmp, path)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before their request is scheduled (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved in wait_for_save, once every layer of the step is computed

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata) or self._store is None:
            return
        self._write_stats()  # what the save thread finished since the last step
        items = [it for job in meta.saves for it in job.items]
        if not items:
            return
        slots = self._take(len(items))
        if len(slots) < len(items):
            self._store.stats.dropped_saves += len(items) - len(slots)
            items = items[: len(slots)]
        if not items:
            return
        gather(self.layout, self._map, self._layers, [v for v, _, _, _ in items],
               [s for _, s, _, _ in items], self._staging, slots)  # fmt: skip
        self._store.save(
            [BlockRef(s, h, toks) for s, (_, _, h, toks) in zip(slots, items, strict=True)]
        )

    def get_finished(self, finished_req_ids: set[str]):
        with self._lock:
            done, self._done_loads = self._done_loads, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        else:
            self._loader.shutdown(wait=True)
            if self._store is not None:
                self._store.close()
        self._client.close()
