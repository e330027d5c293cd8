"""Where a member's event loop is held: a diagnosis aid for false deaths and slow steps.

A member's heartbeats, lease renewals and chunk reads all run on its one event loop, so any
work done on the loop itself (a copy of a stage, a digest, a large parse) silences the member
for as long as it takes; a stage server or the coordinator may then declare it dead although
it is busy. asyncio's debug mode names the task that held the loop, not the line.

With ``SHOAL_LOOP_WATCH=SECONDS`` (for example 0.25) in its environment, every member started
by ``shoal launch`` (and any server, worker or coordinator started by hand) runs a watcher
thread that logs a WARNING with the loop thread's stack once the loop has not turned for that
long, once per hold (what to move off the loop), and an INFO line with the hold's whole length
once it turns again. Off (unset or 0) it costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Coroutine

log = logging.getLogger("shoal.loopwatch")

LOOP_WATCH_ENV = "SHOAL_LOOP_WATCH"


def watch_threshold(env: dict[str, str]) -> float:
    """Seconds of a held loop worth a report, from ``env`` (0: off; pure)."""
    raw = env.get(LOOP_WATCH_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; the loop watch is off", LOOP_WATCH_ENV, raw)
        return 0.0
    return value if value > 0 else 0.0


def start_loop_watch(name: str, threshold_s: float) -> threading.Thread | None:
    """From inside a running loop: a daemon thread that logs where the loop thread is while the
    loop has not run a timer for more than ``threshold_s``; None when ``threshold_s`` <= 0."""
    if threshold_s <= 0:
        return None
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    period = threshold_s / 4
    beat = [time.monotonic(), _process_cpu()]

    def tick() -> None:
        beat[0], beat[1] = time.monotonic(), _process_cpu()
        loop.call_later(period, tick)

    tick()

    def watch() -> None:
        reported = 0.0
        while not loop.is_closed():
            time.sleep(period)
            last, cpu = beat[0], beat[1]
            if reported and last != reported:
                # the loop turned again: the whole hold, less the tick's own period
                log.info("%s: event loop held for %.2f s in all", name, max(0.0, last - reported - period))
                reported = 0.0
            held = time.monotonic() - last
            if held > threshold_s and last != reported:
                reported = last
                log.warning("%s: event loop held for %.2f s so far (this process used %.2f CPU-s meanwhile), "
                            "at:\n%s", name, held, _process_cpu() - cpu, _stacks(loop_thread))

    thread = threading.Thread(target=watch, daemon=True, name="shoal-loop-watch")
    thread.start()
    return thread


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _stacks(loop_thread: int) -> str:
    """The loop thread's stack, then the innermost frames of every other thread: a loop thread
    found waiting in ``select`` was not let run (another thread held the interpreter lock, or
    the box gave the process no core), and the others show which work was running."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    own = frames.get(loop_thread)
    out = ["".join(traceback.format_stack(own, limit=14)).rstrip() if own is not None else "(no frame)"]
    for ident, frame in frames.items():
        if ident in (loop_thread, threading.get_ident()):
            continue
        inner = traceback.extract_stack(frame, limit=3)
        out.append(f"  thread {names.get(ident, ident)}: " + " <- ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(inner)))
    return "\n".join(out)


async def watched(main: Coroutine, name: str):
    """``await main`` (a member's whole life), with the loop watch on when ``SHOAL_LOOP_WATCH``
    asks for it and the loop's default executor computing on the process's torch threads
    (:func:`shoal.threads.use_compute_executor`: else an executor thread's products can differ
    from ``shoal train --local``'s in the last bits)."""
    from shoal.threads import use_compute_executor

    use_compute_executor()
    start_loop_watch(name, watch_threshold(dict(os.environ)))
    return await main
