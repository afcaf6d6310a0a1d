"""The host's core ledger (engine/core_share.py): a worker alone steps on every core, two busy
workers on their shares; the file is shared across processes and validated when opened."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvpool.config import ClusterConfig, EngineConfig
from kvpool.engine.core_share import HEADER, CoreLedger, create_ledger


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_worker_alone_takes_every_core_and_gives_them_back(tmp_path):
    path = create_ledger(2, 2, str(tmp_path))
    a, b = CoreLedger(path, 0, 1), CoreLedger(path, 1, 1)
    assert a.begin_step() == 2 and torch.get_num_threads() == 2  # b idle
    assert b.begin_step() == 1 and torch.get_num_threads() == 1  # a still busy
    assert a.begin_step() == 1  # a's next step goes back to its share
    b.idle()
    assert a.begin_step() == 2 and torch.get_num_threads() == 2
    assert (a.widened_steps, b.widened_steps) == (2, 0)
    a.close()
    assert b.begin_step() == 2  # a closed: its slot is idle
    b.close()
    b.close()  # twice is fine


def test_adjust_narrows_and_widens_without_marking_busy(tmp_path):
    path = create_ledger(2, 2, str(tmp_path))
    a, b = CoreLedger(path, 0, 1), CoreLedger(path, 1, 1)
    assert a.begin_step() == 2
    b.begin_step()  # b wakes mid-step of a: a's next layer narrows...
    assert a.adjust() == 1 and torch.get_num_threads() == 1
    b.idle()  # ...and widens again once b is idle
    assert a.adjust() == 2 and torch.get_num_threads() == 2
    b.idle()
    assert b.adjust() == 2  # b is idle itself: it counts only a
    assert a.widened_steps == 1


def test_shares_are_a_floor_and_odd_counts_round_down(tmp_path):
    path = create_ledger(3, 4, str(tmp_path))
    ledgers = [CoreLedger(path, i, 1) for i in range(3)]
    assert ledgers[0].begin_step() == 4
    assert ledgers[1].begin_step() == 2
    assert ledgers[2].begin_step() == 1  # 4 // 3
    wide = CoreLedger(path, 0, 3)  # a worker given 3 threads never runs on fewer
    assert wide.begin_step() == 3 and wide.widened_steps == 0


def test_threads_left_to_loads_come_off_the_ledgers_count(tmp_path):
    path = create_ledger(2, 4, str(tmp_path))
    a, b = CoreLedger(path, 0, 2), CoreLedger(path, 1, 2)
    assert a.begin_step() == 4
    a.leave(1)  # a load in flight: one thread fewer, at once and for the next steps
    assert torch.get_num_threads() == 3 and a.begin_step() == 3
    b.begin_step()
    assert a.adjust() == 1  # below the share, which is a floor only for the ledger's count
    a.leave(0)
    assert a.begin_step() == 2  # b still busy: the share
    solo = CoreLedger(create_ledger(1, 1, str(tmp_path)), 0, 1)
    solo.leave(1)
    assert solo.begin_step() == 1  # never fewer than one


def test_the_ledger_is_shared_across_processes(tmp_path):
    path = create_ledger(2, 2, str(tmp_path))
    ours = CoreLedger(path, 0, 1)
    code = textwrap.dedent(f"""
        from kvpool.engine.core_share import CoreLedger
        other = CoreLedger({str(path)!r}, 1, 1)
        other.begin_step()
        print("busy", flush=True)
        input()
        other.idle()
        print("idle", flush=True)
        input()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "busy"
        assert ours.begin_step() == 1
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "idle"
        assert ours.begin_step() == 2
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.parametrize(
    "content, slot, message",
    [
        (b"KV", 0, "too short"),
        (HEADER.pack(b"XXXX", 1, 2, 2) + bytes(2), 0, "not a version-1"),
        (HEADER.pack(b"KVPC", 9, 2, 2) + bytes(2), 0, "not a version-1"),
        (HEADER.pack(b"KVPC", 1, 2, 2) + bytes(2), 2, "outside its 2 slots"),
        (HEADER.pack(b"KVPC", 1, 2, 2) + bytes(1), 0, "bad size"),
    ],
)
def test_a_bad_ledger_is_refused(tmp_path, content, slot, message):
    path = tmp_path / "ledger"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        CoreLedger(path, slot, 1)


def test_create_refuses_bad_sizes(tmp_path):
    with pytest.raises(ValueError):
        create_ledger(0, 2, str(tmp_path))
    with pytest.raises(ValueError):
        create_ledger(2, 0, str(tmp_path))


def test_the_launcher_shares_cores_only_when_it_may(tmp_path, monkeypatch):
    import kvpool.engine.core_share as cs
    from kvpool.entrypoints.launcher import plan, share_cores

    made = []
    monkeypatch.setattr(cs, "create_ledger",
                        lambda slots, cores: made.append(create_ledger(slots, cores, str(tmp_path)))
                        or made[-1])  # fmt: skip
    _, workers = plan(ClusterConfig())
    path = share_cores(ClusterConfig(), workers)
    assert path == made[0] and path.exists()
    assert [(w.config.core_ledger, w.config.core_slot) for w in workers] == [
        (str(path), 0), (str(path), 1)]  # fmt: skip
    for off in (ClusterConfig(share_cores=False), ClusterConfig(decode_threads=2),
                ClusterConfig(engine=EngineConfig(num_threads=1)),
                ClusterConfig(prefill=1, decode=0)):  # fmt: skip
        _, workers = plan(off)
        assert share_cores(off, workers) is None
        assert all(w.config.core_ledger is None for w in workers)
    assert len(made) == 1

    def unwritable(slots, cores):
        raise PermissionError("/dev/shm is read-only")

    monkeypatch.setattr(cs, "create_ledger", unwritable)  # sharing is skipped, not fatal
    _, workers = plan(ClusterConfig())
    assert share_cores(ClusterConfig(), workers) is None
    assert all(w.config.core_ledger is None for w in workers)


def test_wide_steps_are_not_cost_model_samples(tiny_engine_factory):
    """A step on the cores of idle workers is timed (compute_seconds) but not fitted: the
    conductor's predictions are for a loaded host, where every worker is on its share."""
    from kvpool import SamplingParams

    eng = tiny_engine_factory()
    wide = [False]
    eng.wide_step = lambda: wide[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("a", list(range(10, 30)), params)
    eng.step()
    assert len(eng.step_times) == 1
    first = eng.compute_seconds
    assert first > 0
    wide[0] = True
    while eng.has_work():
        eng.step()
    assert len(eng.step_times) == 1 and eng.compute_seconds > first


def test_workers_started_by_hand_create_the_ledger_once(tmp_path):
    """``kvpool worker --core-ledger PATH --core-slots M``: the first worker creates it, the
    next ones open it; a different slot count is refused."""
    from kvpool.engine.core_share import host_cores, open_ledger

    path = tmp_path / "kvpool-cores-group"
    first = open_ledger(path, 0, 1, slots=2)
    assert (first.slots, first.cores) == (2, host_cores())
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing left aside
    second = open_ledger(path, 1, 1, slots=2)
    first.begin_step()
    assert second._busy_count() == 1  # the same file
    with pytest.raises(ValueError, match="2 slots, not 3"):
        open_ledger(path, 0, 1, slots=3)
    with pytest.raises(FileNotFoundError):
        open_ledger(tmp_path / "missing", 0, 1)  # slots=0: it must exist


def test_worker_flags_name_the_ledger():
    from kvpool import cli
    from kvpool.config import WorkerConfig
    from kvpool.entrypoints.worker import worker_config

    args = cli.build_parser().parse_args(["worker", "--role", "decode", "--core-ledger",
                                          "/dev/shm/kvpool-cores-x", "--core-slot", "1",
                                          "--core-slots", "2"])  # fmt: skip
    cfg = worker_config(args)
    assert (cfg.core_ledger, cfg.core_slot, cfg.core_slots) == ("/dev/shm/kvpool-cores-x", 1, 2)
    with pytest.raises(ValueError, match="below core_slots"):
        WorkerConfig(core_ledger="x", core_slot=2, core_slots=2)


def test_a_fused_decode_step_narrows_when_another_worker_wakes(tiny_engine_factory, tmp_path):
    """A decode step begun on every core (the other worker idle) gives the cores back before
    its next layer once the other marks itself busy (the fused C++ step reads the file itself),
    and never widens within a step."""
    from kvpool import SamplingParams

    eng = tiny_engine_factory()
    if getattr(eng.model, "fused", None) is None:
        pytest.skip("no C++ kernels: decode steps run layer by layer in Python")
    path = create_ledger(2, 2, str(tmp_path))
    a = CoreLedger(path, 0, 1)
    a.attach(eng.model)
    assert eng.model.between_layers == a.adjust

    def other(busy: bool) -> None:  # the other worker, as its process writes the file
        with open(path, "r+b") as f:
            f.seek(HEADER.size + 1)
            f.write(b"\x01" if busy else b"\x00")

    eng.add_request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=8))
    a.begin_step()
    eng.step()  # the prompt
    assert a.begin_step() == 2 and torch.get_num_threads() == 2  # alone: wide
    other(True)  # wakes after this step's threads were chosen
    eng.step()  # a decode step: narrowed at its first layer
    assert torch.get_num_threads() == 1 and eng.model.fused.narrowed == 1
    other(False)
    eng.step()  # the other went idle: a step never widens by itself...
    assert torch.get_num_threads() == 1 and eng.model.fused.narrowed == 1
    assert a.begin_step() == 2  # ...its next one starts wide again
    eng.step()
    assert eng.model.fused.narrowed == 1
    a.close()


def test_a_ledger_too_short_for_its_slots_is_refused_by_the_fused_step(tiny_engine_factory,
                                                                       tmp_path):  # fmt: skip
    fused = getattr(tiny_engine_factory().model, "fused", None)
    if fused is None:
        pytest.skip("no C++ kernels")
    path = create_ledger(2, 2, str(tmp_path))
    with pytest.raises(RuntimeError, match="shorter than its 4 slots"):
        fused.share_cores(str(path), HEADER.size, 4, 2, 1)
    with pytest.raises(RuntimeError, match="cannot open"):
        fused.share_cores(str(tmp_path / "none"), HEADER.size, 2, 2, 1)


def test_ledgers_nobody_holds_are_swept_by_the_next_creator(tmp_path):
    """A ``kvpool serve`` killed with SIGKILL cannot unlink its ledger: the next one created in
    that directory removes every ledger no process holds a lock on, and only those."""
    from kvpool.engine.core_share import release_ledger, sweep_stale

    code = textwrap.dedent(f"""
        import os, sys
        from kvpool.engine.core_share import CoreLedger, create_ledger
        path = create_ledger(2, 2, {str(tmp_path)!r})
        if sys.argv[1] == "open":
            CoreLedger(path, 1, 1)  # a worker still running
        print(path, flush=True)
        if sys.argv[1] == "open":
            input()
        os.kill(os.getpid(), 9)  # killed: nothing unlinks it
    """)
    dead = subprocess.run([sys.executable, "-c", code, "dead"], capture_output=True, text=True,
                          timeout=60).stdout.strip()  # fmt: skip
    live = subprocess.Popen([sys.executable, "-c", code, "open"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        held = live.stdout.readline().strip()
        ours = create_ledger(2, 2, str(tmp_path))  # sweeps first
        other = tmp_path / "kvpool-cores-notes.txt"  # not a name create_ledger gives
        other.write_text("keep")
        names = {p.name for p in tmp_path.iterdir()}
        assert Path(dead).name not in names  # its process died: swept
        assert {Path(held).name, ours.name, other.name} <= names  # in use, or not a ledger
        release_ledger(ours)
        assert sweep_stale(str(tmp_path)) == 1 and not ours.exists()  # ours, released
        live.stdin.write("\n")
        live.stdin.flush()
        live.wait(30)
        assert sweep_stale(str(tmp_path)) == 1 and not Path(held).exists()
        assert other.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    finally:
        if live.poll() is None:
            live.kill()


def test_a_worker_that_creates_the_ledger_by_hand_keeps_it_held(tmp_path):
    from kvpool.engine.core_share import open_ledger, sweep_stale

    a = open_ledger(tmp_path / "kvpool-cores-1-0123abcd", 0, 1, slots=2)  # a swept-like name
    assert sweep_stale(str(tmp_path)) == 0  # the worker holds it
    a.close()
    assert sweep_stale(str(tmp_path)) == 1
