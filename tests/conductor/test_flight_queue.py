"""A decode-side prompt counts as its worker's queue until its first token, and never longer
than its request's flight (a client gone before the stream started leaves nothing behind)."""

from __future__ import annotations

from types import SimpleNamespace

from kvpool.conductor.relay import Flight, queue_on


def test_queue_on_counts_until_the_first_release_only():
    w = SimpleNamespace(pending_tokens=10)
    done = queue_on(w, 300)
    assert w.pending_tokens == 310
    done()
    done()  # the flight's release after the first token: nothing more
    assert w.pending_tokens == 10
    assert queue_on(w, 0)() is None and w.pending_tokens == 10  # nothing to count
    assert queue_on(None, 5)() is None


def test_a_flight_released_before_the_first_token_gives_the_queue_back():
    outcomes = []
    w = SimpleNamespace(pending_tokens=0)
    flight = Flight(outcomes.append)
    first = flight.also(queue_on(w, 128))
    assert w.pending_tokens == 128 and not flight.released
    flight.release()  # the stream never started: no first token
    flight.release()
    assert w.pending_tokens == 0 and outcomes == ["aborted"] and flight.released
    first()  # a late first-token callback changes nothing
    assert w.pending_tokens == 0
