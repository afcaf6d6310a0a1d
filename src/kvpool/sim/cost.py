"""The simulator's cost model: what a step, a transfer take on a profile's hardware.

A step computes some prefill tokens (chunks of prompts, each after its context) and one token
for each decoding sequence. Its time is

    step_base_s + decode_seq_s * decodes + combine(compute, memory)

    compute = linear FLOPs / (peak * mfu) + attention FLOPs / (peak * attn_mfu)
              (linear: 2 * layer weights per token, the LM head per logits row;
               attention: 4 * layers * heads * head_dim per (query, key) pair, causal)
    memory  = (weight bytes + KV bytes of every context read) / (bandwidth * efficiency)

with ``combine`` the max (a GPU overlaps compute and memory: the roofline) or the sum (a CPU
that does not, as calibrated). A transfer takes ``overhead + bytes / link bandwidth``.

The conductor does not see this model: like a real worker, each simulated worker reports the
linear ``CostModel`` (``protocol.worker``) least squares gives over its steps
(``conductor_cost``: the engine's own ``StepModel`` fit over steps of the workload's sizes).
"""

from __future__ import annotations

from collections import deque

from kvpool.protocol.worker import CostModel
from kvpool.sim.profile import Profile


class StepCost:
    """Seconds of a step, from per-unit coefficients precomputed from a profile."""

    __slots__ = ("attn", "base", "head", "kv", "lin", "overlap", "seq", "weights")

    def __init__(self, profile: Profile) -> None:
        m, n = profile.model, profile.node
        compute = n.flops_per_s * n.mfu
        self.lin = m.linear_flops_per_token / compute  # s per token through the layers
        self.head = m.lm_head_flops / compute  # s per logits row
        pair = 4.0 * m.num_layers * m.num_heads * m.head_dim  # FLOPs of one query-key pair
        self.attn = pair / (n.flops_per_s * (n.attn_mfu or n.mfu))
        bw = n.mem_bytes_per_s * n.mem_efficiency
        self.weights = m.step_weight_bytes / bw  # s to read the weights once
        self.kv = m.kv_bytes_per_token / bw  # s per context token read
        self.base, self.seq, self.overlap = n.step_base_s, n.decode_seq_s, n.overlap

    def step_s(self, prefill_tokens: float = 0, prefill_pairs: float = 0,
               prefill_context: float = 0, logits: int = 0, decodes: int = 0,
               decode_context: float = 0) -> float:  # fmt: skip
        """A step with ``prefill_tokens`` new prompt tokens (``prefill_pairs`` causal
        query-key pairs among them and their context, ``prefill_context`` earlier tokens whose
        KV they read), ``logits`` rows of the LM head, and ``decodes`` sequences decoding over
        ``decode_context`` tokens of KV in total."""
        compute = self.lin * (prefill_tokens + decodes) + self.head * logits \
            + self.attn * (prefill_pairs + decode_context)  # fmt: skip
        memory = self.weights + self.kv * (prefill_context + decode_context)
        core = (compute if compute > memory else memory) if self.overlap else compute + memory
        return self.base + self.seq * decodes + core

    def prefill_s(self, new: int, context: int = 0) -> float:
        """One step computing ``new`` prompt tokens after ``context`` (and the first token)."""
        return self.step_s(new, causal_pairs(new, context), context, logits=1)

    def decode_s(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences over ``context`` KV tokens in total."""
        return self.step_s(logits=batch, decodes=batch, decode_context=context)


def causal_pairs(new: float, context: float) -> float:
    """Query-key pairs of ``new`` tokens after ``context`` earlier ones, causally masked."""
    return new * context + new * (new + 1) / 2


def transfer_s(profile: Profile, nbytes: float) -> float:
    """One transfer of ``nbytes`` over a node's link, alone on it."""
    net = profile.network
    return net.request_overhead_s + nbytes / net.bytes_per_s


def conductor_cost(step: StepCost, prompt_lengths: list[int], decode_context: float,
                   max_batch: int, chunk: int) -> CostModel:  # fmt: skip
    """The linear cost model a worker of this profile would report: the engine's least-squares
    fit (``StepModel``) over prefill steps of the given prompt lengths (cut into ``chunk``-token
    chunks, as the engine runs them) and decode steps of 1..``max_batch`` sequences of
    ``decode_context`` tokens each."""
    from kvpool.engine.step_model import StepModel

    samples: deque[tuple[int, int, float]] = deque(maxlen=4096)
    for n in sorted(set(prompt_lengths)) or [chunk]:
        done = 0
        while done < n:
            take = min(chunk, n - done)
            samples.append((take, 0, step.prefill_s(take, done)))
            done += take
    batches = sorted({max(1, round(max_batch * f)) for f in
                      (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)} | {1, 2, 3, 4})  # fmt: skip
    for b in batches:
        samples.append((0, b, step.decode_s(b, b * decode_context)))
    while sum(1 for p, _, _ in samples if p) < 4:  # the fit wants four prefill steps at least
        samples.append((chunk, 0, step.prefill_s(chunk)))
    return StepModel(samples).fit()
