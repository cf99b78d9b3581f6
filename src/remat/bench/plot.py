"""The memory/time picture of ``remat bench`` (matplotlib: the ``remat[plot]`` extra).

One point per strategy: its activations against its step time, both as ratios to
no checkpointing (the table's ``act x`` and ``time x`` columns, and each label says
``act`` and ``time``), with the time spread as a horizontal bar. The recommended
strategies (the fastest at each memory level) are filled and joined by a line.
Labels sit in a column right of the axes, one line apart, each joined to its
point by a thin line, so they never overlap however close the points are. The
recommendation and the footnotes are printed under the axes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

X_LABEL = "step time / no checkpointing: the time x column (bar: its spread over rounds)"
"""The x axis: the table's ``time x`` column."""

Y_LABEL = "activations / no checkpointing: the act x column"
"""The y axis: the table's ``act x`` column (not ``mem x``, the whole step's peak)."""

LABEL_LINE = 1.35
"""Distance between two labels, in font heights."""


def spread_labels(
    wanted: Sequence[float], gap: float, low: float = 0.0, high: float = 1.0
) -> list[float]:
    """Positions as close to ``wanted`` as possible, at least ``gap`` apart, within [low, high].

    Keeps the order of ``wanted``. When ``len(wanted) * gap`` exceeds the room, the
    positions are spaced ``gap`` apart from ``low`` (the caller makes ``gap`` fit).

    Example:
        >>> [round(y, 2) for y in spread_labels([0.5, 0.5, 0.52, 0.9], 0.1)]
        [0.41, 0.51, 0.61, 0.9]
    """
    order = sorted(range(len(wanted)), key=lambda i: (wanted[i], i))
    ys = [min(max(wanted[i], low), high) for i in order]
    n = len(ys)
    if n == 0:
        return []
    if (n - 1) * gap > high - low:
        placed = [low + k * gap for k in range(n)]
    else:
        # push up from the bottom, then down from the top, then centre each tight group
        placed = list(ys)
        for k in range(1, n):
            placed[k] = max(placed[k], placed[k - 1] + gap)
        placed[-1] = min(placed[-1], high)
        for k in range(n - 2, -1, -1):
            placed[k] = min(placed[k], placed[k + 1] - gap)
        placed = _centre_groups(placed, ys, gap, low, high)
    out = [0.0] * n
    for k, i in enumerate(order):
        out[i] = placed[k]
    return out


def _centre_groups(
    placed: list[float], wanted: list[float], gap: float, low: float, high: float
) -> list[float]:
    """Shift each run of labels packed ``gap`` apart so that it is centred on what it wanted."""
    out = list(placed)
    k = 0
    while k < len(out):
        j = k
        while j + 1 < len(out) and out[j + 1] - out[j] <= gap * 1.0001:
            j += 1
        shift = sum(wanted[k : j + 1]) / (j + 1 - k) - sum(out[k : j + 1]) / (j + 1 - k)
        lo_room = out[k] - (out[k - 1] + gap if k > 0 else low)
        hi_room = (out[j + 1] - gap if j + 1 < len(out) else high) - out[j]
        shift = min(max(shift, -lo_room), hi_room)
        for m in range(k, j + 1):
            out[m] += shift
        k = j + 1
    return out


def plot(
    rows: Sequence[Any],
    path: str,
    *,
    title: str = "remat bench",
    recommended: Sequence[str] = (),
    caption: Sequence[str] = (),
) -> Any:
    """Draw the rows' activation ratio against time ratio to ``path``; returns the figure's texts.

    Args:
        rows: :class:`~remat.bench.runner.Row` (``strategy``, ``activation_ratio``,
            ``time_ratio``, ``time_ratio_low``, ``time_ratio_high``, ``note``).
        path: a ``.png``, ``.pdf`` or ``.svg`` file.
        title: the picture's title.
        recommended: names of the recommended rows, least memory first.
        caption: paragraphs printed under the axes (the recommendation, footnotes).

    Returns:
        ``(figure, label_texts)`` after saving (closed: only for inspection in tests).

    Raises:
        ImportError: without matplotlib, naming the extra to install.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the picture needs matplotlib: pip install 'remat[plot]'") from e
    # each line of a paragraph wrapped alone: the recommendation is one line per level
    wrapped = ["\n".join(textwrap.fill(line, 120) for line in p.splitlines()) for p in caption]
    caption_lines = sum(p.count("\n") + 1 for p in wrapped)
    height = 5.2 + 0.16 * caption_lines
    fig = plt.figure(figsize=(10, height))
    bottom_in = 0.75 + 0.16 * caption_lines  # axis label, then the caption
    ax = fig.add_axes((0.08, bottom_in / height, 0.55, 1 - (bottom_in + 0.45) / height))
    chosen = set(recommended)
    marks = {r.strategy: f" [{k}]" for k, r in enumerate((r for r in rows if r.note), 1)}
    for r in rows:
        best = r.strategy in chosen
        ax.errorbar(
            r.time_ratio,
            r.activation_ratio,
            xerr=[[r.time_ratio - r.time_ratio_low], [r.time_ratio_high - r.time_ratio]],
            fmt="o",
            ms=8 if best else 5,
            color="tab:blue" if best else "0.55",
            mfc="tab:blue" if best else "white",
            ecolor="0.6",
            elinewidth=1,
            capsize=2,
            zorder=3 if best else 2,
        )
    front = [r for name in recommended for r in rows if r.strategy == name]
    if len(front) > 1:
        ax.plot(
            [r.time_ratio for r in front],
            [r.activation_ratio for r in front],
            "-",
            color="tab:blue",
            alpha=0.5,
            zorder=1,
            label="recommended: fastest at each memory level",
        )
        ax.legend(loc="upper right", fontsize=8)
    lo = min(r.time_ratio_low for r in rows)
    hi = max(r.time_ratio_high for r in rows)
    pad = 0.08 * ((hi - lo) or 0.5)
    ax.set_xlim(lo - pad, hi + pad)
    top = max(r.activation_ratio for r in rows)
    ax.set_ylim(0, top * 1.08 + 0.02)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(Y_LABEL)
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    # the label column: one line apart, each joined to its point
    fig.canvas.draw()
    ax_h_pt = ax.get_window_extent().height * 72 / fig.dpi
    fontsize = min(8.0, ax_h_pt / (LABEL_LINE * max(len(rows), 1)))
    gap = LABEL_LINE * fontsize / ax_h_pt
    to_axes = ax.transAxes.inverted()
    wanted = [
        float(to_axes.transform(ax.transData.transform((r.time_ratio, r.activation_ratio)))[1])
        for r in rows
    ]
    ys = spread_labels(wanted, gap, low=gap / 2, high=1 - gap / 2)
    labels = []
    for r, y in zip(rows, ys):
        text = (
            f"{r.strategy}{marks.get(r.strategy, '')}: {r.activation_ratio:.2f}x act, "
            f"{r.time_ratio:.2f}x time"
        )
        labels.append(
            ax.annotate(
                text,
                xy=(r.time_ratio, r.activation_ratio),
                xycoords="data",
                xytext=(1.04, y),
                textcoords="axes fraction",
                va="center",
                fontsize=fontsize,
                fontweight="bold" if r.strategy in chosen else "normal",
                color="0.1",
                annotation_clip=False,
                arrowprops={
                    "arrowstyle": "-",
                    "color": "0.75",
                    "lw": 0.6,
                    "shrinkA": 0,
                    "shrinkB": 3,
                },
            )
        )
    if wrapped:
        fig.text(0.02, 0.1 / height, "\n".join(wrapped), fontsize=8, va="bottom", ha="left")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig, labels
