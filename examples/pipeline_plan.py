"""A checkpointing plan per pipeline stage, for the microbatches its schedule holds (CPU, gloo).

    torchrun --nproc-per-node 2 examples/pipeline_plan.py

Run with plain ``python`` it starts the two processes itself. Each rank builds its stage of
a GPT, calls ``remat.plan_pipeline_stage`` once before training (no collective: each rank
plans its own stage for its own budget), applies the plan, then builds torch's
``PipelineStage`` and ``Schedule1F1B`` and trains as usual. Under 1F1B stage 0 holds two
microbatches' activations and stage 1 one, so at the same budget the first stage
checkpoints and the last may not. Each rank measures its step's peak with
``remat.memory`` (from before the model is built: an absolute peak) against the prediction.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import remat
from remat.bench.models import GPTStage, ModelConfig, build, lm_loss

CFG = ModelConfig(layers=4, d_model=64, seq=32, batch=8, heads=2, vocab=128)
MICROBATCHES = 4
BUDGET = 2_900_000  # bytes, each rank: parameters, grads, AdamW state, buffers, activations


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == stages - 1
    mb = CFG.batch // MICROBATCHES
    # one microbatch of what this stage receives (tokens on the first), and its target
    example = (
        torch.zeros(mb, CFG.seq, dtype=torch.long) if first else torch.zeros(mb, CFG.seq, CFG.d_model)
    )
    target = torch.zeros(mb, CFG.seq, dtype=torch.long)
    try:
        with remat.memory.track() as tracker:
            module = GPTStage(build(CFG), rank, stages)  # type: ignore[arg-type]
            opt = torch.optim.AdamW(module.parameters())
            plan = remat.plan_pipeline_stage(
                module,
                example,
                stage_index=rank,
                num_stages=stages,
                schedule=Schedule1F1B,
                microbatches=MICROBATCHES,
                budget=BUDGET,
                loss_fn=lm_loss,
                target=target,
                optimizer=opt,
            )
            plan.apply(module)
            stage = PipelineStage(
                module,
                rank,
                stages,
                torch.device("cpu"),
                input_args=example.to("meta").requires_grad_(not first),
                output_args=torch.empty(
                    mb, CFG.seq, CFG.vocab if last else CFG.d_model, device="meta", requires_grad=True
                ),
            )
            schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=lm_loss)
            tokens = torch.randint(0, CFG.vocab, (CFG.batch, CFG.seq + 1))
            x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            del tokens
            x, y = (x if first else None), (y if last else None)
            peak = 0
            for _ in range(3):  # the training loop, unchanged
                opt.zero_grad()
                tracker.reset_peak()
                if first:
                    schedule.step(x)
                elif last:
                    schedule.step(target=y)
                else:
                    schedule.step()
                opt.step()
                peak = max(peak, tracker.peak_bytes)
        for r in range(stages):  # one rank at a time
            if r == rank:
                print(plan, flush=True)
                print(
                    f"rank {rank}: measured peak {peak:,} B, predicted "
                    f"{plan.predicted_peak_bytes:,} B, budget {BUDGET:,} B",
                    flush=True,
                )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(2, free), nprocs=2, join=True)
