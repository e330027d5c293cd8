"""The loop watch names the line that holds a member's event loop (shoal.runtime.loopwatch)."""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.runtime.loopwatch import LOOP_WATCH_ENV, start_loop_watch, watch_threshold


def test_the_threshold_comes_from_the_environment():
    assert watch_threshold({}) == 0.0
    assert watch_threshold({LOOP_WATCH_ENV: "0.25"}) == 0.25
    assert watch_threshold({LOOP_WATCH_ENV: "0"}) == 0.0
    assert watch_threshold({LOOP_WATCH_ENV: "-1"}) == 0.0
    assert watch_threshold({LOOP_WATCH_ENV: "soon"}) == 0.0  # (logged, never raised: a diagnosis aid)


def hold_the_loop_for_a_while() -> None:
    time.sleep(1.0)


def test_a_held_loop_is_reported_once_with_the_line_that_holds_it(caplog):
    async def main():
        start_loop_watch("w9", 0.2)
        await asyncio.sleep(0.3)  # a loop that turns: nothing to report
        hold_the_loop_for_a_while()
        await asyncio.sleep(0.3)

    with caplog.at_level(logging.INFO, logger="shoal.loopwatch"):
        asyncio.run(main())
    held = [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]
    # (a loaded box may hold the loop elsewhere too: only this hold's reports are counted)
    ours = [m for m in held if "hold_the_loop_for_a_while" in m]
    assert len(ours) == 1, held
    assert ours[0].startswith("w9: event loop held for")
    ends = [float(m.split("held for ")[1].split(" s")[0]) for m in held if m.endswith("in all")]
    assert any(0.9 <= t <= 3.0 for t in ends), ends  # the 1 s hold's whole length, once it ended


def test_off_it_starts_no_thread():
    async def main():
        return start_loop_watch("w9", 0.0)

    assert asyncio.run(main()) is None


def test_a_member_s_main_gets_the_watch_from_its_environment(monkeypatch):
    """What run_member and the coordinator's command wrap their main loops in: ``watched``
    reads SHOAL_LOOP_WATCH from the process's environment and starts the watcher thread."""
    import threading

    from shoal.runtime.loopwatch import watched

    async def watchers():
        return {t for t in threading.enumerate() if t.name == "shoal-loop-watch"}

    old = asyncio.run(watchers())  # (watchers of earlier tests' loops may still be winding down)
    monkeypatch.setenv(LOOP_WATCH_ENV, "0.5")
    new = asyncio.run(watched(watchers(), "s0")) - old
    assert len(new) == 1
    monkeypatch.delenv(LOOP_WATCH_ENV)
    assert not asyncio.run(watched(watchers(), "s0")) - old - new  # off: none started
