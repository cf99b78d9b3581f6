"""Settings and flags (remat.engine.config): context managers on contextvars, thread- and task-local.

``set_checkpoint_early_stop``, ``set_checkpoint_debug_enabled`` and
``disable_checkpointing`` restore the previous value on every exit path;
``is_checkpointing`` / ``is_recomputing`` report the region being run. Two
threads (or asyncio tasks) checkpointing at once do not see each other's state.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import remat
from remat.engine import config
from tests.support.tensors import data


def current() -> tuple[object, object, object]:
    return config._early_stop.get(), config._debug.get(), config._disabled.get()


class Counted:
    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.start = 0
        self.after_last_save = 0
        self.flags: list[tuple[bool, bool]] = []
        self.barrier = barrier

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.start += 1
        self.flags.append((remat.is_checkpointing(), remat.is_recomputing()))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # both threads are inside a region here
        y = x.sin()  # the last tensor saved
        self.after_last_save += 1
        return y * 3.0


# ---------------------------------------------------------------- context managers


@pytest.mark.parametrize(
    "manager, value, index",
    [
        (remat.set_checkpoint_early_stop, True, 0),  # stop early
        (remat.set_checkpoint_early_stop, False, 0),  # always run the whole function
        (remat.set_checkpoint_debug_enabled, True, 1),  # force debug on
        (remat.set_checkpoint_debug_enabled, False, 1),  # force debug off
        (remat.set_checkpoint_debug_enabled, None, 1),  # leave it to each call
    ],
)
def test_settings_apply_inside_and_restore_on_exit_and_on_exception(manager, value, index):
    assert current() == (None, None, False)
    with manager(value):
        assert current()[index] is value
    assert current() == (None, None, False)
    with pytest.raises(KeyError), manager(value):
        raise KeyError("inside")
    assert current() == (None, None, False)


def test_settings_nest_and_restore_the_outer_value():
    with remat.set_checkpoint_early_stop(False):
        with remat.set_checkpoint_early_stop(True):
            assert current()[0] is True
        assert current()[0] is False
        with remat.set_checkpoint_debug_enabled(True), remat.disable_checkpointing():
            assert current() == (False, True, True)
        assert current() == (False, None, False)
    assert current() == (None, None, False)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: remat.set_checkpoint_early_stop(1), "enable must be a bool, got 1"),  # int
        (lambda: remat.set_checkpoint_early_stop(None), "got None"),  # None is not a bool here
        (lambda: remat.set_checkpoint_debug_enabled("yes"), "True, False or None, got 'yes'"),
    ],
)
def test_settings_reject_bad_values(call, match):
    with pytest.raises(TypeError, match=match), call():
        pass


@pytest.mark.parametrize(
    "setting, call_arg, after_last_save",
    [
        (None, True, 1),  # no override: the call's early_stop=True
        (None, False, 2),  # no override: the call's early_stop=False
        (False, True, 2),  # the setting overrides the call
        (True, False, 1),  # ... both ways
    ],
)
def test_set_checkpoint_early_stop_overrides_the_call(setting, call_arg, after_last_save):
    f = Counted()
    x = data(4)
    if setting is None:
        out = remat.checkpoint(f, x, early_stop=call_arg)
    else:
        with remat.set_checkpoint_early_stop(setting):
            out = remat.checkpoint(f, x, early_stop=call_arg)
    out.sum().backward()  # outside the context: the value at forward time counts
    assert (f.start, f.after_last_save) == (2, after_last_save)


def test_disable_checkpointing_runs_the_plain_function():
    f = Counted()
    x = data(4)
    with remat.disable_checkpointing():
        out = remat.checkpoint(f, x)
        out_r = remat.checkpoint(f, x, use_reentrant=True)
    assert out.grad_fn.name() == "MulBackward0" and out_r.grad_fn.name() == "MulBackward0"
    (out + out_r).sum().backward()
    assert f.start == 2 and f.flags == [(False, False), (False, False)]


# ------------------------------------------------------------------------- flags


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_is_checkpointing_and_is_recomputing_track_forward_and_recompute(use_reentrant):
    f = Counted()
    x = data(4)
    assert not remat.is_checkpointing() and not remat.is_recomputing()
    remat.checkpoint(f, x, use_reentrant=use_reentrant).sum().backward()
    assert f.flags == [(True, False), (True, True)]
    assert not remat.is_checkpointing() and not remat.is_recomputing()


def test_flags_in_nested_regions():
    seen = []

    def inner(t):
        seen.append(("inner", remat.is_checkpointing(), remat.is_recomputing()))
        return t.exp()

    def outer(t):
        seen.append(("outer", remat.is_checkpointing(), remat.is_recomputing()))
        return remat.checkpoint(inner, t.sin()).cos()

    remat.checkpoint(outer, data(3)).sum().backward()
    assert seen[:2] == [("outer", True, False), ("inner", True, False)]
    assert all(c and r for _, c, r in seen[2:])  # every later run is a recompute
    assert not remat.is_checkpointing() and not remat.is_recomputing()


# ----------------------------------------------------------------- threads, tasks


def test_two_threads_checkpointing_at_once_do_not_interfere():
    # Both threads meet inside their forward regions, again while "a" holds its
    # setting and "b" reads its own, and again inside their recomputes.
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def worker(name: str, seed: int) -> None:
        try:
            f = Counted(barrier)
            x = data(64, seed=seed)
            if name == "a":
                with remat.set_checkpoint_early_stop(False):
                    out = remat.checkpoint(f, x, debug=True)
                    barrier.wait(timeout=10)
                    barrier.wait(timeout=10)
                seen = current()
            else:
                out = remat.checkpoint(f, x)
                barrier.wait(timeout=10)
                seen = current()  # "a" is inside set_checkpoint_early_stop(False) now
                barrier.wait(timeout=10)
            out.sum().backward()
            results[name] = (f, x, seen)
        except BaseException as e:  # reported in the main thread
            barrier.abort()
            results[name] = e

    threads = [threading.Thread(target=worker, args=(name, i)) for i, name in enumerate("ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for name in "ab":
        assert not isinstance(results[name], BaseException), results[name]
    fa, xa, seen_a = results["a"]
    fb, xb, seen_b = results["b"]
    assert seen_a == seen_b == (None, None, False)
    # a recomputed the whole function, b stopped early; each region recomputed once
    assert (fa.start, fa.after_last_save) == (2, 2)
    assert (fb.start, fb.after_last_save) == (2, 1)
    assert fa.flags == fb.flags == [(True, False), (True, True)]
    for x in (xa, xb):
        assert torch.equal(x.grad, x.detach().cos() * 3.0)
    assert current() == (None, None, False)


def test_a_thread_outside_any_region_sees_no_flags_while_another_checkpoints():
    inside = threading.Event()
    release = threading.Event()
    seen: list[tuple[bool, bool]] = []

    def f(t):
        inside.set()
        release.wait(timeout=10)
        return t.sin()

    def run():
        remat.checkpoint(f, data(3)).sum().backward()

    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(timeout=10)
    seen.append((remat.is_checkpointing(), remat.is_recomputing()))
    release.set()
    t.join(timeout=30)
    assert seen == [(False, False)]


def test_settings_are_task_local_in_asyncio():
    async def task(early_stop: bool, ready: asyncio.Event, other: asyncio.Event):
        f = Counted()
        x = data(4)
        with remat.set_checkpoint_early_stop(early_stop):
            ready.set()
            await other.wait()  # the other task entered its own setting meanwhile
            out = remat.checkpoint(f, x)
        out.sum().backward()
        return f.after_last_save

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task(False, a, b), task(True, b, a))

    assert asyncio.run(main()) == [2, 1]
    assert current() == (None, None, False)
