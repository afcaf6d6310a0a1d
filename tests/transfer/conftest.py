"""Fixtures shared with tests/integration/transfer (they live in ``support.transfer``)."""

from __future__ import annotations

from support.transfer import engine_factory, metadata  # noqa: F401 - fixtures
