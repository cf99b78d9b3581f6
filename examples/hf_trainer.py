"""A Hugging Face Trainer that plans remat's checkpointing for a memory budget on its first batch.

Run: python examples/hf_trainer.py   (CPU, a few seconds; needs: pip install 'remat[hf]')

A tiny random Llama (nothing downloaded) is trained for a few steps by
``transformers.Trainer`` with gradient accumulation, twice from the same seed:

1. with ``remat.integrations.hf.RematCallback(budget)``: on the first training batch
   it profiles the model's decoder layers with the Trainer's optimizer, loss,
   precision and accumulation, picks keep / recompute / selective per layer so the
   step fits the budget, and applies the plan; every optimizer step's peak is then
   measured and printed beside the prediction and the budget (also in the Trainer's
   logs: ``remat/peak_bytes``, ``remat/predicted_bytes``, ``remat/budget_bytes``);
2. without remat;
3. with ``TrainingArguments(activation_checkpointing=True)`` (transformers' own switch;
   ``gradient_checkpointing=True`` is its deprecated alias) and the callback: the callback
   turns transformers' checkpointing off, says so once, and plans the same layers.

The losses of the three runs are equal bit for bit: checkpointing changes memory, not
results.
"""

from __future__ import annotations

import logging
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from remat.integrations.hf import RematCallback

BUDGET = "50%"  # of what the unchecked step allocates above its static bytes; or bytes


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def make_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(16):
        ids = torch.randint(0, 128, (48,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def train(callbacks: list, switch: bool = False) -> list[float]:
    """Four optimizer steps of two micro-batches each; the loss of every step (``switch``:
    with transformers' own activation checkpointing turned on)."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=4,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            activation_checkpointing=switch,
        )
        trainer = Trainer(
            model=make_model(), args=args, train_dataset=make_data(), callbacks=callbacks
        )
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    callback = RematCallback(BUDGET, timer="flops")
    losses = train([callback])
    print(callback.plan)
    print("per optimizer step: measured peak vs predicted vs budget")
    for check in callback.checks:
        print(f"  {check}")
    plain = train([])
    switched = RematCallback(BUDGET, timer="flops")
    taken_over = train([switched], switch=True)  # remat takes transformers' switch over
    print(f"losses with remat:    {losses}")
    print(f"losses without remat: {plain}")
    print(f"losses with activation_checkpointing=True and remat: {taken_over}")
    fits = all(not c.over_budget for c in callback.checks + switched.checks)
    print(f"budget held on every step: {fits}; losses equal without remat: {losses == plain}")
    print(f"with activation_checkpointing=True: losses equal without remat: {taken_over == plain}")


if __name__ == "__main__":
    main()
