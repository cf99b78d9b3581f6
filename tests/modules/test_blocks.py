"""The default candidate blocks (remat/modules/blocks.py): the repeated blocks of every stack and
stage, one rule for the planner and apply_activation_checkpointing; and in_call_order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.modules.blocks import default_blocks
from remat.modules.modelinfo import in_call_order
from tests.support.vision_models import ConvNeXt, MobileNetV3, ResNet, UNet

pytestmark = pytest.mark.usefixtures("one_thread")


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Other(Block):
    """A second block class (an attention layer in a stack of convolutions)."""


class PreNorm(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fn = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


class Attributes(nn.Module):
    """Blocks held as plain attributes beside single layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block1 = Block()
        self.block2 = Block()
        self.block3 = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block3(self.block2(self.block1(self.embed(x)))))


class Hybrid(nn.Module):
    """Interleaved classes in one stack (attention layers among convolutions), one of them
    first and last."""

    def __init__(self) -> None:
        super().__init__()
        kinds = [Other, Block, Block, Other, Block, Block, Other]
        self.layers = nn.Sequential(*[k() for k in kinds])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class PairLayers(nn.Module):
    """lucidrains' form: ``for attn, ff in self.layers`` over ModuleLists, which cannot be
    called: their members are the blocks."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([PreNorm(), PreNorm()]) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:  # type: ignore[misc]
            x = x + attn(x)
            x = x + ff(x)
        return x


class TowerAndLM(nn.Module):
    """A vision tower beside a language model, each a stack of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Module()
        self.vision.layers = nn.ModuleList(Other() for _ in range(2))
        self.proj = nn.Linear(8, 8)
        self.lm = nn.Module()
        self.lm.embed = nn.Embedding(10, 8)
        self.lm.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h = img
        for layer in self.vision.layers:
            h = layer(h)
        h = self.proj(h)
        for layer in self.lm.layers:
            h = layer(h)
        return h


class MoE(nn.Module):
    """A mixture of experts: a router of its own beside a ModuleList of experts."""

    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = torch.where((choice == e)[..., None], expert(h), out)
        return x + out


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(MoE() for _ in range(3))
        self.head = nn.Linear(8, 10)


class DenseBlock(nn.ModuleDict):
    """torchvision's DenseNet block: a ModuleDict with a forward of its own."""

    def __init__(self, n: int) -> None:
        super().__init__({f"denselayer{i}": Block() for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = layer(x)
        return x


class DenseNet(nn.Module):
    """Stem layers, two stages with a transition (another class) between them, all in one
    ``features`` Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Linear(8, 8))
        self.features.add_module("denseblock1", DenseBlock(2))
        self.features.add_module("transition1", nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)))
        self.features.add_module("denseblock2", DenseBlock(3))
        self.classifier = nn.Linear(8, 2)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        b = Block()
        self.layers = nn.ModuleList([b, Block(), Block()])
        self.again = b  # the same module under a second name


CASES = [
    # ResNet: every stage's BasicBlocks; the first of a stage (a downsample) is one of them
    (ResNet, [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]),
    # ConvNeXt: the blocks of all four stages, not the stages or the largest stage alone
    (ConvNeXt, [f"stages.{s}.blocks.{i}" for s, n in enumerate((2, 2, 6, 2)) for i in range(n)]),
    # a stage of one block among stages of two: still the blocks
    (lambda: ConvNeXt(depths=(1, 2, 1, 1)), ["stages.0.blocks.0", "stages.1.blocks.0",
                                             "stages.1.blocks.1", "stages.2.blocks.0",
                                             "stages.3.blocks.0"]),
    # U-Net: down, mid and up stacks of residual blocks
    (UNet, [*names("down.0.", 2), *names("down.1.", 2), *names("mid.", 2),
            *names("up.0.", 2), *names("up.1.", 2)]),
    # MobileNetV3: the inverted residuals, not the stem and the last conv (their class is
    # the residuals' own layers'), nor the residuals' layers
    (MobileNetV3, [f"features.{i}" for i in range(1, 6)]),
    # blocks held as plain attributes, not the embedding and head layers beside them
    (Attributes, ["block1", "block2", "block3"]),
    # a hybrid stack: the interleaved class is the stack's too, also first and last
    (Hybrid, names("layers.", 7)),
    # ModuleLists of (attention, MLP) cannot be called: their members are the blocks
    (PairLayers, [f"layers.{i}.{j}" for i in range(3) for j in range(2)]),
    # a vision tower beside a language model: both stacks
    (TowerAndLM, [*names("vision.layers.", 2), *names("lm.layers.", 3)]),
    # a block registered under a second name is one block
    (Shared, names("layers.", 3)),
    # mixture-of-experts layers are the blocks, not their experts
    (MoELM, names("layers.", 3)),
    # a chain's single layers beside its blocks (first and last conv) are steps of it
    (lambda: nn.Sequential(nn.Conv1d(2, 4, 1), Block(4), Block(4), nn.Conv1d(4, 2, 1)),
     names("", 4)),
    # stages (a ModuleDict with a forward) give their layers; the transition between them
    # (one module of another kind) and the stem layer are steps of the chain
    (DenseNet, ["features.conv0", *names("features.denseblock1.denselayer", 2),
                "features.transition1", *names("features.denseblock2.denselayer", 3)]),
    # bottleneck blocks, ResNet-50's
    (lambda: ResNet(bottleneck=True), [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]),
]  # fmt: skip


@pytest.mark.parametrize("make, expected", CASES)
def test_default_blocks_are_the_repeated_blocks_of_every_stack(make, expected):
    assert default_blocks(make()) == expected


@pytest.mark.parametrize("make, expected", CASES)
def test_apply_activation_checkpointing_wraps_the_default_blocks(make, expected):
    assert remat.apply_activation_checkpointing(make()) == expected


def test_models_of_layers_keep_the_largest_container_rule():
    # no stack of modules with submodules: the children of the largest Sequential
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert default_blocks(seq) == names("", 4)

    # one stack of Sequentials of layers: those, not one Sequential's layers
    def conv() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 1))

    holder = nn.Module()
    holder.blocks = nn.ModuleList(conv() for _ in range(4))
    holder.head = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert default_blocks(holder) == names("blocks.", 4)


def test_no_blocks_raises_naming_check_fn():
    with pytest.raises(ValueError, match="check_fn=lambda name, module"):
        remat.profile(nn.Linear(4, 4), torch.randn(2, 4), timer="flops")


@pytest.mark.parametrize("make", [ResNet, ConvNeXt, UNet, MobileNetV3])
def test_default_blocks_run_once_each_in_tree_order(make):
    torch.manual_seed(0)
    model = make()
    blocks = default_blocks(model)
    assert in_call_order(model, blocks, (torch.randn(2, 3, 32, 32),)) == blocks


def test_in_call_order_follows_forward_not_the_tree():
    torch.manual_seed(0)
    model = UNet(up_first=True)  # the up stacks are registered first
    blocks = default_blocks(model)
    assert blocks[:4] == [*names("up.0.", 2), *names("up.1.", 2)]
    assert in_call_order(model, blocks, (torch.randn(2, 3, 32, 32),)) == default_blocks(UNet())


def test_in_call_order_puts_back_buffers_rng_and_inputs():
    class Scales(nn.Module):  # BatchNorm statistics, dropout, an input changed in place
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)) for _ in range(2)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Scales()
    x = torch.randn(8, 4)
    before = ({k: v.clone() for k, v in model.state_dict().items()}, x.clone())
    rng = torch.get_rng_state()
    assert in_call_order(model, ["layers.1", "layers.0"], (x,)) == ["layers.0", "layers.1"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, before[1])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[0][k]), k
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_in_call_order_puts_blocks_not_called_last():
    model = Attributes()
    got = in_call_order(model, ["head", "block3", "embed"], (torch.randn(1, 8),))
    assert got == ["embed", "block3", "head"]
    model.forward = lambda x: model.block1(x)  # type: ignore[method-assign]
    assert in_call_order(model, ["block2", "block1"], (torch.randn(1, 8),)) == ["block1", "block2"]


def test_profile_takes_default_blocks_in_call_order():
    # the order is recorded in the profile's warm-up step: the same profile as the model
    # whose tree is in call order (which blocks are chained, every term)
    x = torch.randn(2, 3, 16, 16)
    torch.manual_seed(0)
    prof = remat.profile(UNet(up_first=True), x, timer="flops")
    torch.manual_seed(0)
    tree = remat.profile(UNet(), x, timer="flops")
    assert [b.name for b in prof.blocks] == default_blocks(UNet())
    assert prof.chained == tree.chained and prof.kept_outputs == tree.kept_outputs
    assert prof.blocks == tree.blocks


def test_profile_records_chained_blocks_in_call_order():
    class Reversed(nn.Module):  # registered a, b, c; called c, b, a
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[2](x)
            x = self.layers[1](x) * 2  # the model's code between layers.1 and layers.0
            return self.layers[0](x)

    torch.manual_seed(0)
    prof = remat.profile(Reversed(), torch.randn(4, 8), timer="flops")
    assert [b.name for b in prof.blocks] == ["layers.2", "layers.1", "layers.0"]
    assert prof.chained == [True, False]
