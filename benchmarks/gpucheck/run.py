"""Time limits and the run of one part: its status, its results so far, the summary saved."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .device import Check, release
from .summary import render

LIMITS_S = {
    "environment": 30.0,
    "pytest": 90.0,
    "planner": 80.0,
    "shapes": 30.0,
    "bench": 80.0,
    "offload": 60.0,
    "overhead": 40.0,
    "suite": 180.0,
}
"""Each part's time limit in seconds. A part checks it between units of work (a plan, a
round) and stops there; a unit that overruns is interrupted :data:`GRACE_S` later. With the
grace, the parts add up to 11 minutes (8 without the last, ``suite``)."""

GRACE_S = 10.0
"""How long past its limit a part runs before it is interrupted (SIGALRM)."""

TOTAL_S = sum(LIMITS_S.values()) + len(LIMITS_S) * GRACE_S


class PartTimeout(BaseException):
    """A part ran past its hard limit. A ``BaseException``, as ``KeyboardInterrupt``: no
    ``except Exception`` on the way out (remat's steps restore state with those) swallows it."""


class Deadline:
    """A part's time limit, checked between units of work."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - time.monotonic()

    def passed(self) -> bool:
        """True once the limit is reached."""
        return self.left() <= 0


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`PartTimeout` in the block after ``seconds`` (SIGALRM; the main thread of
    a POSIX process only, elsewhere the block just runs). The previous handler is put back."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"interrupted {seconds:.0f} s after it started (its hard limit)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


Part = Callable[[Check, dict[str, Any], Deadline], None]
"""``part(check, found, deadline)`` fills ``found`` as it measures (what it has stays when it
fails) and sets ``found["cut_short"]`` when it stopped at ``deadline``."""


def run_part(
    name: str,
    part: Part,
    check: Check,
    summary: dict[str, Any],
    limit_s: float,
    grace_s: float = GRACE_S,
) -> dict[str, Any]:
    """Run one part under its limits, record its status, time and results, save the summary.

    The status is ``ok``, ``partial`` (stopped at ``limit_s`` between units of work),
    ``timeout`` (interrupted ``grace_s`` past it), or ``error`` (an exception, recorded
    with its traceback); the next part runs in every case.
    """
    found: dict[str, Any] = {}
    entry: dict[str, Any] = {"status": "running", "seconds": None, "limit_s": limit_s}
    entry["results"] = found
    summary["parts"][name] = entry
    save(summary, check.out)  # a part left "running" was killed with the process
    start = time.monotonic()
    try:
        with hard_limit(limit_s + grace_s):
            part(check, found, Deadline(limit_s))
        entry["status"] = "partial" if found.get("cut_short") else "ok"
    except PartTimeout as e:
        entry["status"], entry["error"] = "timeout", str(e)
    except Exception as e:  # recorded; the other parts still run
        entry["status"], entry["error"] = "error", f"{type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()
    finally:
        entry["seconds"] = round(time.monotonic() - start, 1)
        release(check.device)
        save(summary, check.out)
    return entry


# -- the summary -------------------------------------------------------------------------------------


def save(summary: dict[str, Any], out: Path) -> None:
    """Write ``summary.json`` and ``summary.md`` under ``out`` (each replaced whole)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("summary.json", json.dumps(summary, indent=2, default=str)),
        ("summary.md", render(summary)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def succeeded(summary: dict[str, Any]) -> bool:
    """Every part ran (``ok`` or ``partial``) and no test (GPU tests, the suite) failed or
    errored."""
    parts = summary["parts"].values()
    if any(p["status"] not in ("ok", "partial") for p in parts):
        return False
    for name in ("pytest", "suite"):
        counts = summary["parts"].get(name, {}).get("results", {}).get("counts", {})
        if counts.get("failed") or counts.get("error"):
            return False
    return True
