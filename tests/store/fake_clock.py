"""A clock the test moves by hand (``clock.t += 5``)."""

from __future__ import annotations


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t
