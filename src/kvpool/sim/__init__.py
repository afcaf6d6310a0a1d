"""``kvpool sim``: a discrete-event simulation of a disaggregated cluster (arrivals, prefill,
KV transfer, decode, the pool) that drives the conductor's own policies, router and admission
with calibrated cost models. See docs/simulator.md."""
