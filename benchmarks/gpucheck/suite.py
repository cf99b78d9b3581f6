"""The ``suite`` part: the default test suite, as CI and ``nox`` run it, under the GPU's torch.

``python -m pytest -q`` (the README's test command; with CUDA present it includes the
GPU tests) split by test file into shards that run side by side, one subprocess each,
their outcomes read from each shard's JUnit XML and added up. The torch version the
suite ran with is recorded with the counts (``torch``), so a GPU run adds a row to the
README's compatibility table. A dry run runs two small files in two shards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .device import ROOT, Check
from .run import Deadline

DRY_FILES = ("tests/engine/test_torch_compat.py", "tests/engine/test_checkpoint_curried.py")
"""What a dry run runs (two shards: the sharding code runs, in seconds)."""


def suite_items(root: Path) -> list[str]:
    """What the default run collects (pyproject's ``testpaths``), one shardable item each:
    every test file, and ``src/remat`` (the doctests) whole."""
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py"))
    return [*files, "src/remat"]


def shards(items: list[str], n: int, root: Path) -> list[list[str]]:
    """``items`` in ``n`` groups of about equal size in bytes (largest first, each to the
    lightest group so far), each group in the order pytest would run it."""

    def size(item: str) -> int:
        path = root / item
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*.py"))
        return path.stat().st_size

    groups: list[list[str]] = [[] for _ in range(max(1, min(n, len(items))))]
    loads = [0] * len(groups)
    for item in sorted(items, key=size, reverse=True):
        i = loads.index(min(loads))
        groups[i].append(item)
        loads[i] += size(item)
    return [sorted(g) for g in groups if g]


def part_suite(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """The default suite in shards side by side; counts per outcome, added up."""
    import torch

    from .parts import junit_outcomes, pytest_env

    found["torch"] = torch.__version__
    found["cuda_available"] = torch.cuda.is_available()
    items = list(DRY_FILES) if check.dry_run else suite_items(ROOT)
    n = 2 if check.dry_run else max(1, min(8, (os.cpu_count() or 2) // 2))
    groups = shards(items, n, ROOT)
    found["command"] = "python -m pytest -q -p no:cacheprovider (in shards by file)"
    found["shards"] = len(groups)
    env = pytest_env()
    procs = []
    for i, group in enumerate(groups):
        xml = check.out / f"suite-{i}.xml"
        if xml.exists():
            xml.unlink()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={xml}", *group]
        log = (check.out / f"suite-{i}.log").open("w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), xml, log))
    try:
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=max(deadline.left(), 1.0))
            except subprocess.TimeoutExpired:
                found["cut_short"] = "pytest shards killed at the part's limit"
                break
    finally:
        for proc, _, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad: list[dict[str, Any]] = []
    missing = []
    for i, (_proc, xml, _) in enumerate(procs):
        if not xml.exists():
            missing.append(i)
            continue
        got = junit_outcomes(xml)
        for k in counts:
            counts[k] += got["counts"][k]
        bad += [t for t in got["tests"] if t["outcome"] in ("failed", "error")]
    found["counts"] = counts
    found["not_passed"] = bad[:50]
    if missing:
        tails = {
            i: "\n".join((check.out / f"suite-{i}.log").read_text().splitlines()[-5:])
            for i in missing
        }
        found["shards_without_report"] = tails
        if "cut_short" not in found:
            raise RuntimeError(f"pytest shards {missing} exited without a report")
