"""The differential suite's harness: run ``mooncake_scenarios.py`` against kvpool and against
the real Mooncake wheel, and compare call by call.

Mooncake runs from the benchmarks' virtualenv (``.cache/bench/mooncake-venv``, made by
``benchmarks/peers/mooncake_transfer_peer.py``; never by ``make test``). Where it is missing,
the comparison is against the recording in ``tests/data/mooncake_golden.json``, made with::

    .venv/bin/python tests/integration/mooncake/mooncake_diff.py --record   # installs the peer if needed

which also prints the report (methods covered, calls compared, mismatches). The recording
carries a digest of the scenarios: a changed scenario needs a new recording.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SCENARIOS = HERE / "mooncake_scenarios.py"
GOLDEN = ROOT / "tests" / "data" / "mooncake_golden.json"
sys.path.insert(0, str(HERE))

import mooncake_scenarios  # noqa: E402

# Differences on purpose, by (scenario, label): what kvpool answers instead, and why.
DOCUMENTED = {
    ("zero_copy", "put_from unregistered"): "kvpool refuses memory that was not registered "
    "(-600); Mooncake's TCP path reads whatever is at the address",
    ("zero_copy", "put_from zero"): "kvpool answers -600 to a 0-byte put_from (as Mooncake's "
    "batch_put_from does); Mooncake's single put_from answers 0 and stores nothing, a success "
    "that cannot be read",
    ("replicas", "soft pin old spelling"): "kvpool also accepts ReplicateConfig.with_soft_pin "
    "(Mooncake's earlier spelling of soft_pin_action = ENABLE); 0.3.13 has no such field",
    ("replicas", "same node"): "Mooncake 0.3.13 answers -600 to every put with "
    "prefer_alloc_in_same_node; kvpool places the replica on the caller's own segment",
    ("tensors", "scalar back"): "a 0-dimensional tensor comes back with shape () from kvpool, "
    "(1,) from Mooncake (the stored bytes are the same: see 'scalar value')",
    ("replicas", "all readable"): "follows from the two rows above (those puts stored nothing "
    "in Mooncake)",
}
TIMEOUT_S = 900


def digest() -> str:
    return hashlib.sha256(SCENARIOS.read_bytes()).hexdigest()[:16]


def kvpool_master_cmd() -> list[str]:
    kvpool = Path(sys.executable).with_name("kvpool")
    return [str(kvpool), "store", "master", "--host", "127.0.0.1", "--port", "{port}",
            "--lease-ttl", str(mooncake_scenarios.LEASE_S)]  # fmt: skip


def _peer_module():
    """``benchmarks/peers/mooncake_transfer_peer.py`` (its ``common`` is the benchmarks' one,
    not the ``tests/common`` folder pytest may have imported under that name)."""
    if "mooncake_transfer_peer" in sys.modules:
        return sys.modules["mooncake_transfer_peer"]
    saved = sys.modules.pop("common", None)
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]
    try:
        import mooncake_transfer_peer
    finally:
        sys.path[:2] = []
        sys.modules.pop("common", None)
        if saved is not None:
            sys.modules["common"] = saved
    return mooncake_transfer_peer


def mooncake_peer() -> tuple[str, dict, list[str], str] | None:
    """(python, env, master argv, version) of an installed Mooncake peer with torch, or None."""
    mtp = _peer_module()

    info = mtp._installed()
    if info is None:
        return None
    python = str(mtp.VENV / "bin" / "python")
    masters = sorted(mtp.VENV.glob("lib/python*/site-packages/mooncake/mooncake_master"))
    env = mtp._env(extra_libs=bool(info.get("extra_libs")))
    has_torch = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True)
    if not masters or has_torch.returncode != 0:
        return None
    cmd = [str(masters[0]), "-rpc_address=127.0.0.1", "-rpc_port={port}",
           "-metrics_host=127.0.0.1", "-metrics_port={port2}", "-enable_metric_reporting=false",
           f"-default_kv_lease_ttl={int(mooncake_scenarios.LEASE_S * 1000)}"]  # fmt: skip
    return python, env, cmd, str(info.get("version"))


def install_peer() -> None:
    """The Mooncake virtualenv (as the store benchmark makes it), with CPU torch in it."""
    mtp = _peer_module()

    if mtp.ensure_venv() is None:
        raise SystemExit(f"cannot install the Mooncake peer: {mtp.last_error}")
    pip = [str(mtp.VENV / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"]
    subprocess.run(pip, check=True, env=mtp._env(extra_libs=False))


def run(impl: str, python: str, env: dict, master_cmd: list[str],
        names: list[str] | None = None) -> dict:  # fmt: skip
    """``{scenario: [[label, method, result], ...]}`` from one implementation."""
    job = {"master_cmd": master_cmd, "scenarios": names or list(mooncake_scenarios.SCENARIOS)}
    proc = subprocess.run([python, str(SCENARIOS), impl], input=json.dumps(job), text=True,
                          capture_output=True, env=env, timeout=TIMEOUT_S, cwd=str(HERE))  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} scenarios failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def run_kvpool(names: list[str] | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("KVPOOL_AUTH_TOKEN", "KVPOOL_AUTH_TOKEN_FILE", "KVPOOL_ADMIN_TOKEN"):
        env.pop(var, None)
    return run("kvpool", sys.executable, env, kvpool_master_cmd(), names)


def compare(ours: dict, theirs: dict) -> dict:
    """Per-call comparison: counts, the methods covered, mismatches and documented ones."""
    calls, methods, mismatches, documented = 0, set(), [], []
    for name, records in theirs.items():
        mine = ours.get(name, [])
        if [r[:2] for r in mine] != [r[:2] for r in records]:
            mismatches.append({"scenario": name, "label": "(the sequence of calls differs)"})
            continue
        for (label, method, want), (_, _, got) in zip(records, mine, strict=True):
            calls += 1
            methods.add(method)
            if got == want:
                continue
            item = {"scenario": name, "label": label, "mooncake": want, "kvpool": got}
            if (name, label) in DOCUMENTED:
                documented.append({**item, "why": DOCUMENTED[(name, label)]})
            else:
                mismatches.append(item)
    return {"calls": calls, "methods": sorted(methods), "mismatches": mismatches,
            "documented": documented}  # fmt: skip


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


def report(result: dict, source: str) -> str:
    lines = [f"differential suite against {source}: {result['calls']} calls compared over "
             f"{len(result['methods'])} methods, {len(result['mismatches'])} mismatches, "
             f"{len(result['documented'])} documented differences",
             "methods: " + ", ".join(result["methods"])]  # fmt: skip
    for m in result["mismatches"]:
        lines.append(f"MISMATCH {m['scenario']} / {m['label']}: mooncake {m.get('mooncake')!r} "
                     f"kvpool {m.get('kvpool')!r}")  # fmt: skip
    for d in result["documented"]:
        lines.append(f"documented {d['scenario']} / {d['label']}: {d['why']}")
    return "\n".join(lines)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="record Mooncake's answers anew")
    ap.add_argument("--json", metavar="PATH", help="write the comparison here")
    args = ap.parse_args()
    if args.record:
        if mooncake_peer() is None:
            install_peer()
        python, env, cmd, version = mooncake_peer() or sys.exit("no Mooncake peer")
        theirs = run("mooncake", python, env, cmd)
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"mooncake_version": version, "scenarios_digest": digest(),
                                      "results": theirs}, indent=1) + "\n")  # fmt: skip
        source = f"Mooncake {version} (live, recorded to {GOLDEN.relative_to(ROOT)})"
    else:
        golden = load_golden()
        theirs, source = (
            golden["results"],
            f"the recording of Mooncake {golden['mooncake_version']}",
        )
    result = compare(run_kvpool(), theirs)
    print(report(result, source))
    if args.json:
        Path(args.json).write_text(json.dumps({"source": source, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
