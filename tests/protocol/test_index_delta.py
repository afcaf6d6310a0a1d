"""Index deltas between the master and its nodes: typed, checked by the node."""

from __future__ import annotations

import pytest

from kvpool.common.errors import BadRequestError
from kvpool.protocol.store import IndexDelta


def test_round_trip():
    for d in (IndexDelta.add("k", 10, "n1/dram", 4096, 2**64 - 1),
              IndexDelta.delete("k", "n1/dram", 4096)):  # fmt: skip
        assert IndexDelta.from_wire(d.to_wire()) == d


@pytest.mark.parametrize(
    "wire",
    [
        ["put", "k", 1, "s", 0, None],
        ["add", 5, 1, "s", 0, None],
        ["add", "k", -1, "s", 0, None],
        ["add", "k", True, "s", 0, None],
        ["add", "k", 1, None, 0, None],
        ["add", "k", 1, "s", -8, None],
        ["add", "k", 1, "s", 0, "sum"],
        ["add", "k", 1, "s", 0],
        ("add", "k", 1, "s", 0, None),
        "add k",
    ],
)
def test_malformed_entries_are_refused(wire):
    with pytest.raises(BadRequestError):
        IndexDelta.from_wire(wire)
