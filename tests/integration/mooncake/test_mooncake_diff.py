"""The differential suite: the same Mooncake Store calls against kvpool and against Mooncake
(live when the benchmarks' Mooncake virtualenv is here, else its committed recording),
compared call by call: return codes, bytes, tensors, replica descriptors."""

from __future__ import annotations

import mooncake_diff as diff
import pytest


@pytest.fixture(scope="module")
def ours() -> dict:
    return diff.run_kvpool()


@pytest.fixture(scope="module")
def golden() -> dict:
    recorded = diff.load_golden()
    assert recorded["scenarios_digest"] == diff.digest(), (
        "mooncake_scenarios.py changed since the recording: rerun "
        "`.venv/bin/python tests/integration/mooncake/mooncake_diff.py --record`"
    )
    return recorded


def check(ours: dict, theirs: dict, source: str) -> None:
    result = diff.compare(ours, theirs)
    print(diff.report(result, source))
    assert result["mismatches"] == []
    assert result["calls"] >= 200 and len(result["methods"]) >= 40
    # every documented difference still happens (none hides a later fix or a new bug)
    assert {(d["scenario"], d["label"]) for d in result["documented"]} == set(diff.DOCUMENTED)


@pytest.mark.slow
def test_kvpool_answers_as_recorded_mooncake(ours, golden):
    check(ours, golden["results"], f"the recording of Mooncake {golden['mooncake_version']}")


@pytest.mark.slow
def test_kvpool_answers_as_live_mooncake(ours, golden):
    peer = diff.mooncake_peer()
    if peer is None:
        pytest.skip("no Mooncake virtualenv with torch in .cache/bench (the store benchmark "
                    "or `mooncake_diff.py --record` installs it); compared with the recording")  # fmt: skip
    python, env, master_cmd, version = peer
    theirs = diff.run("mooncake", python, env, master_cmd)
    assert theirs == golden["results"] or version != golden["mooncake_version"], (
        "Mooncake's own answers changed since the recording"
    )
    check(ours, theirs, f"Mooncake {version} (live)")


def test_the_comparison_finds_a_difference():
    """The comparison itself can fail: a changed code, byte or call is reported."""
    theirs = {"s": [["a", "put", 0], ["b", "get", ["bytes", 3, "00"]]]}
    assert diff.compare(theirs, theirs)["mismatches"] == []
    changed = {"s": [["a", "put", -600], ["b", "get", ["bytes", 3, "00"]]]}
    assert [m["label"] for m in diff.compare(changed, theirs)["mismatches"]] == ["a"]
    fewer = {"s": [["a", "put", 0]]}
    assert diff.compare(fewer, theirs)["mismatches"][0]["label"].startswith("(the sequence")
