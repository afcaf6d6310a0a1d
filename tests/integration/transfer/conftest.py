"""The transfer tests' fixtures (``support.transfer``), real peer processes included."""

from __future__ import annotations

from support.transfer import engine_factory, metadata, peer_factory  # noqa: F401 - fixtures
