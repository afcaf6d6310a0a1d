"""Token files and environment variables reach the pool's real processes (no model needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from support.procs import Proc

from kvpool.common import auth
from kvpool.common.errors import AuthError, ForbiddenError
from kvpool.config import TransferConfig
from kvpool.store.client import StoreClient
from kvpool.transfer.metadata_server import MetadataServer


def token_file(tmp_path, name: str, token: str, mode: int) -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    path.chmod(mode)
    return str(path)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}


def test_a_readable_token_file_is_refused(tmp_path):
    loose = token_file(tmp_path, "loose", "secret", 0o644)
    proc = subprocess.run([sys.executable, "-m", "kvpool.cli", "store", "master", "--port", "0",
                           "--auth-token-file", loose], capture_output=True, text=True,
                          timeout=60, env=clean_env())  # fmt: skip
    assert proc.returncode == 2
    assert "chmod 600" in proc.stderr and "group or others" in proc.stderr
    for bad in [str(tmp_path / "missing"), str(tmp_path)]:
        with pytest.raises(ValueError):
            auth.read_token_file(bad)
    empty = token_file(tmp_path, "empty", "  ", 0o600)
    with pytest.raises(ValueError, match="empty"):
        auth.read_token_file(empty)
    link = tmp_path / "link"
    link.symlink_to(token_file(tmp_path, "target", "secret", 0o600))
    with pytest.raises(ValueError):
        auth.read_token_file(str(link))  # not followed


def test_the_token_and_admin_token_reach_the_pool(tmp_path, monkeypatch):
    """master and node from token files, the directory from the environment: a client with
    the token puts and gets; one without is refused at each of them; only the admin token
    forces a remove."""
    for k in list(os.environ):
        if k.startswith("KVPOOL_"):
            monkeypatch.delenv(k)
    member = token_file(tmp_path, "member", "cluster-secret", 0o600)
    admin = token_file(tmp_path, "admin", "admin-secret", 0o600)
    monkeypatch.setenv(auth.AUTH_ENV, "cluster-secret")  # the directory's, in this process
    meta = MetadataServer()
    monkeypatch.delenv(auth.AUTH_ENV)
    env = clean_env()
    procs = []
    try:
        m = Proc("store", "master", "--port", "0", "--auth-token-file", member,
                 "--admin-token-file", admin, "--log-level", "warning", env=env)  # fmt: skip
        procs.append(m)
        n = Proc("store", "node", "--master", m.info["address"], "--memory", "8MiB",
                 "--directory", meta.url, "--auth-token-file", member, "--log-level",
                 "warning", env=env)  # fmt: skip
        procs.append(n)
        transfer = TransferConfig(directory=meta.url, transport="tcp", auth_token="cluster-secret")
        with StoreClient(m.info["address"], transfer, token="cluster-secret") as c:
            c.put("k", b"v" * 1000)
            assert c.get("k") == b"v" * 1000
            with pytest.raises(ForbiddenError):
                c.remove("k", force=True)
        with (
            StoreClient(m.info["address"], TransferConfig(directory="memory"), token="") as anon,
            pytest.raises(AuthError),
        ):
            anon.get("k")
        with StoreClient(m.info["address"], transfer, token="cluster-secret",
                         admin_token="admin-secret") as boss:  # fmt: skip
            boss.remove("k", force=True)
            assert not boss.exists("k")
        from kvpool.transfer import TransferEngine

        stranger = TransferEngine(TransferConfig(directory="memory", transport="tcp",
                                                 auth_token=""))  # fmt: skip
        with StoreClient(m.info["address"], transfer, token="cluster-secret") as c:
            c.put("k2", b"w" * 100)
            replica = c.master.call("get", "k2")["replicas"][0]
        desc = transfer_descriptor(meta.url, replica["segment"])
        stranger.directory.publish(desc)  # it knows where the value is
        with pytest.raises(Exception, match="authentication failed"):
            stranger.read(np.zeros(100, np.uint8), replica["segment"], replica["offset"])
        stranger.close()
    finally:
        for p in reversed(procs):
            p.stop()
        meta.close()


def transfer_descriptor(url: str, name: str):
    from kvpool.transfer.metadata import HttpDirectory

    return HttpDirectory(url, token="cluster-secret").lookup(name)
