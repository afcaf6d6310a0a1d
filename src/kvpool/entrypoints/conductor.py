"""``kvpool conductor``: the front door and global scheduler (CLI code: prints are fine)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from kvpool.common import auth
from kvpool.conductor.policies import POLICIES
from kvpool.config import ConductorConfig
from kvpool.entrypoints import common


def add_conductor_args(p: argparse.ArgumentParser) -> None:
    """Routing and admission flags (shared by ``conductor`` and ``serve``)."""
    p.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES))
    p.add_argument("--balancing-threshold", type=float, default=0.25,
                   help="cache_aware: how much slower (ratio) the holder of the longest "
                        "prefix may be before another worker pulls it from the pool")  # fmt: skip
    p.add_argument("--slo-ttft", type=float, default=30.0, help="TTFT SLO, seconds (0: off)")
    p.add_argument("--slo-tbt", type=float, default=2.0, help="TBT SLO, seconds (0: off)")
    p.add_argument("--decode-prefill-tokens", type=int, default=64, metavar="N",
                   help="skip the prefill hand-off when the decode worker has at most N "
                        "prompt tokens left to compute after its cache and the pool and "
                        "decodes no stream (or handing off would break --slo-ttft) "
                        "(default %(default)s; 0: always hand off)")  # fmt: skip
    p.add_argument("--decode-prefill-gain", type=float, default=2.0, metavar="X",
                   help="a decode worker computes a whole prompt itself when that divides its "
                        "predicted TTFT by X or more (the prefill workers are that far behind), "
                        "saves more than it delays the worker's running streams, and keeps "
                        "--slo-tbt (default %(default)s; 0: never)")  # fmt: skip
    p.add_argument("--max-inflight", type=int, default=64,
                   help="requests in flight before new ones get 429 (default %(default)s)")  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("conductor", help="the OpenAI front door over separate workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker's control RPC address (repeat; or use --etcd)")  # fmt: skip
    p.add_argument("--etcd", default=None, help="etcd endpoints where workers register")
    p.add_argument("--store", default=None, help="the pool's master HOST:PORT or etcd://...")
    p.add_argument("--model", default=None, help="model whose tokenizer to load (default SmolLM2)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--vllm", action="append", default=[], metavar="SPEC",
                   help="a vLLM OpenAI server with KVPoolConnector: HOST:PORT[,role=both|prefill|"
                        "decode][,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT] (repeat; its API "
                        "key, if any, in $KVPOOL_VLLM_API_KEY)")  # fmt: skip
    p.add_argument(
        "--vllm-model",
        default=None,
        help="the Hugging Face folder the vLLM servers serve (default: --model)",
    )
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the vLLM servers' --dtype (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--prefill-wait",
        type=float,
        default=5.0,
        help="seconds a vLLM prefill's KV may take to reach the pool (default 5)",
    )
    add_conductor_args(p)
    common.add_http_args(p)
    p.add_argument("--log-level", default="info")
    auth.add_token_args(p)
    p.set_defaults(func=run)


def conductor_config(args: argparse.Namespace, workers: list[str] | None = None) -> ConductorConfig:
    """The conductor's config from its flags (shared by ``conductor`` and ``serve``)."""
    return ConductorConfig(
        host=args.host, port=args.port, workers=list(workers or getattr(args, "worker", [])),
        etcd=getattr(args, "etcd", None), store=getattr(args, "store", None), model=args.model,
        served_model_name=common.served_name(args), policy=args.policy,
        balancing_threshold=args.balancing_threshold, slo_ttft=args.slo_ttft,
        slo_tbt=args.slo_tbt, decode_prefill_tokens=args.decode_prefill_tokens,
        decode_prefill_gain=args.decode_prefill_gain,
        max_inflight=args.max_inflight, log_level=args.log_level,
        http=common.http_limits(args), vllm=list(getattr(args, "vllm", [])),
        vllm_model=getattr(args, "vllm_model", None),
        vllm_dtype=getattr(args, "vllm_dtype", "float32"),
        prefill_wait=getattr(args, "prefill_wait", 5.0))  # fmt: skip


def build(cfg: ConductorConfig, token: str | None):
    """A started ClusterState and the Conductor over it."""
    from kvpool.conductor.api import Conductor
    from kvpool.conductor.cluster import ClusterState
    from kvpool.conductor.policies import get_policy
    from kvpool.conductor.router import Router, SLOConfig
    from kvpool.model.loader import load_tokenizer

    kwargs = {"balancing_threshold": cfg.balancing_threshold} \
        if cfg.policy == "cache_aware" else {}  # fmt: skip
    router = Router(
        get_policy(cfg.policy, **kwargs),
        SLOConfig(cfg.slo_ttft or None, cfg.slo_tbt or None, cfg.max_inflight),
        cfg.decode_prefill_tokens,
        cfg.decode_prefill_gain,
    )
    from kvpool.conductor.vllm import VllmSpec

    specs = [VllmSpec.parse(v) for v in cfg.vllm]
    cluster = ClusterState(cfg.workers, etcd=cfg.etcd, store=cfg.store, token=token or "",
                           vllm=specs, vllm_model=cfg.vllm_model or cfg.model,
                           vllm_dtype=cfg.vllm_dtype,
                           vllm_api_key=os.environ.get("KVPOOL_VLLM_API_KEY") or None).start()  # fmt: skip
    tok = load_tokenizer(cfg.model or cfg.vllm_model)
    return Conductor(cluster, router, tok, cfg.served_model_name, token=token,
                     prefill_wait=cfg.prefill_wait)  # fmt: skip


async def serve_conductor(conductor, cfg: ConductorConfig, on_ready=None) -> None:
    """Serve the conductor's API on ``cfg.host:cfg.port`` (API key: ``auth.api_key()``)."""
    from kvpool.conductor.api import build_conductor_app
    from kvpool.serving.http_limits import serve_http

    key = auth.api_key()
    app = build_conductor_app(conductor, [key] if key else [], cfg.http)
    try:
        await serve_http(app, cfg.http, cfg.log_level, on_ready, host=cfg.host, port=cfg.port)
    finally:
        await conductor.close()


def run(args: argparse.Namespace) -> int:
    token = auth.cluster_token()
    if common.refuse_open_bind("conductor", args.host, token):
        return 2
    if not args.worker and not args.etcd and not args.vllm:
        print("kvpool conductor: give --worker addresses, --etcd or --vllm servers",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        cfg = conductor_config(args)
        if cfg.vllm:
            from kvpool.conductor.vllm import VllmSpec

            for v in cfg.vllm:
                VllmSpec.parse(v)
            if not (cfg.vllm_model or cfg.model):
                raise ValueError("--vllm needs --vllm-model (or --model): the folder they serve")
    except ValueError as exc:
        print(f"kvpool conductor: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from kvpool.common.log import setup_logging

    setup_logging(cfg.log_level)
    previous = common.sigterm_as_interrupt()
    conductor = None
    try:
        conductor = build(cfg, token)
        ready = lambda: print(f"kvpool conductor: ready on http://{cfg.host}:{cfg.port}/v1",  # noqa: E731
                              flush=True)  # fmt: skip
        asyncio.run(serve_conductor(conductor, cfg, ready))
    except KeyboardInterrupt:
        pass
    finally:
        if conductor is not None:
            conductor.cluster.close()
        signal.signal(signal.SIGTERM, previous)
    return 0
