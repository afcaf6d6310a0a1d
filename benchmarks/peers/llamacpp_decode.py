"""Greedy one-stream decode on llama.cpp; run by the llama.cpp venv's python (llamacpp_peer.py).

Must not import kvpool (not installed in that venv). ``llama_cpp.Llama`` only loads the model
and creates the context; each step is then one ``llama_decode`` through the C API
(``llama_batch_get_one``: the prompt in chunks of ``n_batch``, then one token at a time) and
the next token is the argmax (numpy) over ``llama_get_logits_ith(ctx, -1)``, read in place.
That is greedy decoding (temperature 0, EOS ignored) with no sampler chain and none of the
high-level API's per-token Python (``Llama.generate``/``eval`` bookkeeping), so the time is
llama.cpp's. A warm-up run comes first, then ``--rounds`` timed runs, each on a cleared KV
cache. One JSON object goes to stdout; progress goes to stderr.

  python llamacpp_decode.py --model FILE.gguf --prompt PROMPT.json --new-tokens 128 \
      --rounds 3 --threads 2 [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time


def say(msg: str) -> None:
    print(f"[llamacpp_decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--prompt", required=True, help="JSON file: a list of token ids")
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on")
    args = ap.parse_args()

    import llama_cpp
    import numpy as np

    with open(args.prompt) as f:
        prompt = [int(t) for t in json.load(f)]
    if not prompt or args.new_tokens < 2:
        sys.exit("need a non-empty prompt and --new-tokens >= 2")
    needed = len(prompt) + args.new_tokens
    n_ctx = max(512, -(-needed // 256) * 256)

    t0 = time.monotonic()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=args.n_batch,
        n_ubatch=args.n_batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=args.flash_attn == "on",
        logits_all=False,
        verbose=False,
    )
    load_s = time.monotonic() - t0
    ctx = llm.ctx
    n_vocab = llm.n_vocab()
    memory = llama_cpp.llama_get_memory(ctx)
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    say(f"llama_cpp {llama_cpp.__version__}, loaded in {load_s:.2f} s, n_ctx {n_ctx}; {info}")

    def decode(tokens: list[int]) -> None:
        for i in range(0, len(tokens), args.n_batch):
            chunk = tokens[i : i + args.n_batch]
            arr = (llama_cpp.llama_token * len(chunk))(*chunk)
            rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,))
        return int(logits.argmax())

    def run(n_new: int) -> tuple[float, float, list[int]]:
        """(time to first token, seconds after it, the n_new greedy tokens)."""
        llama_cpp.llama_memory_clear(memory, True)
        llama_cpp.llama_perf_context_reset(ctx)
        start = time.perf_counter()
        decode(prompt)
        out = [argmax()]
        first = time.perf_counter()
        while len(out) < n_new:
            decode(out[-1:])
            out.append(argmax())
        end = time.perf_counter()
        return first - start, end - first, out

    def perf() -> dict:
        d = llama_cpp.llama_perf_context(ctx)
        return {
            "prompt_eval_ms": d.t_p_eval_ms,
            "prompt_eval_tokens": d.n_p_eval,
            "eval_ms": d.t_eval_ms,
            "eval_tokens": d.n_eval,
            "eval_ms_per_token": d.t_eval_ms / d.n_eval if d.n_eval else None,
        }

    load_before = os.getloadavg()
    warm_ttft, warm_rest, _ = run(min(args.new_tokens, 16))
    say(f"warm-up: ttft {warm_ttft * 1e3:.1f} ms, {warm_rest:.2f} s after it")
    rounds = []
    for r in range(args.rounds):
        ttft, rest, out = run(args.new_tokens)
        rounds.append(
            {
                "ttft_s": ttft,
                "decode_s": rest,
                "decode_tok_s": (len(out) - 1) / rest,
                "token_ids": out,
                "llama_perf": perf(),
            }
        )
        say(
            f"round {r + 1}/{args.rounds}: ttft {ttft * 1e3:.1f} ms, "
            f"decode {(len(out) - 1) / rest:.1f} tok/s"
        )
    result = {
        "llama_cpp_version": llama_cpp.__version__,
        "system_info": info,
        "model": args.model,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "n_ctx": n_ctx,
        "n_batch": args.n_batch,
        "flash_attn": args.flash_attn == "on",
        "load_s": load_s,
        "ttft_s_rounds": [r["ttft_s"] for r in rounds],
        "decode_tok_s_rounds": [r["decode_tok_s"] for r in rounds],
        "ttft_s": statistics.median(r["ttft_s"] for r in rounds),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rounds),
        "token_ids": rounds[0]["token_ids"],
        "tokens_equal_across_rounds": all(r["token_ids"] == rounds[0]["token_ids"] for r in rounds),
        "llama_perf_rounds": [r["llama_perf"] for r in rounds],
        # llama.cpp's threads wait for each other at every op: another busy process on a core
        # slows it by up to 50x here, so the load is recorded
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
