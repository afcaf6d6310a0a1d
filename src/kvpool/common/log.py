"""Logging set-up for command-line entry points (library code only calls getLogger)."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once, level from the argument or ``KVPOOL_LOG_LEVEL``."""
    level = (level or os.environ.get("KVPOOL_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # one line per HTTP request the conductor relays is noise at INFO (uvicorn logs the
    # client's requests already); still there with --log-level debug
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
