"""benchmarks/vision_bench.py, dry: one timed round on a small ResNet, every strategy."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import pytest

from tests.support.vision_models import ResNet

pytestmark = pytest.mark.usefixtures("one_thread")

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "vision_bench.py"


def _module():
    spec = importlib.util.spec_from_file_location("vision_bench", PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vision_bench_rows_and_table():
    bench = _module()
    small = functools.partial(ResNet, widths=(4, 4, 4, 4))
    rows = bench.bench(small, (2, 3, 16, 16), rounds=1, warmup=0, timer="flops")
    assert [r["strategy"] for r in rows] == list(bench.STRATEGIES)
    none, by_hand, auto = rows
    assert none["time_ratio"] == 1.0 and none["max_grad_diff"] == 0.0
    # every default block checkpointed by hand, gradients bitwise on CPU, fewer activations
    assert by_hand["blocks"] == 8 and by_hand["max_grad_diff"] == 0.0
    assert by_hand["activation_bytes"] < none["activation_bytes"]
    assert auto["blocks"] == 8 and auto["max_grad_diff"] == 0.0
    assert auto["activation_bytes"] < none["activation_bytes"]
    text = bench.table({"ResNet": rows})
    assert text.count("| ResNet |") == 3 and "torch-every-block" in text
