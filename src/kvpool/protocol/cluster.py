"""Names every cluster process agrees on: worker roles and where workers register in etcd."""

from __future__ import annotations

WORKERS_PREFIX = b"/kvpool/workers/"  # + worker id -> its JSON info, under a lease
ROLES = ("prefill", "decode", "both")
