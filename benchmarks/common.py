"""Helpers shared by the benchmarks: timing, result tables, JSON output, the cache folder."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVPOOL_BENCH_CACHE", ROOT / ".cache" / "bench"))


def share_torch(venv: Path, torch_spec: str) -> bool:
    """When the Python running this has ``torch_spec``'s torch (kvpool's venv has the pin),
    make its site-packages visible to the virtualenv ``venv`` after the venv's own (a ``.pth``
    line), so pip finds torch installed instead of unpacking a second copy (a minute or more
    here); whatever else the venv needs in other versions pip installs into it, where it comes
    first ("outside environment": pip leaves the shared packages alone). False (nothing done)
    when the versions or the Python minor versions differ."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.metadata.version("torch").split("+")[0] != torch_spec.split("==")[1]:
            return False
    except importlib.metadata.PackageNotFoundError:
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    shared = Path(spec.origin).resolve().parents[1]  # the site-packages that holds torch
    site = (
        venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )
    if not site.is_dir():
        return False
    (site / "zz-kvpool-shared-torch.pth").write_text(f"{shared}\n")
    return True


def log(msg: str) -> None:
    """Progress line on stderr (benchmarks are long; say what is happening)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Results:
    """Figures and ratios of one benchmark run, printed as a table and saved as JSON."""

    def __init__(self, name: str, args: dict) -> None:
        self.name = name
        self.args = args
        self.figures: dict[str, float] = {}
        self.ratios: dict[str, float] = {}

    def figure(self, key: str, value: float) -> float:
        self.figures[key] = round(float(value), 4)
        log(f"{key} = {value:.4g}")
        return value

    def ratio(self, key: str, ours: float, base: float, higher_is_better: bool = True) -> None:
        r = ours / base if base else float("nan")
        self.ratios[key] = round(r, 3)
        log(f"{key} = {r:.2f}x" + ("" if higher_is_better else " (lower is better)"))

    def dump(self, path: str | None) -> None:
        width = max(len(k) for k in [*self.figures, *self.ratios, "x"])
        print(f"\n== {self.name}")
        for k, v in self.figures.items():
            print(f"  {k:<{width}}  {v:>12.4g}")
        print("  ratios:")
        for k, v in self.ratios.items():
            print(f"  {k:<{width}}  {v:>11.2f}x")
        if path:
            doc = {
                "benchmark": self.name,
                "args": self.args,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
                "figures": self.figures,
                "ratios": self.ratios,
            }
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(doc, indent=2) + "\n")
            log(f"wrote {path}")


class KvpoolProcs:
    """``kvpool`` subcommands started as processes, each read up to the JSON line it prints
    when ready; ``close`` stops them, last first."""

    def __init__(self, logs: Path, env: dict | None = None) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs, self.env = logs, env
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *argv: str) -> dict:
        err = (self.logs / f"{name}.log").open("w")
        cmd = [sys.executable, "-m", "kvpool.cli", *argv, "--log-level", "warning"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=self.env)
        self.procs.append(proc)
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvpool {name} did not start; see {err.name}")
        return json.loads(line)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
