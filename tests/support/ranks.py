"""Run a test scenario on several processes (gloo, CPU): each rank calls
``SCENARIOS[name](rank)`` of the test module that asks, under a process group, and returns
a dict (or an ``"error"`` traceback) that the parent collects."""

from __future__ import annotations

import importlib
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, out: str, module: str, scenario: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = importlib.import_module(module).SCENARIOS[scenario](rank)
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def run_ranks(
    tmp_path: Path, module: str, scenario: str, world: int = 2, timeout_s: float = 120
) -> list[dict]:
    """Run ``module.SCENARIOS[scenario]`` on ``world`` ranks; fail (and kill them) past
    ``timeout_s`` (a hang), or with a rank's traceback."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, str(tmp_path), module, scenario))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {timeout_s} s (a hang)"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def full_grads(model: torch.nn.Module, x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """One training step of a model returning its loss from RNG seed ``seed``; the copied
    gradients by parameter name, whole (a sharded gradient gathered)."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out
