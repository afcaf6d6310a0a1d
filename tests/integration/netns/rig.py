"""Several hosts on one machine: network namespaces joined by veth links to two bridges.

``Rig`` makes one namespace per host and one for the switches (two bridges: ``data``, the
pool's network, and ``ctl``, the control network between conductor and workers), gives each
host an interface on the networks it is on, and runs commands inside a host: each command in
its own mount namespace with an empty ``/dev/shm`` (so processes on different hosts cannot
share memory: what crosses hosts goes over TCP, as it would between machines). Every address
is inside the namespaces the rig made; ``close`` kills what it started and deletes them.

``cut(host, net)`` / ``restore(host, net)`` take a host's interface down and up (``ip link
set``), which cuts it from everything on that network; ``throttle(host, rate)`` shapes what a
host sends (``tc`` token bucket). Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.process import Process

NETS = {"data": "10.201.0", "ctl": "10.202.0"}
ROOT = Path(__file__).resolve().parents[3]


def available() -> str | None:
    """Why the rig cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 (ip) and util-linux (unshare)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Host:
    name: str
    ns: str
    addrs: dict[str, str] = field(default_factory=dict)  # net -> address

    def addr(self, net: str = "data") -> str:
        return self.addrs[net]


class RigProc(Process):
    """A process inside a host (the support ``Process``, started through ``ip netns exec`` and
    ``unshare``); ``info``: the JSON line it printed when ready (if asked)."""

    def __init__(self, rig: Rig, host: Host, argv: list[str], log: Path, env: dict,
                 ready_line: bool, stdin: bool = False, capture: bool = False) -> None:  # fmt: skip
        self.host = host
        script = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'
        cmd = ["ip", "netns", "exec", host.ns, "unshare", "--mount", "--propagation", "private",
               "sh", "-c", script, "sh", *argv]  # fmt: skip
        super().__init__(cmd, log=log, pipe_stdout=ready_line or stdin or capture,
                         stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env,
                         ready=240 if ready_line else None, name=f"{argv[:4]} on {host.name}")  # fmt: skip
        rig.procs.append(self)

    def rss_peak_mib(self) -> float:
        """The peak resident memory of the process (VmHWM), MiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM")


class Rig:
    """Hosts ``{name: [nets]}``; host ``i`` gets address ``.10 * (i + 1)`` on each of its nets."""

    def __init__(self, hosts: dict[str, list[str]], logs: Path) -> None:
        self.tag = f"{os.getpid() % 100_000}"
        self.logs = logs
        self.procs: list[RigProc] = []
        self.hosts: dict[str, Host] = {}
        self.switch = f"kvp{self.tag}-sw"
        self._cleanup_stale()
        try:
            self._build(hosts)
        except BaseException:
            self.close()
            raise

    def _cleanup_stale(self) -> None:
        """Namespaces a killed run of this rig left behind (their owner process is gone)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith("kvp") and "-" in name:
                pid = name[3 : name.index("-")]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def _build(self, hosts: dict[str, list[str]]) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for net in NETS:
            _ip("-n", self.switch, "link", "add", f"br-{net}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br-{net}", "up")
        for i, (name, nets) in enumerate(hosts.items()):
            host = Host(name, f"kvp{self.tag}-{name}")
            self.hosts[name] = host
            _ip("netns", "add", host.ns)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            for net in nets:
                inner, outer = f"v{self.tag}{i}{net[0]}h", f"v{self.tag}{i}{net[0]}s"
                _ip("link", "add", inner, "netns", host.ns, "type", "veth", "peer", "name",
                    outer, "netns", self.switch)  # fmt: skip
                _ip("-n", host.ns, "link", "set", inner, "name", net)
                host.addrs[net] = f"{NETS[net]}.{10 * (i + 1)}"
                _ip("-n", host.ns, "addr", "add", f"{host.addrs[net]}/24", "dev", net)
                _ip("-n", host.ns, "link", "set", net, "up")
                _ip("-n", self.switch, "link", "set", outer, "master", f"br-{net}")
                _ip("-n", self.switch, "link", "set", outer, "up")

    # -- running things -------------------------------------------------------------------------

    def start(self, host: str, argv: list[str], name: str, env: dict | None = None,
              ready_line: bool = False, stdin: bool = False, capture: bool = False) -> RigProc:  # fmt: skip
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
               "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}  # fmt: skip
        return RigProc(self, self.hosts[host], argv, self.logs / f"{name}.log", env, ready_line,
                       stdin, capture)  # fmt: skip

    def kvpool(self, host: str, *args: str, name: str, env: dict | None = None) -> RigProc:
        """A ``kvpool`` subcommand that prints one JSON line when ready."""
        exe = str(Path(sys.executable).with_name("kvpool"))
        return self.start(host, [exe, *args], name, env, ready_line=True)

    def python(self, host: str, script: Path, *args: str, name: str, env: dict | None = None,
               stdin: bool = False, capture: bool = True) -> RigProc:  # fmt: skip
        return self.start(host, [sys.executable, str(script), *args], name, env, stdin=stdin,
                          capture=capture)  # fmt: skip

    def run_json(self, host: str, script: Path, *args: str, name: str, env: dict | None = None,
                 timeout: float = 300) -> dict:  # fmt: skip
        """Run a script in a host to completion; the JSON object it printed last."""
        proc = self.python(host, script, *args, name=name, env=env)
        try:
            out, _ = proc.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.stop(signal.SIGKILL)
            raise RuntimeError(f"{script.name} on {host} ran over {timeout:.0f} s") from None
        if proc.proc.returncode != 0:
            raise RuntimeError(f"{script.name} on {host} failed:\n{proc.tail()}")
        return json.loads(out.strip().splitlines()[-1])

    def curl(self, host: str, url: str, headers: dict | None = None,
             timeout: float = 5) -> tuple[int, str]:  # fmt: skip
        """(HTTP status or 0, body) of a GET from inside a host."""
        args = ["ip", "netns", "exec", self.hosts[host].ns, "curl", "-s", "-m", str(timeout),
                "-w", "\n%{http_code}", url]  # fmt: skip
        for k, v in (headers or {}).items():
            args += ["-H", f"{k}: {v}"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout + 5).stdout
        body, _, code = out.rpartition("\n")
        return (int(code) if code.isdigit() else 0), body

    def wait_http(self, host: str, url: str, headers: dict | None = None, timeout: float = 240,
                  proc: RigProc | None = None) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            if self.curl(host, url, headers, timeout=2)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{url} not healthy from {host} within {timeout:.0f} s")

    # -- faults ---------------------------------------------------------------------------------

    def cut(self, host: str, net: str = "data") -> None:
        _ip("-n", self.hosts[host].ns, "link", "set", net, "down")

    def restore(self, host: str, net: str = "data") -> None:
        _ip("-n", self.hosts[host].ns, "link", "set", net, "up")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the bridge port forwards again after a moment
            out = subprocess.run(["ip", "-n", self.hosts[host].ns, "-j", "link", "show", net],
                                 capture_output=True, text=True).stdout  # fmt: skip
            if '"operstate":"UP"' in out.replace(" ", ""):
                return
            time.sleep(0.1)

    def throttle(self, host: str, rate: str, net: str = "data") -> None:
        """Shape what ``host`` sends on ``net`` to ``rate`` (e.g. ``"320mbit"``: a token
        bucket, ``tc qdisc ... tbf``): a slow link or a slow storage tier behind it."""
        subprocess.run(["ip", "netns", "exec", self.hosts[host].ns, "tc", "qdisc", "replace",
                        "dev", net, "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                        "500ms"], check=True, capture_output=True, timeout=30)  # fmt: skip

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(signal.SIGKILL, timeout=10)  # and closes its pipes and log
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
