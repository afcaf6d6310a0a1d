"""Time vllm's offline LLM.generate on token-id prompts; run by the vllm venv's python.

Started by vllm_peer.py; must not import kvpool (it is not installed in that venv).

  python vllm_offline.py --model DIR --prompts PROMPTS.json --new-tokens N --dtype float32 \
      --prefix-caching on --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def say(msg: str) -> None:
    print(f"[vllm_offline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    with open(args.prompts) as f:
        prompts = json.load(f)
    supported = [str(d).removeprefix("torch.") for d in current_platform.supported_dtypes]
    dtype, dtype_note = args.dtype, ""
    if dtype not in supported:
        dtype = "float32" if "float32" in supported else supported[0]
        dtype_note = (
            f"{args.dtype} is not supported by vllm on this CPU ({supported}); used {dtype}"
        )
        say(dtype_note)
    say(
        f"vllm {vllm.__version__}, torch {torch.__version__}, {len(prompts)} prompts, "
        f"dtype {dtype} (supported {supported}), prefix caching {args.prefix_caching}"
    )

    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        dtype=dtype,
        enable_prefix_caching=args.prefix_caching == "on",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
    )
    load_s = time.monotonic() - t0
    used_dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    if used_dtype != args.dtype and not dtype_note:
        dtype_note = f"vllm chose {used_dtype} for the requested {args.dtype}"
    say(f"loaded in {load_s:.1f} s; model dtype {used_dtype}")

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    t0 = time.monotonic()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}], params(4), use_tqdm=False)
    warm_s = time.monotonic() - t0
    say(f"warm-up {warm_s:.2f} s")

    t0 = time.monotonic()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params(args.new_tokens), use_tqdm=False
    )
    seconds = time.monotonic() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = [getattr(o, "num_cached_tokens", None) for o in outs]
    hit = sum(c for c in cached if c) if any(c is not None for c in cached) else None
    say(f"generate {seconds:.3f} s, {out_tokens} tokens out, prefix-cache hit tokens {hit}")

    result = {
        "seconds": seconds,
        "load_seconds": load_s,
        "warmup_seconds": warm_s,
        "output_tokens": out_tokens,
        "prefix_cache_hit_tokens": hit,
        "prefix_caching": args.prefix_caching == "on",
        "dtype": used_dtype,
        "dtype_requested": args.dtype,
        "dtype_note": dtype_note,
        "supported_dtypes": supported,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "first_output": list(outs[0].outputs[0].token_ids[:8]),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
