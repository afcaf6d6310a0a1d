"""A property over random interleavings across processes: a master, three storage nodes and
three Mooncake-API clients (one also a node), each its own process; rounds of concurrent
puts, upserts, zero-copy puts, batch puts, gets, removes, client close/set-up and node kills
(SIGKILL, restart under the same id).

The property: every put that returned 0 is readable, byte for byte, until it is removed,
evicted (and the eviction shows in the master's metrics) or every node that held it died
after it was put; never other bytes; never ``b""`` otherwise. Keys are 40 names written by
all clients (no two commands of a round touch the same key), so the model knows what each
read may see. Seeds: ``KVPOOL_PROPERTY_SEED`` (default: one fixed, one from the clock,
printed); ``KVPOOL_PROPERTY_DEBUG=1`` prints every command and its answer."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.process import Process
from support.procs import Proc

MiB = 1 << 20
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
CLIENT = Path(__file__).with_name("churn_client.py")
KEYS = [f"prop/{i}" for i in range(40)]
ROUNDS, ROUND_TIMEOUT, BUDGET_S = 300, 60.0, 240.0
NODES = ("n1", "n2", "n3")


def digest(n: int, seed: int) -> str:
    return hashlib.blake2b(random.Random(seed).randbytes(n), digest_size=8).hexdigest()


class Client(Process):
    """A churn_client.py process: send commands, read replies (bounded waits)."""

    def __init__(self, master: str, segment: int) -> None:
        super().__init__([sys.executable, str(CLIENT), master, str(segment)], pipe_stdout=True,
                         stdin=subprocess.PIPE, env={**ENV, "PYTHONUNBUFFERED": "1"},
                         name="churn client")  # fmt: skip
        hello = self._line(120)
        assert hello["ready"] == 0, hello
        self.hostname = hello["hostname"] if segment else None

    def send(self, cmd: dict) -> None:  # one JSON line
        super().send(json.dumps(cmd))

    def _line(self, timeout: float) -> dict:
        try:
            return json.loads(self.readline(timeout))
        except RuntimeError as exc:  # no line within the timeout (a hang), or it exited
            pytest.fail(str(exc))

    def reply(self, timeout: float = ROUND_TIMEOUT):
        out = self._line(timeout)
        assert "error" not in out, out["error"]  # the adapter never raises
        return out["ok"]

    def call(self, cmd: dict):
        self.send(cmd)
        return self.reply()

    def close(self) -> None:
        self.stop(None)  # end of its stdin; SIGKILL after 30 s


@dataclass
class Key:
    """What a read of a key may see: one of ``values`` (digests), or ``b""`` if ``absent`` or
    if it was legitimately lost since ``since`` (evicted, or every holder died; ``holders``
    None: not known which nodes hold it, so any death counts). ``acked``: exactly one value,
    acknowledged by a put that returned 0, holders known."""

    values: set = field(default_factory=set)
    absent: bool = True
    acked: bool = False
    since: float = 0.0
    evictions: int = 0
    holders: set | None = None


@dataclass
class Tally:
    acked: int = 0
    verified: int = 0
    lost_to_dead_nodes: int = 0
    lost_to_eviction: int = 0
    removed: int = 0
    failed_puts: int = 0
    node_kills: int = 0
    client_restarts: int = 0


class Pool:
    """The processes, the model and the checks."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.metrics_port = free_port()
        self.master_proc = Proc("store", "master", "--port", "0", "--replicas", "2",
                                "--lease-ttl", "0.3", "--node-ttl", "4", "--log-level", "error",
                                "--metrics-port", str(self.metrics_port), env=ENV)  # fmt: skip
        self.master = self.master_proc.info["address"]
        self.nodes = {n: self._node(n) for n in NODES}
        self.died: dict[str, list[float]] = {n: [] for n in NODES}
        self.clients = [Client(self.master, 8 * MiB), Client(self.master, 0),
                        Client(self.master, 0)]  # fmt: skip
        holder = self.clients[0].hostname
        self.died[holder] = []
        self.keys = {k: Key() for k in KEYS}
        self.tally = Tally()

    def _node(self, node_id: str) -> Proc:
        return Proc("store", "node", "--master", self.master, "--memory", "16MiB", "--node-id",
                    node_id, "--log-level", "error", env=ENV)  # fmt: skip

    def stats(self) -> dict:
        from kvpool.common.rpc import RpcClient

        with RpcClient(self.master) as c:
            return c.call("stats")

    # -- the model ------------------------------------------------------------------------------

    def acked(self, key: str, value: str, holders: list[str]) -> None:
        self.keys[key] = Key({value}, False, True, time.monotonic(), self.stats()["evictions"],
                             set(holders))  # fmt: skip
        self.tally.acked += 1

    def uncertain(self, key: str, new: str) -> None:
        """A put whose outcome is not known (it failed, or it may have replaced a lost value):
        the old values, or the new one."""
        k = self.keys[key]
        since = k.since if k.values else time.monotonic()
        evictions = k.evictions if k.values else self.stats()["evictions"]
        self.keys[key] = Key(k.values | {new}, k.absent, False, since, evictions, None)

    def lost_legitimately(self, k: Key) -> str | None:
        if self.stats()["evictions"] > k.evictions:
            return "evicted"
        died = [h for h, times in self.died.items() if any(t >= k.since for t in times)]
        if (k.holders is None and died) or (k.holders and set(k.holders) <= set(died)):
            return "dead"
        return None

    def check_read(self, key: str, got: str | None, how: str) -> None:
        k = self.keys[key]
        if got is not None:
            assert got in k.values, f"{how} {key}: WRONG BYTES {got}, expected {k.values}"
            self.tally.verified += k.acked
            if not k.acked and len(k.values) > 1:  # now we know which one it holds
                self.keys[key] = Key({got}, False, False, k.since, k.evictions, None)
            return
        if k.absent and not k.acked:
            self.keys[key] = Key()
            return
        why = self.lost_legitimately(k)
        assert why is not None, (f"{how} {key}: b'' for {k} (acknowledged "
                                 f"{time.monotonic() - k.since:.1f}s ago)")  # fmt: skip
        if k.acked:
            self.tally.lost_to_dead_nodes += why == "dead"
            self.tally.lost_to_eviction += why == "evicted"
        self.keys[key] = Key()

    # -- a round --------------------------------------------------------------------------------

    def command(self, key: str) -> tuple[dict, str]:
        r = self.rng.random()
        n = self.rng.choice([1, 100, 4096, 60_000, 250_000]) if r < 0.5 else 0
        seed = self.rng.randrange(1 << 30)
        if r < 0.25:
            return {"op": "put", "key": key, "n": n, "seed": seed}, "put"
        if r < 0.35:
            return {"op": "put", "key": key, "n": n, "seed": seed, "upsert": True}, "upsert"
        if r < 0.45:
            return {"op": "put_from", "key": key, "n": n, "seed": seed}, "put"
        if r < 0.50:
            return {"op": "put", "key": key, "n": n, "seed": seed}, "put"
        if r < 0.75:
            return {"op": "get", "key": key}, "get"
        if r < 0.85:
            return {"op": "get_into", "key": key}, "get"
        return {"op": "remove", "key": key}, "remove"

    def round(self) -> None:
        keys = self.rng.sample(KEYS, len(self.clients))
        cmds = [self.command(k) for k in keys]
        for client, (cmd, _) in zip(self.clients, cmds, strict=True):
            client.send(cmd)
        t0 = time.monotonic()
        for client, (cmd, kind) in zip(self.clients, cmds, strict=True):
            rc = client.reply()
            if os.environ.get("KVPOOL_PROPERTY_DEBUG"):
                print(f"{time.monotonic() - t0:6.2f}s {cmd} -> {rc}", flush=True)
            self.apply(client, cmd, kind, rc)

    def apply(self, client: Client, cmd: dict, kind: str, rc) -> None:
        key, k = cmd["key"], self.keys[cmd["key"]]
        if kind == "get":
            got = rc if isinstance(rc, str) or rc is None else None
            assert not isinstance(rc, int) or rc in (-704, -800), f"get_into {key}: {rc}"
            self.check_read(key, got, cmd["op"])
        elif kind in ("put", "upsert"):
            new = digest(cmd["n"], cmd["seed"])
            present = bool(k.values) and not k.absent
            if rc == 0 and (kind == "upsert" or not k.values):
                self.acked(key, new, client.call({"op": "holders", "key": key}))
            elif rc == 0 and present and k.acked and not self.lost_legitimately(k):
                pass  # already there: the first value stays
            else:  # kept what was there, or replaced what may have gone; or it failed
                self.tally.failed_puts += rc != 0
                self.uncertain(key, new)
        elif kind == "remove":
            assert rc in (0, -704, -706), f"remove {key}: {rc}"
            if rc == 0:
                self.keys[key] = Key()
                self.tally.removed += 1
            elif rc == -704:
                self.check_read(key, None, "remove")  # not found: only if it may be absent

    # -- churn ----------------------------------------------------------------------------------

    def kill_node(self) -> None:
        node_id = self.rng.choice(NODES)
        self.nodes[node_id].stop(9)  # SIGKILL: no unmount, the master learns it late
        if os.environ.get("KVPOOL_PROPERTY_DEBUG"):
            print(f"KILL {node_id}", flush=True)
        self.died[node_id].append(time.monotonic())
        self.tally.node_kills += 1
        if self.rng.random() < 0.5:
            self.round()  # a round with the node down
        self.nodes[node_id] = self._node(node_id)  # back under the same id, empty

    def restart_client(self) -> None:
        holder = self.clients[0]
        assert holder.call({"op": "close"}) == 0  # its segment's objects go at once
        self.died[holder.hostname].append(time.monotonic())
        assert holder.call({"op": "setup", "segment": 8 * MiB}) == 0
        holder.hostname = holder.call({"op": "hostname"})
        self.died.setdefault(holder.hostname, [])
        self.tally.client_restarts += 1

    def evict_phase(self) -> None:
        """Puts of 1 MiB values until the pool must evict: every acknowledged value is then
        still there, or gone with an eviction the metrics show."""
        cold = [f"prop/cold/{i}" for i in range(10)]  # put once, never read: evicted first
        for i, key in enumerate(cold):
            self.keys[key] = Key()
            cmd = {"op": "put", "key": key, "n": 200_000, "seed": 1000 + i}
            self.apply(self.clients[2], cmd, "put", self.clients[2].call(cmd))
        before = self.stats()["evictions"]
        # well over twice the pool (3 nodes of 16 MiB, 16 MiB of client segments): whatever
        # no lease holds is evicted, the cold keys surely (60 puts did not always reach them)
        for i in range(150):
            cmd = {"op": "put", "key": f"prop/big/{i}", "n": MiB, "seed": i}
            assert self.clients[1].call(cmd) in (0, -200)
        after = self.stats()["evictions"]
        assert after > before, "no eviction: the phase did not fill the pool"
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        line = next(ln for ln in text.splitlines() if ln.startswith("kvpool_store_evictions_total"))
        assert float(line.split()[-1]) == after

    def verify_all(self) -> None:
        keys = list(self.keys)
        reply = self.clients[2].call({"op": "get_batch", "keys": keys})
        for key, got in zip(keys, reply, strict=True):
            self.check_read(key, got, "get_batch of every key")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for n in self.nodes.values():
            n.stop()
        self.master_proc.stop()


SEEDS = [int(os.environ["KVPOOL_PROPERTY_SEED"])] if "KVPOOL_PROPERTY_SEED" in os.environ \
    else [20261201, int(time.time()) % 100_000]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_acknowledged_puts_stay_readable_through_churn(seed):
    print(f"KVPOOL_PROPERTY_SEED={seed}")
    pool = Pool(seed)
    t0 = time.monotonic()
    try:
        for i in range(ROUNDS):
            if time.monotonic() - t0 > BUDGET_S:
                break
            r = pool.rng.random()
            if r < 0.06:
                pool.kill_node()
            elif r < 0.10:
                pool.restart_client()
            pool.round()
            if i % 30 == 29:
                pool.verify_all()
        pool.verify_all()
        pool.evict_phase()
        pool.verify_all()
    finally:
        pool.close()
    t = pool.tally
    print(f"seed {seed}: {t} in {time.monotonic() - t0:.0f} s")
    assert t.acked > 30 and t.verified > 30  # the run did real work
    assert t.lost_to_eviction > 0  # the cold keys went, and the metrics showed it
