"""What the weight and KV formats cost in quality, against float32 on the same file.

- Perplexity on a fixed public-domain text (tests/data/alice_ch1.txt, Lewis Carroll, 2,898
  SmolLM2 tokens), the quantized formats through the block kernel (``quality.block_path``:
  the path decode steps take), int8 KV read through the cache in chunks of 128 tokens; and
  top-1 agreement with float32 at every position.
- Greedy agreement: 8 chat prompts x 256 greedy tokens (``--quick``: 4 x 64) from the engine
  with each format against the float32 engine: the tokens they agree for before parting.

  python benchmarks/bench_quality.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log

from kvpool.engine.quality import greedy_runs, tokens_before_parting
from kvpool.model.llama import LlamaModel
from kvpool.model.loader import load_model
from kvpool.model.quality import block_path, next_token_logprobs

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "alice_ch1.txt"
FORMATS = [("q4", "auto"), ("int8", "auto"), ("float32", "int8")]  # (weights, KV)


def ppl(lp: torch.Tensor, ids: list[int]) -> float:
    return float(torch.exp(-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()))


def perplexities(res: Results, loaded, ids: list[int]) -> None:
    ref = LlamaModel(loaded.config, loaded.weights, torch.float32, "float32")
    log(f"perplexity: float32 over {len(ids)} tokens")
    ref_lp = {0: next_token_logprobs(ref, ids), 128: next_token_logprobs(ref, ids, chunk=128)}
    res.figure("ppl_float32", ppl(ref_lp[0], ids))
    for weights, kv in FORMATS:
        tag = f"{weights}_kv{kv}"
        model = LlamaModel(loaded.config, loaded.weights, torch.float32, weights, kv,
                           loaded.path)  # fmt: skip
        chunk = 128 if kv == "int8" else 0
        log(f"perplexity: weights {weights}, KV {kv}")
        with block_path(model):
            lp = next_token_logprobs(model, ids, chunk=chunk)
        base = ref_lp[chunk]
        p = res.figure(f"ppl_{tag}", ppl(lp, ids))
        res.figure(f"ppl_{tag}_delta_pct", 100 * (p / ppl(base, ids) - 1))
        res.figure(f"top1_{tag}", float((lp.argmax(-1) == base.argmax(-1)).float().mean()))


def greedy(res: Results, loaded, n: int, new: int) -> None:
    log(f"greedy: {n} prompts x {new} tokens, float32 and {len(FORMATS)} formats")
    runs = greedy_runs(loaded, [("float32", "auto"), *FORMATS], n, new)["tokens"]
    for weights, kv in FORMATS:
        agree = tokens_before_parting(runs[("float32", "auto")], runs[(weights, kv)])
        tag = f"{weights}_kv{kv}"
        res.figure(f"greedy_{tag}_equal_sequences", sum(a == new for a in agree))
        res.figure(f"greedy_{tag}_mean_tokens_before_parting", sum(agree) / len(agree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the greedy part on 4 x 64 tokens")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    res = Results("bench_quality", vars(args))
    loaded = load_model(None)
    ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    perplexities(res, loaded, ids)
    greedy(res, loaded, *((4, 64) if args.quick else (8, 256)))
    res.dump(args.json)


if __name__ == "__main__":
    main()
