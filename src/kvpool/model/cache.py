"""Where converted models live, keyed by the digest of their source file, written atomically."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "KVPOOL_CACHE_DIR"
# Bump when the conversion output changes, so old cache entries are not reused.
CONVERSION_VERSION = 1
_STALE_TEMP_SECONDS = 24 * 3600


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir``, else ``$KVPOOL_CACHE_DIR``, else ``~/.cache/kvpool``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpool"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def entry_dir(root: Path, digest: str) -> Path:
    """The cache folder for a source whose SHA-256 is ``digest``."""
    return root / f"gguf-v{CONVERSION_VERSION}-{digest[:32]}"


def _remove_stale_temp_dirs(root: Path) -> None:
    """Temp folders of conversions killed mid-way (older than a day, so none still running)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TEMP_SECONDS:
                logger.info("removing stale temp folder %s", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            continue


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder; a cache entry is read by every worker, so open it up."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``final``; on success rename it to ``final``.

    A crash or an exception leaves no ``final`` behind, only nothing or a ``.tmp-*`` folder that
    is removed here. If another process finished ``final`` first, its copy is kept.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        _make_readable(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("%s was written concurrently; keeping the existing copy", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
