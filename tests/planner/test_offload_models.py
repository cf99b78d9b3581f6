"""The step model's predictions for offload plans on the unseen-model families
(tests/support/families.py), on the simulated device (tests/support/simdevice.py).

``test_offload_plans.py`` checks the GPT and MLP chains; here the blocks differ: attention
with a cls token, a mask and rotary tables passed to every block, SDPA with dropout, BatchNorm
and squeeze-and-excitation in train mode, a U-Net's skip connections, blocks that end in a
tanh or relu (which saves its output). Known low predictions are strict xfails: each names
the pair effect or the simulated copy lag behind it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import remat
from tests.support.families import (
    DictOut,
    MobileNet,
    RotaryLM,
    SDPABlock,
    TanhBlock,
    TemporalBlock,
    TokenLM,
    UNet,
    ViT,
    class_loss,
    dict_loss,
    token_loss,
    tokens,
)
from tests.support.plans import plan_of
from tests.support.simdevice import simulated_device

pytestmark = pytest.mark.usefixtures("one_thread")

Span = tuple[int, ...]


def _first(model: nn.Module, attr: str, n: int) -> nn.Module:
    """The model with only the first ``n`` blocks of its container ``attr``."""
    blocks = list(getattr(model, attr))[:n]
    kind = nn.Sequential if isinstance(getattr(model, attr), nn.Sequential) else nn.ModuleList
    setattr(model, attr, kind(*blocks) if kind is nn.Sequential else kind(blocks))
    return model


class TCN(nn.Module):
    """The temporal net of tests/support/families.py with three blocks in a container of their own."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv1d(8, 32, 1)
        self.body = nn.Sequential(*[TemporalBlock(32, 2**i) for i in range(n)])
        self.head = nn.Conv1d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def _pad() -> torch.Tensor:
    pad = torch.ones(4, 16, dtype=torch.bool)
    pad[1, 12:] = False
    return pad


FAMILIES: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], Any]]] = {
    "vit": lambda: (ViT(depth=3), (torch.randn(4, 3, 16, 16),), class_loss),
    "rotary": lambda: (RotaryLM(depth=3), (tokens(shape=(4, 16)), _pad()), token_loss),
    "sdpa": lambda: (
        _first(TokenLM(SDPABlock), "blocks", 3),
        (tokens(shape=(4, 32)),),
        token_loss,
    ),
    "mobilenet": lambda: (
        _first(MobileNet(), "blocks", 3),
        (torch.randn(4, 3, 16, 16),),
        class_loss,
    ),
    "tcn": lambda: (TCN(), (torch.randn(4, 8, 64),), None),
    "tanh": lambda: (
        nn.Sequential(*[TanhBlock(32) for _ in range(3)]),
        (torch.randn(64, 32, requires_grad=True),),
        None,
    ),
    "dictout": lambda: (_first(DictOut(), "blocks", 3), (torch.randn(64, 32),), dict_loss),
    "unet": lambda: (UNet(), (torch.randn(2, 3, 16, 16),), None),
}


class _Setup:
    """One family profiled on the simulated device, with an AdamW step."""

    def __init__(self, family: str) -> None:
        torch.manual_seed(0)
        self.model, self.args, loss_fn = FAMILIES[family]()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.kw: dict[str, Any] = {"optimizer": self.opt}
        if loss_fn is not None:
            self.kw["loss_fn"] = loss_fn
        self.prof = remat.profile(self.model, *self.args, timer="flops", **self.kw)

    def high(self, ds: Sequence[str], spans: Sequence[Span] = ()) -> int:
        """Predicted minus measured peak of the plan (negative: predicted low)."""
        plan = plan_of(self.prof, ds, spans)
        plan.apply(self.model)
        return plan.predicted_peak_bytes - remat.measure_peak(self.model, *self.args, **self.kw)


def _per_block(n: int, decisions: Sequence[str]) -> list[tuple[list[str], list[Span]]]:
    return [(list(ds), []) for ds in itertools.product(decisions, repeat=n)]


def _span_layouts(prof: remat.Profile, inners: Sequence[str]) -> list[tuple[list[str], list[Span]]]:
    """Every span over chained blocks with each inner decision and the other blocks keep or
    offload, plain and (where the profile offers it) with its input offloaded."""
    n, out = len(prof.blocks), []
    for a, z in itertools.combinations(range(n), 2):
        if not all(prof.chained[a:z]):
            continue
        for inner in inners:
            for others in itertools.product(["keep", "offload"], repeat=n - (z - a + 1)):
                ds = [*others[:a], *[inner] * (z - a + 1), *others[a:]]
                out.append((ds, [(a, z)]))
                if prof.blocks[a].offload_input > 0:
                    out.append((ds, [(a, z, 1)]))
    return out


def _sweep(family: str, plans: Callable[[remat.Profile], list], seed_progress: float = 0.3):
    with simulated_device(0, seed_progress):
        s = _Setup(family)
        return s, [(ds, sp, s.high(ds, sp)) for ds, sp in plans(s.prof)]


def _after_offload(ds: Sequence[str], spans: Sequence[Span]) -> bool:
    return bool(spans) and spans[0][0] > 0 and ds[spans[0][0] - 1] == "offload"


# -- span inputs offered for offload ---------------------------------------------------------


def test_span_input_offload_is_offered_where_only_the_span_holds_the_input():
    with simulated_device(0):
        got = {f: [b.offload_input for b in _Setup(f).prof.blocks] for f in FAMILIES}
    # residual streams whose next block saves the input: blocks 0 and 1 start spans
    assert got["vit"] == [8704] * 2 + [0]  # (4, 17, 32) fp32
    assert got["rotary"] == [8192] * 2 + [0]
    assert got["sdpa"] == [16384] * 2 + [0]
    # block 0's input is the stem's, held by the caller while the container runs; the
    # later inputs are the relu / tanh outputs the block before saves
    assert got["tcn"] == [0, 0, 0]
    assert got["tanh"] == [0, 0, 0]
    assert got["dictout"] == [0, 0, 0]  # the model's code adds each input to the output
    assert got["mobilenet"] == [0, 65536, 0]  # the stem's output: held by the caller
    # encoder outputs e1, e2 are skip connections; blocks 2 -> 3 and 3 -> 4 pass through
    # interpolate / cat (not chained): offered there but no span can start at them
    assert got["unet"] == [0, 0, 0, 16384, 65536, 0]


# -- families predicted exactly ---------------------------------------------------------------


@pytest.mark.slow  # 6 s
def test_every_per_block_offload_plan_of_a_vit_is_predicted_exactly():
    _, res = _sweep("vit", lambda p: _per_block(3, ["keep", "recompute", "offload"]))
    assert [r for r in res if r[2]] == []


@pytest.mark.slow
def test_vit_offload_and_span_layouts_are_predicted_exactly():
    _, res = _sweep(
        "vit",
        lambda p: (
            _per_block(3, ["keep", "selective", "offload"])
            + _span_layouts(p, ["keep", "recompute", "selective"])
        ),
    )
    assert [r for r in res if r[2]] == []


@pytest.mark.slow  # 5 s
def test_mobilenet_per_block_offload_plans_in_train_mode_are_predicted_exactly():
    _, res = _sweep("mobilenet", lambda p: _per_block(3, ["keep", "recompute", "offload"]))
    assert [r for r in res if r[2]] == []


def test_offload_plans_with_a_shared_mask_are_never_predicted_low():
    # the mask every block is passed (bool, 4*16*16 bytes) is counted once more than it
    # is held in some offload plans: high by at most its bytes, never low
    s, res = _sweep("rotary", lambda p: _per_block(3, ["keep", "recompute", "offload"]))
    mask = 4 * 16 * 16
    assert all(0 <= h <= mask for _, _, h in res), [r for r in res if not 0 <= r[2] <= mask]
    assert any(h == mask for _, _, h in res) and any(h == 0 for _, _, h in res)


@pytest.mark.slow
def test_rotary_span_layouts_are_never_predicted_low():
    _, res = _sweep("rotary", lambda p: _span_layouts(p, ["keep", "recompute", "selective"]))
    assert all(0 <= h <= 4 * 16 * 16 for _, _, h in res)


@pytest.mark.slow
def test_sdpa_dropout_offload_plans_are_exact_when_copies_finish_promptly():
    # with the side stream progressing at every event (progress=1.0) no copy is pending
    # when a block returns: every layout is exact (at 0.3, see the xfail below)
    _, res = _sweep(
        "sdpa",
        lambda p: (
            _per_block(3, ["keep", "recompute", "offload"])
            + _span_layouts(p, ["keep", "recompute", "selective"])
        ),
        seed_progress=1.0,
    )
    assert [r for r in res if r[2]] == []


@pytest.mark.slow
def test_offloaded_span_layouts_are_never_low_in_the_families_without_pair_effects():
    for family in ("vit", "sdpa", "mobilenet"):
        _, res = _sweep(family, lambda p: [(d, s) for d, s in _span_layouts(p, ["recompute"])])
        wrong = [r for r in res if r[2] < 0 or (r[2] > 0 and not _after_offload(r[0], r[1]))]
        assert wrong == [], family


# -- known low predictions --------------------------------------------------------------------


def test_offload_after_a_kept_block_that_saves_its_output_is_not_predicted_low():
    with simulated_device(0, 1.0):
        s = _Setup("tanh")
        assert s.high(["keep", "offload", "keep"]) >= 0


def test_offload_after_a_kept_relu_block_is_not_predicted_low():
    with simulated_device(0, 1.0):
        s = _Setup("tcn")
        assert s.high(["keep", "offload", "keep"]) >= 0


def test_keep_span_over_relu_blocks_holding_the_callers_input_is_not_predicted_low():
    with simulated_device(0, 1.0):
        s = _Setup("tcn")
        assert s.high(["keep"] * 3, [(0, 1)]) >= 0


def test_offloading_the_last_block_of_a_dict_output_model_is_not_predicted_low():
    with simulated_device(0, 1.0):
        s = _Setup("dictout")
        assert s.high(["keep", "keep", "offload"]) >= 0


@pytest.mark.xfail(
    strict=True,
    reason="simulated copy lag: a block's last copies out are pending when it returns "
    "(progress=0.3), so their device bytes die in the next block's window; under "
    "(keep, offload) the offloaded block is credited with a free that never happens "
    "(65536 low; exact with progress=1.0)",
)
def test_sdpa_offload_after_a_kept_block_is_not_predicted_low_with_lagging_copies():
    with simulated_device(0):
        s = _Setup("sdpa")
        assert s.high(["keep", "offload", "keep"]) >= 0
