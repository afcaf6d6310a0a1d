"""lm-eval-harness (``lm_eval --model local-completions``) against `kvpool serve --single` with
the real model, on the 20-question multiple-choice task kept in tests/data/lm_eval/: every
loglikelihood request is an ``echo`` completion with prompt logprobs (several prompts per
request: ``--batch_size 4``); the run must end with a score. lm-eval is installed on first use
into .cache/lm-eval-venv (``lm_eval_venv.py``); nothing comes from a model or dataset hub."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import lm_eval_venv
import pytest
from support.procs import kvpool_cmd, serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TASK = "kvpool_mini_mc"
TASK_DIR = Path(__file__).resolve().parents[2] / "data" / "lm_eval"
QUESTIONS, CHOICES = 20, 4
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def lm_eval_bin() -> Path:
    if importlib.util.find_spec("ensurepip") is None:
        pytest.skip("this Python has no ensurepip: cannot create lm-eval's virtualenv")
    try:
        took = lm_eval_venv.ensure()
    except lm_eval_venv.InstallError as exc:
        pytest.fail(f"installing lm-eval failed: {exc}")
    if took:
        print(f"lm-eval installed into {lm_eval_venv.VENV} in {took:.0f} s")
    return lm_eval_venv.lm_eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("lm-eval-serve") / "serve.log"
    for _proc, url in serve(log, "--single", "--kv-cache-memory", "256MiB"):
        yield url


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The model as a Hugging Face folder (`kvpool export-hf`): lm-eval's tokenizer."""
    out = tmp_path_factory.mktemp("smollm2-hf")
    subprocess.run([*kvpool_cmd(), "export-hf", "--out", str(out)], check=True, timeout=600,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    return out


def engine_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^kvpool_request_success_total\{.*\} (\S+)$",
                                            text, re.M))  # fmt: skip


def test_lm_eval_local_completions_runs_to_a_score(lm_eval_bin, server, tokenizer_dir,
                                                   tmp_path):  # fmt: skip
    before = engine_requests(server)
    args = ",".join([f"model={MODEL}", f"base_url={server}/v1/completions",
                     "tokenizer_backend=huggingface", f"tokenizer={tokenizer_dir}",
                     "tokenized_requests=True", "max_retries=1", "timeout=300"])  # fmt: skip
    cmd = [str(lm_eval_bin), "run", "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "4",
           "--output_path", str(tmp_path / "out"), "--seed", "1234"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "unused"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    run = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip
    took = time.monotonic() - t0
    assert run.returncode == 0, f"lm_eval failed ({run.returncode}):\n{run.stderr[-4000:]}"
    files = sorted((tmp_path / "out").rglob("results_*.json"))
    assert files, f"no results file:\n{run.stdout[-2000:]}"
    results = json.loads(files[-1].read_text())["results"][TASK]
    acc, acc_norm = results["acc,none"], results["acc_norm,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert isinstance(acc_norm, float) and 0.0 <= acc_norm <= 1.0
    # one engine request per (question, choice): every loglikelihood request reached the engine
    assert engine_requests(server) - before == QUESTIONS * CHOICES
    print(f"lm-eval {TASK}: acc {acc:.3f}, acc_norm {acc_norm:.3f}, {took:.1f} s")
    assert acc >= 0.5  # 20 easy questions: chance is 0.25
