"""vLLM servers for comparisons: ``vllm serve`` alone, and vLLM servers on kvpool's pool behind
the conductor (``kvpool bench compare --configs vllm,vllm-pool``; the vLLM tests use the same
code).

vLLM runs from its own virtualenv (``--vllm-python``, or ``$KVPOOL_VLLM_PYTHON``), with kvpool
installed into it for the connector; the model is a Hugging Face folder (``kvpool export-hf``).
Every process binds 127.0.0.1 (KV events go over ``ipc://`` sockets in the run's folder), and
the cores are shared out: one server gets them all, N servers get one each (round robin).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.bench.launch import MEASURE_FLAGS, Proc, free_port

logger = logging.getLogger(__name__)
VLLM_PRESETS: dict[str, dict] = {  # compiled graphs, as `vllm serve` runs by default
    "vllm": {"servers": 1, "pool": False},  # vllm serve alone: its own prefix cache
    "vllm-pool": {"servers": 2, "pool": True},  # two servers, one pool, the conductor
    "vllm-disaggregated": {"servers": 2, "pool": True, "roles": ["prefill", "decode"]},
}
START_TIMEOUT_S = 600.0  # a first start compiles vLLM's graphs (~1-2 min on 2 cores)


def vllm_env(run_dir: Path, cpus: str, kv_space_gib: int = 1) -> dict:
    """The environment of one vLLM server: offline, no usage stats, its cores, its KV space."""
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS", "VIRTUAL_ENV")}  # fmt: skip
    env.update(VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", TMPDIR=str(run_dir / "tmp"),
               VLLM_USE_AOT_COMPILE=os.environ.get("VLLM_USE_AOT_COMPILE", "0"))  # fmt: skip
    return env


@dataclass
class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port (``master``: with
    ``KVPoolConnector`` on that pool; ``events``: its KV events on that ZeroMQ endpoint)."""

    python: str
    model: str
    run_dir: Path
    name: str = "vllm"
    cpus: str = "0-1"
    master: str | None = None
    events: str | None = None
    replay: str | None = None
    max_model_len: int = 4096
    connector_stats: Path | None = None
    eager: bool = True  # no graph compilation: starts in ~30 s instead of minutes

    def start(self) -> VllmServer:
        return self.launch().wait()

    def launch(self) -> VllmServer:
        """Start the process (``wait()`` for it to be healthy)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               *(["--enforce-eager"] if self.eager else []), "--block-size", "32", "--max-model-len",
               str(self.max_model_len), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning"]  # fmt: skip
        if self.master:
            extra = {"master": self.master}
            if self.connector_stats:
                extra["stats_file"] = str(self.connector_stats)
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVPoolConnector",
                "kv_connector_module_path": "kvpool.integrations.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra})]  # fmt: skip
        if self.events:
            config = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": self.events}  # fmt: skip
            if self.replay:
                config["replay_endpoint"] = self.replay
            cmd += ["--kv-events-config", json.dumps(config)]
        env = vllm_env(self.run_dir, self.cpus)
        self.proc = Proc(cmd, self.run_dir / f"{self.name}.log", env)
        return self

    def wait(self) -> VllmServer:
        self.proc.wait_http(f"{self.url}/health", START_TIMEOUT_S, f"vLLM server {self.name}")
        return self

    def spec(self, role: str = "both") -> str:
        """Its ``kvpool conductor --vllm`` spec."""
        parts = [f"127.0.0.1:{self.port}", f"role={role}"]
        if self.events:
            parts.append(f"events={self.events}")
        if self.replay:
            parts.append(f"replay={self.replay}")
        return ",".join(parts)

    def stop(self) -> None:
        self.proc.stop()


def kvpool_cmd() -> list[str]:
    return [sys.executable, "-m", "kvpool.cli"]


class VllmCluster:
    """A pool (master + one node), ``n`` vLLM servers with the connector and KV events, and
    ``kvpool conductor`` in front of them (``roles``: each server's, default ``both``), plus
    kvpool workers of ``kvpool_roles`` (mixed clusters; one core each, after the servers')."""

    def __init__(self, python: str, model: str, run_dir: Path, n: int = 2,
                 roles: list[str] | None = None, node_memory: str = "2GiB",
                 conductor_flags: list[str] = (), kvpool_roles: list[str] = (),
                 eager: bool = True) -> None:  # fmt: skip
        self.python, self.model, self.run_dir, self.n = python, model, run_dir, n
        self.roles = roles or ["both"] * n
        self.kvpool_roles, self.eager = list(kvpool_roles), eager
        self.workers: list[dict] = []  # the kvpool workers' ready lines
        self.node_memory, self.conductor_flags = node_memory, list(conductor_flags)
        self.servers: list[VllmServer] = []
        self.procs: list[Proc] = []

    def start(self) -> VllmCluster:
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        try:
            self.master = f"127.0.0.1:{free_port()}"
            master = Proc([*kvpool_cmd(), "store", "master", "--port",
                           self.master.rsplit(":", 1)[1], "--log-level", "warning"],
                          d / "master.log", env)  # fmt: skip
            self.procs.append(master)
            master.wait_ready(60, "kvpool store master")
            node = Proc([*kvpool_cmd(), "store", "node", "--master", self.master, "--memory",
                         self.node_memory, "--log-level", "warning"], d / "node.log", env)  # fmt: skip
            self.procs.append(node)
            node.wait_ready(60, "kvpool store node")
            cores = os.cpu_count() or 1
            for i in range(self.n):
                sock = d / f"events-{i}"
                server = VllmServer(self.python, self.model, d, f"vllm-{i}", str(i % cores),
                                    self.master, f"ipc://{sock}.pub", f"ipc://{sock}.replay",
                                    connector_stats=d / f"vllm-{i}.stats.json",
                                    eager=self.eager)  # fmt: skip
                self.servers.append(server.launch())  # all at once: one core each
            for j, role in enumerate(self.kvpool_roles):
                w = Proc([*kvpool_cmd(), "worker", "--role", role, "--id", f"kvpool-{role}-{j}",
                          "--store", self.master, "--threads", "1", "--kv-cache-memory", "512MiB",
                          "--log-level", "warning"], d / f"kvpool-{role}-{j}.log",
                         {**env, "HF_HUB_OFFLINE": "1",
                          "OMP_NUM_THREADS": "1"})  # fmt: skip
                self.procs.append(w)
                w.wait_ready(300, f"kvpool worker {role}")
                self.workers.append(w.ready_info())
            for server in self.servers:
                server.wait()
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            cmd = [*kvpool_cmd(), "conductor", "--port", str(port), "--store", self.master,
                   "--model", self.model, "--vllm-model", self.model, "--log-level", "info",
                   *MEASURE_FLAGS, *self.conductor_flags]  # fmt: skip
            for server, role in zip(self.servers, self.roles, strict=True):
                cmd += ["--vllm", server.spec(role)]
            for w in self.workers:
                cmd += ["--worker", w["rpc"]]
            conductor = Proc(cmd, d / "conductor.log", env)
            self.procs.append(conductor)
            conductor.wait_http(f"{self.url}/health", 120, "kvpool conductor")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in reversed(self.procs):  # conductor first, then the node, then the master
            if p.log.name == "conductor.log":
                p.stop()
        for s in self.servers:
            if hasattr(s, "proc"):
                s.stop()
        for p in reversed(self.procs):
            p.stop()


def starters(names: list[str], python: str | None, model: str | None, out: Path,
             announce: Callable[[str], None] = logger.info) -> dict:  # fmt: skip
    """``kvpool bench compare`` starters for the vLLM presets in ``names`` (name -> a function
    returning ``(url, stop)``; ``announce``: told when each starts)."""
    python = python or os.environ.get("KVPOOL_VLLM_PYTHON")
    if not python:
        raise ValueError("the vLLM presets need --vllm-python (or $KVPOOL_VLLM_PYTHON): the "
                         "python of a virtualenv with vllm-cpu and kvpool installed")  # fmt: skip
    if model is None:
        from kvpool.model.loader import export_hf

        model = str(export_hf(None, str(out / "model-hf")))
    result = {}
    for name in names:
        preset = VLLM_PRESETS[name]

        def start(name=name, preset=preset):
            run_dir = out / "logs" / name
            announce(f"kvpool bench: starting {name} ({preset['servers']} vLLM server(s))")
            if not preset["pool"]:
                server = VllmServer(python, model, run_dir, name, eager=False).start()
                return server.url, server.stop
            cluster = VllmCluster(python, model, run_dir, preset["servers"],
                                  preset.get("roles"), eager=False).start()  # fmt: skip
            return cluster.url, cluster.stop

        result[name] = start
    return result
