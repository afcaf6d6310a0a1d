"""One simulated engine: a step loop over a prefill queue and a continuous decode batch.

Each step decodes one token for every running sequence and computes prompt tokens from the
head of the queue. ``chunked``: the prompt tokens share the step's token budget with the
decodes (chunked prefill: kvpool's engine, vLLM's chunked prefill); a prompt longer than the
budget takes several steps, each reading the KV of the chunks before it. Not ``chunked``
(vLLM without chunked prefill): a step with waiting prompts computes whole prompts only (up to
the budget, at least one) and the running sequences wait for it. A prompt is looked up when
it first reaches the head of the queue (its local prefix, the pool's); a prefix worth loading
from the pool is loaded while the queue moves on, then the request comes back to the head.

Decode bookkeeping is O(1) per step: the node keeps the end times of its decode steps, each
running request its first step's index and a heap entry with its last step's index; the KV
read by a step is the running total of the batch's context. A run of decode-only steps until
the next request finishes is one event (``fast_forward``): its step times are computed at
once, exactly as step-by-step events would add them up; anything arriving meanwhile cuts the
run at the end of the step in progress, where it would have joined anyway.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from typing import Protocol

from kvpool.sim.cache import LocalCache
from kvpool.sim.cost import StepCost, causal_pairs
from kvpool.sim.events import EventLoop
from kvpool.sim.host import SharedHost
from kvpool.sim.job import Job
from kvpool.sim.profile import Profile


class Cluster(Protocol):
    """What a node reads and calls on the cluster it belongs to (``cluster.SimCluster``)."""

    profile: Profile
    loop: EventLoop
    cost: StepCost
    host: SharedHost | None
    fast_forward: bool

    def lookup(self, node: Node, job: Job) -> bool: ...

    def prefill_done(self, node: Node, job: Job, now: float) -> None: ...

    def finished(self, job: Job, now: float) -> None: ...


MAX_REMAINING = 256  # as a worker's status reports at most (protocol.worker)


class Node:
    __slots__ = ("admit", "batch", "budget", "busy", "busy_s", "cache", "chunked", "ctx",
                 "decode_ends", "decoded_tokens", "heap", "id", "kv_cap", "kv_used",
                 "loading", "macro", "macro_start", "max_batch", "partial", "prefilled_tokens",
                 "queue", "queued_tokens", "requests", "role", "sim", "step_start", "steps",
                 "version")  # fmt: skip

    def __init__(self, sim: Cluster, node_id: str, role: str, *, budget: int,
                 chunked: bool, cache_blocks: int) -> None:  # fmt: skip
        spec = sim.profile.node
        self.sim, self.id, self.role = sim, node_id, role
        self.budget, self.chunked = budget, chunked
        self.max_batch, self.kv_cap = spec.max_batch, spec.kv_capacity_tokens
        self.cache = LocalCache(cache_blocks)
        self.queue: deque[Job] = deque()  # prompts to compute, in order
        self.partial: Job | None = None  # the prompt at the head, partly computed
        self.loading = 0  # requests whose prefix is loading from the pool
        self.queued_tokens = 0  # prompt tokens queued, loading or in progress, not computed
        self.admit: deque[Job] = deque()  # ready to decode, waiting for room in the batch
        self.heap: list[tuple[int, int, Job]] = []  # (index of its last step, seq, job)
        self.batch = 0
        self.ctx = 0  # KV tokens the running batch reads per step
        self.kv_used = 0  # KV tokens reserved by the running batch
        self.decode_ends = array("d")  # end time of each decode step
        self.busy = False
        self.busy_s = 0.0
        self.step_start = 0.0
        self.steps = self.prefilled_tokens = self.decoded_tokens = self.requests = 0
        self.macro: list[float] | None = None  # end times of a fast-forwarded run of steps
        self.macro_start = 0.0
        self.version = 0  # a cut run's end event is stale

    # -- arrivals ---------------------------------------------------------------------------

    def enqueue_prefill(self, job: Job) -> None:
        """A prompt to compute here (or, ``job.done`` > 0, the rest of one: a tail)."""
        if not job.computed_on:
            job.computed_on = self.id
            self.requests += 1
        self.queue.append(job)
        self.queued_tokens += job.prompt_left
        self.kick()

    def loaded(self, job: Job) -> None:
        """A prefix load ended (``job.done`` is what it brought): back to the head of the
        queue, behind a prompt in progress."""
        self.loading -= 1
        self.queued_tokens -= job.done
        job.loading = False
        if self.queue and self.queue[0] is self.partial:
            self.queue.insert(1, job)
        else:
            self.queue.appendleft(job)
        self.kick()

    def enqueue_decode(self, job: Job) -> None:
        self.admit.append(job)
        self.kick()

    # -- the step ---------------------------------------------------------------------------

    def kick(self) -> None:
        if not self.busy:
            if self.queue or self.admit or self.batch:
                self._start()
        elif self.macro is not None:
            self._cut()

    def _join(self) -> None:
        steps = len(self.decode_ends)
        while self.admit and self.batch < self.max_batch:
            job = self.admit[0]
            r = job.req
            need = r.input_tokens + r.output_tokens
            if self.batch and self.kv_used + need > self.kv_cap:
                break
            self.admit.popleft()
            left = job.decode_tokens
            job.join = steps
            heapq.heappush(self.heap, (steps + left - 1, id(job), job))
            self.batch += 1
            self.ctx += r.input_tokens + r.output_tokens - left  # its tokens so far
            self.kv_used += need

    def _chunks(self) -> list[tuple[Job, int]]:
        chunks: list[tuple[Job, int]] = []
        room = self.budget - (self.batch if self.chunked else 0)
        queue = self.queue
        while queue and room > 0:
            job = queue[0]
            if not job.looked_up:
                if self.sim.lookup(self, job):
                    queue.popleft()  # loading its prefix: the next one goes on meanwhile
                    self.loading += 1
                    continue
                self.queued_tokens -= job.done  # its local prefix
            left = job.prompt_left
            if self.chunked:
                take = min(left, room)
            elif chunks and left > room:
                break
            else:
                take = left
            chunks.append((job, take))
            room -= take
            if take < left:
                self.partial = job
                break
            queue.popleft()
            self.partial = None
        return chunks

    def _start(self) -> None:
        self._join()
        chunks = self._chunks()
        decodes = self.batch if (self.chunked or not chunks) else 0
        if not chunks and not decodes:
            return  # everything waits for a load or for room
        if not chunks and self.sim.fast_forward and self.heap[0][0] > len(self.decode_ends):
            self._run_decodes()
            return
        tokens = pairs = context = 0
        completes = 0
        for job, take in chunks:
            tokens += take
            pairs += causal_pairs(take, job.done)
            context += job.done
            completes += take == job.prompt_left
        dt = self.sim.cost.step_s(tokens, pairs, context, completes + decodes, decodes,
                                  self.ctx if decodes else 0)  # fmt: skip
        self.busy = True
        self.step_start = self.sim.loop.now
        self.steps += 1
        if self.sim.host is not None:  # sharing a host's cores: as long as the sharing makes it
            self.sim.host.run(self, dt, self._end, chunks, decodes)
        else:
            self.sim.loop.after(dt, self._end, chunks, decodes)

    def _end(self, chunks: list[tuple[Job, int]], decodes: int) -> None:
        now = self.sim.loop.now
        self.busy = False
        self.busy_s += now - self.step_start
        for job, take in chunks:
            job.done += take
            self.queued_tokens -= take
            self.prefilled_tokens += take
            if job.done >= job.req.input_tokens:
                self.sim.prefill_done(self, job, now)
        if decodes:
            self.decode_ends.append(now)
            self.ctx += decodes
            self.decoded_tokens += decodes
            self._finish(now)
        self.kick()

    def _finish(self, now: float) -> None:
        """The requests whose last decode step just ended leave the batch."""
        last = len(self.decode_ends) - 1
        heap = self.heap
        while heap and heap[0][0] <= last:
            _, _, job = heapq.heappop(heap)
            r = job.req
            self.batch -= 1
            self.ctx -= r.input_tokens + r.output_tokens
            self.kv_used -= r.input_tokens + r.output_tokens
            self.sim.finished(job, now)

    # -- fast-forward: decode-only steps until the next request finishes ---------------------

    def _run_decodes(self) -> None:
        now = self.sim.loop.now
        step, b, ctx = self.sim.cost.step_s, self.batch, self.ctx
        times = []
        for _ in range(self.heap[0][0] - len(self.decode_ends) + 1):
            now = now + step(0, 0, 0, b, b, ctx)
            times.append(now)
            ctx += b
        self.macro, self.macro_start = times, self.sim.loop.now
        self.busy = True
        self.version += 1
        self.sim.loop.at(times[-1], self._end_run, self.version)

    def _cut(self) -> None:
        """Work arrived during a run: end it with the step in progress."""
        times = self.macro
        assert times is not None
        m = bisect_left(times, self.sim.loop.now)
        if m < len(times) - 1:
            self.macro = times[: m + 1]
            self.version += 1
            self.sim.loop.at(times[m], self._end_run, self.version)

    def _end_run(self, version: int) -> None:
        if version != self.version:
            return  # cut short: a later event ends it
        times, b = self.macro, self.batch
        assert times is not None
        self.macro = None
        self.busy = False
        self.busy_s += times[-1] - self.macro_start
        self.steps += len(times)
        self.decode_ends.extend(times)
        self.ctx += b * len(times)
        self.decoded_tokens += b * len(times)
        self._finish(self.sim.loop.now)
        self.kick()

    # -- what a status poll reports ---------------------------------------------------------

    def remaining_tokens(self) -> list[int]:
        steps = len(self.decode_ends)
        if self.macro is not None:
            steps += bisect_right(self.macro, self.sim.loop.now)
        return [last - steps + 1 for last, _, _ in self.heap[:MAX_REMAINING]]

    @property
    def waiting(self) -> int:
        return len(self.queue) + self.loading + len(self.admit)
