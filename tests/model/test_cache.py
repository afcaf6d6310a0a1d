"""The conversion cache: location, atomic writes, stale temp folders."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvpool.model.cache import atomic_dir, cache_root, entry_dir, file_sha256


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "arg")) == tmp_path / "arg"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("KVPOOL_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "kvpool"


def test_entry_dir_is_keyed_by_digest(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    digest = file_sha256(f)
    assert digest.startswith("ba7816bf")
    assert entry_dir(tmp_path, digest).name.endswith(digest[:32])


def test_atomic_dir_success(tmp_path: Path) -> None:
    final = tmp_path / "root" / "entry"
    with atomic_dir(final) as tmp:
        assert tmp.parent == final.parent and not final.exists()
        (tmp / "a.txt").write_text("a")
    assert (final / "a.txt").read_text() == "a"
    assert oct(final.stat().st_mode & 0o777) == oct(0o755)
    assert [p.name for p in final.parent.iterdir()] == ["entry"]


def test_atomic_dir_failure_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_keeps_concurrent_winner(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with atomic_dir(final) as tmp:
        (tmp / "mine.txt").write_text("mine")
        final.mkdir()  # another process finished first
        (final / "theirs.txt").write_text("theirs")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
    assert [p.name for p in final.iterdir()] == ["theirs.txt"]


def test_stale_temp_dirs_are_removed(tmp_path: Path) -> None:
    stale, fresh = tmp_path / ".tmp-old-1", tmp_path / ".tmp-new-2"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 3 * 24 * 3600
    os.utime(stale, (old, old))
    with atomic_dir(tmp_path / "entry"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-new-2", "entry"]
