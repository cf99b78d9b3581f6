"""Small models shaped like torchvision's and timm's (whose wheels are not used here): the
module trees the default block rule reads, at widths a CPU test can step.

ResNet (stages of BasicBlocks, the first with a downsample), ConvNeXt (stages holding a
downsample and a ``blocks`` Sequential), a U-Net (down, mid and up stacks of residual
blocks with skips), MobileNetV3 (a stem and a last conv of the class of the inverted
residuals' own layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """torchvision's ResNet block: two 3x3 convs, a downsample where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block: 1x1 in, 3x3, 1x1 out at 4x the width."""

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class ResNet(nn.Module):
    """ResNet-18's tree (stem, ``layer1`` ... ``layer4`` of two BasicBlocks, pool, fc);
    ``bottleneck=True``: ResNet-50's blocks (two a stage)."""

    def __init__(
        self, widths: tuple[int, ...] = (8, 16, 32, 64), classes: int = 10, bottleneck: bool = False
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            if bottleneck:
                stage = nn.Sequential(Bottleneck(cin, w, stride), Bottleneck(4 * w, w))
                cin = 4 * w
            else:
                stage = nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w))
                cin = w
            self.add_module(f"layer{i + 1}", stage)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(
            0, 3, 1, 2
        )


class Mlp(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvNeXtBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.mlp = Mlp(d, 4 * d)
        self.gamma = nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv_dw(x).permute(0, 2, 3, 1))
        return x + (self.mlp(y) * self.gamma).permute(0, 3, 1, 2)


class ConvNeXtStage(nn.Module):
    def __init__(self, cin: int, cout: int, depth: int) -> None:
        super().__init__()
        self.downsample: nn.Module = (
            nn.Identity()
            if cin == cout
            else nn.Sequential(LayerNorm2d(cin), nn.Conv2d(cin, cout, 2, stride=2))
        )
        self.blocks = nn.Sequential(*[ConvNeXtBlock(cout) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    """timm's ConvNeXt tree (``stem``, ``stages.N.downsample``, ``stages.N.blocks.*``, head);
    depths (2, 2, 6, 2) as ConvNeXt-atto."""

    def __init__(
        self,
        dims: tuple[int, ...] = (8, 16, 32, 64),
        depths: tuple[int, ...] = (2, 2, 6, 2),
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        cin = dims[0]
        stages = []
        for d, n in zip(dims, depths):
            stages.append(ConvNeXtStage(cin, d, n))
            cin = d
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(cin)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean((2, 3))))


class ResBlock(nn.Module):
    """A U-Net residual block (GroupNorm, SiLU, two convs, a 1x1 skip where widths differ)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(2, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class UNet(nn.Module):
    """Down, mid and up stacks of two residual blocks each; the up blocks take the down
    blocks' outputs (skips). ``up_first=True`` registers the up stacks before the down
    ones (the tree's order is then not the order forward calls them)."""

    def __init__(self, c: int = 8, up_first: bool = False) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)

        def down() -> nn.ModuleList:
            return nn.ModuleList(
                [nn.Sequential(ResBlock(c, c), ResBlock(c, c)),
                 nn.Sequential(ResBlock(c, 2 * c), ResBlock(2 * c, 2 * c))]
            )  # fmt: skip

        def up() -> nn.ModuleList:
            return nn.ModuleList(
                [nn.Sequential(ResBlock(4 * c, 2 * c), ResBlock(2 * c, 2 * c)),
                 nn.Sequential(ResBlock(3 * c, c), ResBlock(c, c))]
            )  # fmt: skip

        if up_first:
            self.up = up()
        self.down = down()
        self.mid = nn.Sequential(ResBlock(2 * c, 2 * c), ResBlock(2 * c, 2 * c))
        if not up_first:
            self.up = up()
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skips = []
        for i, stack in enumerate(self.down):
            h = stack(h if i == 0 else F.avg_pool2d(h, 2))
            skips.append(h)
        h = self.mid(h)
        for stack in self.up:
            skip = skips.pop()
            if h.shape[-1] != skip.shape[-1]:
                h = F.interpolate(h, scale_factor=2.0)
            h = stack(torch.cat([h, skip], 1))
        return self.out(h)


class ConvNormAct(nn.Sequential):
    """torchvision's Conv2dNormActivation: a Sequential subclass."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.Hardswish(),
        )


class SqueezeExcitation(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, se: bool, stride: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expand != cin:
            layers.append(ConvNormAct(cin, expand, 1))
        layers.append(ConvNormAct(expand, expand, 3, stride, groups=expand))
        if se:
            layers.append(SqueezeExcitation(expand, max(expand // 4, 2)))
        layers.append(ConvNormAct(expand, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV3(nn.Module):
    """MobileNetV3-Large's tree, narrow: ``features`` = stem, inverted residuals (the first
    ones without squeeze-excitation), last conv; ``classifier`` a Sequential of layers."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        config = [  # cin, expand, cout, se, stride
            (8, 8, 8, False, 1),
            (8, 32, 12, False, 2),
            (12, 36, 12, False, 1),
            (12, 36, 16, True, 2),
            (16, 48, 16, True, 1),
        ]
        self.features = nn.Sequential(
            ConvNormAct(3, 8, 3, 2),
            *[InvertedResidual(*c) for c in config],
            ConvNormAct(16, 48, 1),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(48, 32), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(32, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class BasicResBlock(nn.Module):
    """conv, BatchNorm, ReLU, conv, BatchNorm, skip (then a ReLU with ``out_relu``, as
    ResNet's BasicBlock): the block of the CNN tests of the step model (#31's residual CNN,
    the offload plans)."""

    def __init__(self, c: int, out_relu: bool = False) -> None:
        super().__init__()
        self.out_relu = out_relu
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out) if self.out_relu else out


class ConvResBlock(nn.Module):
    """Two 3x3 convs at stride 1 with a BatchNorm between and a skip: maps of the image's size."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.bn(self.conv1(x))))


class ConvChain(nn.Module):
    """A stem, ``n`` :class:`ConvResBlock` s and a pooled linear head whose loss it returns: a
    CNN whose activations grow with the image's area (any square size)."""

    def __init__(self, c: int = 8, n: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvResBlock(c) for _ in range(n)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3))).square().mean()
