"""What the weight and KV formats cost in quality, against float32 on the same file.

- Perplexity on a fixed public-domain text (tests/data/alice_ch1.txt, Lewis Carroll, 2,898
  SmolLM2 tokens), the quantized formats through the block kernel (``quality.block_path``:
  the path decode steps take), int8 KV read through the cache in chunks of 128 tokens; and
  top-1 agreement with float32 at every position.
- Greedy agreement: 8 chat prompts x 256 greedy tokens (``--quick``: 4 x 64) from the engine
  with each format against the float32 engine: the tokens they agree for before parting.
- q4 twice: with the prompt steps' activations on 16 bits (the default) and on 8
  (``KVPOOL_PROMPT_ACT8=1``, ``linear.PROMPT_ACT8``); figures of the 8-bit run end in ``_act8``.
- q4 once more as served (``_served``): the perplexity pass on the path the engine's prompt
  steps take on this machine (float32 BLAS, the block kernel or AMX tiles: ``autotune.py``;
  the compiled RoPE, RMSNorm and attention), not the block kernel's; ``prompt_tiles_served`` is 1 where that is AMX tiles. The greedy
  runs are the engine's, so always as served.

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
from kvpool.model import linear
from kvpool.model.llama import LlamaModel
from kvpool.model.loader import load_model
from kvpool.model.quality import block_path, next_token_logprobs

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "alice_ch1.txt"
# (weights, KV, 8-bit prompt activations)
FORMATS = [("q4", "auto", False), ("q4", "auto", True), ("int8", "auto", False),
           ("float32", "int8", False)]  # fmt: skip


def tag_of(weights: str, kv: str, act8: bool) -> str:
    return f"{weights}_kv{kv}" + ("_act8" if act8 else "")


def ppl(lp: torch.Tensor, ids: list[int]) -> float:
    return float(torch.exp(-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()))


def perplexities(res: Results, loaded, ids: list[int]) -> None:
    ref = LlamaModel(loaded.config, loaded.weights, torch.float32, "float32")
    log(f"perplexity: float32 over {len(ids)} tokens")
    ref_lp = {0: next_token_logprobs(ref, ids), 128: next_token_logprobs(ref, ids, chunk=128)}
    res.figure("ppl_float32", ppl(ref_lp[0], ids))
    for weights, kv, act8 in FORMATS:
        linear.PROMPT_ACT8 = act8
        tag = tag_of(weights, kv, act8)
        model = LlamaModel(loaded.config, loaded.weights, torch.float32, weights, kv,
                           loaded.path)  # fmt: skip
        chunk = 128 if kv == "int8" else 0
        log(f"perplexity: weights {weights}, KV {kv}, {8 if act8 else 16}-bit prompt activations")
        with block_path(model):
            lp = next_token_logprobs(model, ids, chunk=chunk)
        base = ref_lp[chunk]
        p = res.figure(f"ppl_{tag}", ppl(lp, ids))
        res.figure(f"ppl_{tag}_delta_pct", 100 * (p / ppl(base, ids) - 1))
        res.figure(f"top1_{tag}", float((lp.argmax(-1) == base.argmax(-1)).float().mean()))
    linear.PROMPT_ACT8 = False
    served = LlamaModel(loaded.config, loaded.weights, torch.float32, "q4", "auto", loaded.path)
    log(f"perplexity: q4 as served (prompt steps on AMX tiles: {served.prompt_tiles})")
    lp = next_token_logprobs(served, ids, served=True)
    p = res.figure("ppl_q4_kvauto_served", ppl(lp, ids))
    res.figure("ppl_q4_kvauto_served_delta_pct", 100 * (p / ppl(ref_lp[0], ids) - 1))
    res.figure(
        "top1_q4_kvauto_served", float((lp.argmax(-1) == ref_lp[0].argmax(-1)).float().mean())
    )
    res.figure("prompt_tiles_served", int(served.prompt_tiles))


def greedy(res: Results, loaded, n: int, new: int) -> None:
    log(f"greedy: {n} prompts x {new} tokens, float32 and {len(FORMATS)} formats")
    ref = greedy_runs(loaded, [("float32", "auto")], n, new)["tokens"][("float32", "auto")]
    for weights, kv, act8 in FORMATS:
        linear.PROMPT_ACT8 = act8
        run = greedy_runs(loaded, [(weights, kv)], n, new)["tokens"][(weights, kv)]
        agree = tokens_before_parting(ref, run)
        tag = tag_of(weights, kv, act8)
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
