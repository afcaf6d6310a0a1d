"""The simulated cluster: nodes, links, the pool, and the conductor's real router in the loop.

At each arrival the conductor's view (``view.py``) hands the real ``Router.route`` (the
policy, then admission) the snapshot the real conductor would hold; its answer is carried
out: the prompt goes to the chosen prefill worker (or, for a short remainder or colocated
nodes, to the decode worker), is looked up when it reaches the head of that node's queue
(local prefix, pool prefix, a load from the pool when it beats recomputing), computed, its
blocks cached and published to the pool; its KV then crosses the decode node's link and the
request joins that node's batch until its last token.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.common.errors import RejectedError, UnavailableError
from kvpool.conductor.policies import predicted_ttft
from kvpool.conductor.router import Router, SLOConfig
from kvpool.sim.cost import StepCost, conductor_cost
from kvpool.sim.events import ARRIVAL, POLL, SAMPLE, EventLoop
from kvpool.sim.host import SharedHost
from kvpool.sim.job import Job
from kvpool.sim.node import Node
from kvpool.sim.pool import PoolModel
from kvpool.sim.systems import SimConfig, SystemSpec
from kvpool.sim.view import ConductorView
from kvpool.sim.workload import SimRequest


class SimCluster:
    def __init__(self, system: SystemSpec, cfg: SimConfig, requests: list[SimRequest]) -> None:
        self.system, self.cfg, self.requests = system, cfg, requests
        self.profile = p = cfg.profile
        self.loop = EventLoop()
        self.cost = StepCost(p)
        self.block_tokens = bt = cfg.block_tokens
        self.kv_token_bytes = p.model.kv_bytes_per_token
        self.block_bytes = bt * self.kv_token_bytes
        self.nodes = self._nodes(system)
        self.by_id = {n.id: n for n in self.nodes}
        self.pool = None
        if system.pool:
            count = cfg.pool_nodes or p.pool.nodes or len(self.nodes)
            per = cfg.pool_blocks_per_node or self._in_sim_blocks(p.pool.blocks_per_node)
            self.pool = PoolModel(count, per, lambda: self.loop.now)
        self.link_free = {n.id: 0.0 for n in self.nodes}  # each node's inbound link
        self.transfers = 0
        self.transfer_bytes = 0.0
        # every node on one host (a calibrated small machine): its cores are shared
        cores = p.node.host_cores
        self.host = None if cores is None else SharedHost(self.loop, cores, p.node.threads)
        # runs of decode-only steps as one event (not on a shared host: a step's length
        # depends on what the other nodes do meanwhile)
        self.fast_forward = self.host is None
        self.decode_tail = p.node.decode_tail
        self.worker_cost = self._worker_cost(requests)
        self.view = ConductorView(self.nodes, self.worker_cost, self.pool, bt, self.block_bytes,
                                  p.network.bytes_per_s, lambda: self.loop.now)  # fmt: skip
        slo = SLOConfig(cfg.slo_ttft if cfg.admission else None,
                        cfg.slo_tbt if cfg.admission else None, cfg.max_inflight)  # fmt: skip
        self.router = Router(cfg.make_policy(system), slo, cfg.decode_prefill_tokens,
                             cfg.decode_prefill_gain)  # fmt: skip
        self.jobs: list[Job | None] = [None] * len(requests)
        self.rejected: dict[int, str] = {}  # request index -> reason
        self.timeline: list[tuple[float, list[int], list[int], int]] = []
        self.on_done: Callable[[], None] | None = None  # progress: a request ended

    def _nodes(self, system: SystemSpec) -> list[Node]:
        spec = self.profile.node
        cache = self.cfg.local_cache_blocks
        cache = self._in_sim_blocks(spec.local_cache_blocks) if cache is None else cache
        # ids sort as numbers (the policies break ties by id): prefill-02 < prefill-10
        width = len(str(max(system.colocated, system.prefill, system.decode) - 1))
        if system.colocated:
            budget = spec.colocated_chunk_tokens if system.chunked else spec.max_batched_tokens
            return [Node(self, f"node-{i:0{width}d}", "both", budget=budget,
                         chunked=system.chunked, cache_blocks=cache)
                    for i in range(system.colocated)]  # fmt: skip
        budget = spec.max_batched_tokens
        chunk = spec.prefill_chunk_tokens or budget
        return [*(Node(self, f"prefill-{i:0{width}d}", "prefill", budget=chunk, chunked=True,
                       cache_blocks=cache) for i in range(system.prefill)),
                *(Node(self, f"decode-{i:0{width}d}", "decode",
                       budget=spec.decode_chunk_tokens or budget, chunked=True,
                       cache_blocks=cache) for i in range(system.decode))]  # fmt: skip

    def _in_sim_blocks(self, profile_blocks: int) -> int:
        """A capacity the profile gives in its blocks, in the simulation's (the same bytes
        when ``--block-tokens`` is not the profile's block size)."""
        return profile_blocks * self.profile.block_tokens // self.block_tokens

    def _worker_cost(self, requests: list[SimRequest]):
        """The linear cost model every worker reports (fitted over the workload's sizes)."""
        lengths = sorted(r.input_tokens for r in requests) or [self.block_tokens]
        picks = [lengths[min(len(lengths) - 1, int(q * len(lengths)))]
                 for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)]  # fmt: skip
        ctx = sum(r.input_tokens + r.output_tokens / 2 for r in requests) / max(1, len(requests))
        spec = self.profile.node
        return conductor_cost(self.cost, picks, ctx, spec.max_batch, self.nodes[0].budget)

    # -- running -----------------------------------------------------------------------------

    def run(self) -> float:
        """Simulate every request to its end; the time the last one ended."""
        loop, interval = self.loop, self.cfg.poll_interval
        polls = set()
        for r in self.requests:
            loop.at(r.arrival_s, self.arrive, r, prio=ARRIVAL)
            tp = r.arrival_s if interval == 0 else (r.arrival_s // interval) * interval
            polls.add(tp)
        for tp in sorted(polls):
            loop.at(tp, self.view.poll, prio=POLL)
        span = self.requests[-1].arrival_s if self.requests else 0.0
        self._every = (span or 1.0) / (self.cfg.samples - 1)
        loop.at(0.0, self._sample, prio=SAMPLE)
        return loop.run()

    def _sample(self) -> None:
        """A timeline point; every other one goes (and the period doubles) when the run
        outlasts the arrivals' span by far, so a timeline holds at most 2 x ``samples``."""
        used = self.pool.used_blocks if self.pool is not None else 0
        self.timeline.append((self.loop.now, [n.queued_tokens for n in self.nodes],
                              [n.batch for n in self.nodes], used))  # fmt: skip
        if len(self.timeline) >= 2 * self.cfg.samples:
            self.timeline = self.timeline[::2]
            self._every *= 2
        if len(self.loop):  # until the cluster is idle
            self.loop.after(self._every, self._sample, prio=SAMPLE)

    # -- the conductor ---------------------------------------------------------------------

    def arrive(self, req: SimRequest) -> None:
        view = self.view
        snap = view.snapshot()
        info = view.request_info(req)
        try:
            route = self.router.route(snap, info, view.inflight)
        except RejectedError as exc:
            self._reject(req, exc.reason)
            return
        except UnavailableError:
            self._reject(req, "no_worker")
            return
        job = Job(req)
        self.jobs[req.index] = job
        job.decode_on = route.decode.worker_id
        job.predicted_ttft_s = route.predicted_ttft_s
        if route.prefill is not None:
            p = route.prefill
            job.prefill_on = p.worker_id
            job.predicted_blocks = p.local_blocks + p.pool_blocks
            job.pending_tokens = max(1, req.input_tokens - job.predicted_blocks * self.block_tokens)
            view.sent_prefill(p.worker_id, job.pending_tokens)
            target = self.by_id[p.worker_id]
        else:  # the decode (or colocated) worker computes the prompt itself
            at = predicted_ttft(snap, view.view(job.decode_on), info)
            job.predicted_blocks = at.local_blocks + at.pool_blocks
            job.pending_tokens = route.decode_prompt_tokens  # its queue, until the first token
            view.sent_prefill(job.decode_on, job.pending_tokens)
            target = self.by_id[job.decode_on]
        pool = info.pool_prefix_blocks
        job.truth_blocks = max(target.cache.prefix(req.hashes), pool)
        job.best_blocks = max(pool, *(n.cache.prefix(req.hashes) for n in self.nodes
                                      if n.role != "decode"))  # fmt: skip
        view.took_flight(job.decode_on)
        target.enqueue_prefill(job)

    def _reject(self, req: SimRequest, reason: str) -> None:
        self.rejected[req.index] = reason
        if self.on_done is not None:
            self.on_done()

    # -- the workers' side -------------------------------------------------------------------

    def lookup(self, node: Node, job: Job) -> bool:
        """``job`` reaches the head of ``node``'s queue: its local prefix is a hit; a longer
        prefix in the pool is loaded if that beats recomputing it (True: loading)."""
        job.looked_up = True
        hashes, bt = job.req.hashes, self.block_tokens
        local = node.cache.prefix(hashes)
        node.cache.touch(hashes[:local])
        job.reused, job.done = local, local * bt
        if self.pool is None or len(hashes) <= local:
            return False
        extra = self.pool.prefix(hashes) - local  # the connector's lookup (leases them)
        if extra <= 0:
            return False
        load_s = self.profile.network.request_overhead_s + extra * self.block_bytes / \
            self.profile.network.bytes_per_s  # fmt: skip
        if load_s >= self.cost.prefill_s(extra * bt, local * bt):
            return False  # recomputing is faster (the connector's fetch policy)
        got = self.pool.load(hashes[local : local + extra])
        if not got:
            return False
        job.loading = True
        done_at = self._reserve(node.id, got * self.block_bytes)
        self.loop.at(done_at, self._loaded, node, job, local + got)
        return True

    def _loaded(self, node: Node, job: Job, blocks: int) -> None:
        job.reused, job.done = blocks, blocks * self.block_tokens
        node.loaded(job)

    def _reserve(self, node_id: str, nbytes: float) -> float:
        """A transfer into ``node_id``: queued behind the link's earlier ones; when it ends."""
        net = self.profile.network
        start = max(self.loop.now, self.link_free[node_id])
        busy = nbytes / net.bytes_per_s
        self.link_free[node_id] = start + busy
        self.transfers += 1
        self.transfer_bytes += nbytes
        return start + busy + net.request_overhead_s

    def prefill_done(self, node: Node, job: Job, now: float) -> None:
        if job.first_s >= 0:  # the tail a decode node computed: the second token
            job.tail_s = now
            self._decode_or_finish(node, job, now)
            return
        job.first_s = now
        hashes = job.req.hashes
        node.cache.insert(hashes)
        if self.pool is not None:
            self.pool.publish(hashes)
        self.view.prefill_returned(job.prefill_on or job.decode_on, job.pending_tokens)
        if job.req.output_tokens > 1 and node.role == "prefill":
            dec = self.by_id[job.decode_on]
            sent = len(hashes) * self.block_tokens if self.decode_tail else job.req.input_tokens
            done_at = self._reserve(dec.id, sent * self.kv_token_bytes)
            self.loop.at(done_at, self._at_decode, dec, job, sent)
        else:
            self._decode_or_finish(node, job, now)

    def _decode_or_finish(self, node: Node, job: Job, now: float) -> None:
        if job.decode_tokens > 0:
            node.enqueue_decode(job)
        else:
            self.finished(job, now)

    def _at_decode(self, dec: Node, job: Job, sent: int) -> None:
        dec.cache.insert(job.req.hashes)  # the decode engine holds the prompt's blocks now
        if sent < job.req.input_tokens:  # kvpool: the decode worker computes the tail
            job.done = sent
            dec.enqueue_prefill(job)
        else:
            dec.enqueue_decode(job)

    def finished(self, job: Job, now: float) -> None:
        job.finish = now
        self.view.released(job.decode_on)
        if self.on_done is not None:
            self.on_done()
