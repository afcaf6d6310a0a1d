"""Run vLLM offline on token-id prompts, with or without kvpool's pool: the tests' and the
benchmark's driver, and a small demo. Runs with a python that has vLLM (and kvpool) installed.

    python -m kvpool.integrations.vllm.offline --model DIR --prompts P.json --new-tokens 16 \
        [--master HOST:PORT] --out RESULT.json

Per prompt, in order: the time of a one-token generate (the TTFT of a lone request) and the
greedy continuation of ``--new-tokens``. vLLM's own prefix cache is off, so whatever is
reused comes from the pool. ``--cold`` adds each prompt's cold continuation computed by the
same process (a salted request: the connector neither loads nor saves it). With ``--master``
the worker's connector writes its counters to ``RESULT.json.stats`` (``stats_file``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

logger = logging.getLogger("kvpool.vllm.offline")


def say(msg: str) -> None:
    logger.info(msg)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[kvpool-vllm %(asctime)s] %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (kvpool export-hf)")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--master", default=None, help="kvpool store master: use the pool")
    ap.add_argument("--example-storage", default=None,
                    help="use vLLM's own ExampleConnector (KV files in this folder) instead")  # fmt: skip
    ap.add_argument("--mooncake", action="store_true",
                    help="use vLLM's MooncakeStoreConnector instead (its client config in "
                         "$MOONCAKE_CONFIG_PATH)")  # fmt: skip
    ap.add_argument("--whole-vllm-blocks", action="store_true",
                    help="load whole vLLM blocks only, one prompt token left (partial_blocks "
                         "false: ExampleConnector's rule)")  # fmt: skip
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vLLM's own prefix cache on (off by default: reuse comes from the pool)",
    )
    ap.add_argument("--cold", action="store_true",
                    help="also run each prompt with a cache salt (never loaded from the pool, "
                         "never saved, no prefix cache): the cold reference from this same "
                         "process, as \"cold_tokens\"")  # fmt: skip
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--pool-dtype",
        default=None,
        help="the pool objects' dtype when not vLLM's (the connector converts)",
    )
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    kw: dict = {}
    if args.master or args.example_storage or args.mooncake:
        from vllm.config import KVTransferConfig

        if args.master:
            extra = {"master": args.master, "stats_file": args.out + ".stats",
                     "partial_blocks": not args.whole_vllm_blocks}  # fmt: skip
            if args.pool_dtype:
                extra["pool_dtype"] = args.pool_dtype
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.integrations.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra)  # fmt: skip
        elif args.mooncake:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                kv_connector_extra_config={"load_async": True})  # fmt: skip
        else:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="ExampleConnector", kv_role="kv_both",
                kv_connector_extra_config={"shared_storage_path": args.example_storage})  # fmt: skip
    with open(args.prompts) as f:
        prompts = json.load(f)
    t0 = time.monotonic()
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, seed=0,
              max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=args.prefix_caching, **kw)  # fmt: skip
    how = args.master or (
        f"ExampleConnector {args.example_storage}" if args.example_storage else
        "MooncakeStoreConnector" if args.mooncake else "none"
    )  # fmt: skip
    say(f"vLLM loaded in {time.monotonic() - t0:.1f} s (pool: {how})")

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": list(range(100, 140))}], params(2), use_tqdm=False)
    results = []
    for p in prompts:
        t0 = time.monotonic()
        llm.generate([{"prompt_token_ids": p}], params(1), use_tqdm=False)
        ttft = time.monotonic() - t0
        out = llm.generate([{"prompt_token_ids": p}], params(args.new_tokens), use_tqdm=False)
        results.append({"ttft_s": ttft, "tokens": list(out[0].outputs[0].token_ids)})
        say(f"prompt of {len(p)} tokens: TTFT {ttft:.3f} s")
    for p, res in zip(prompts if args.cold else [], results, strict=False):
        salted = {"prompt_token_ids": p, "cache_salt": "kvpool-offline-cold"}
        out = llm.generate([salted], params(args.new_tokens), use_tqdm=False)
        res["cold_tokens"] = list(out[0].outputs[0].token_ids)
    with open(args.out, "w") as f:
        json.dump({"results": results, "pool": args.master, "example": args.example_storage}, f)


if __name__ == "__main__":
    main()
