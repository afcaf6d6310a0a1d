"""A serving process freezes what it built at start-up out of the garbage collector's walks."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from kvpool.serving.http_limits import freeze_startup_heap
start_up = [{"i": i, "tags": [i]} for i in range(200_000)]  # what a loaded engine holds
garbage = []
garbage.append(garbage)  # a cycle nothing refers to: collected, not frozen
del garbage
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() >= 400_000, frozen
print(frozen, len(gc.get_objects()))  # what a full collection still walks
"""


def test_freeze_startup_heap_leaves_the_collector_only_new_objects():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    frozen, walked = int(out[0]), int(out[1])
    assert walked < frozen / 20  # a full collection walks only what came after
