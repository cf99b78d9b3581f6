"""What the tests share, in one place (a test never imports another test file).

- :mod:`tests.support.tensors`: seeded inputs and bitwise comparison of lists and dicts of
  tensors (gradients, losses).
- :mod:`tests.support.steps`: one training step's loss (``loss_of``) and gradients.
- :mod:`tests.support.models`: small models (a hand-written GPT, BatchNorm and MLP chains,
  the step-model tests' residual MLP) and two sizes of the built-in benchmark GPT.
- :mod:`tests.support.families`: the model families the planner is checked on end to end
  (ViT, rotary LM, LSTM, temporal convolutions, mixture of experts, MobileNet, U-Net, ...).
- :mod:`tests.support.plans`: planner helpers (a plan of given decisions, the per-block floor).
- :mod:`tests.support.chains`: synthetic block chains for the solvers.
- :mod:`tests.support.referee`: an independent meter (``torch.profiler``'s allocator events).
- :mod:`tests.support.simdevice`: a simulated asynchronous device for the offload engine.
- :mod:`tests.support.differential`: what the random-program tests share.
- :mod:`tests.support.budgetcheck`: plans at 70/50/30 % checked against measured steps,
  predictions of random mixes checked to the byte.
- :mod:`tests.support.ranks`: scenarios run on several processes, gradients gathered.
- :mod:`tests.support.cli`, :mod:`tests.support.bench`: the command line's and the
  benchmark report's test helpers.
"""

from __future__ import annotations


