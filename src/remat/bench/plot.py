"""The memory/time picture of ``remat bench --plot`` (matplotlib: the ``remat[plot]`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot(
    rows: Sequence[Any], path: str, *, title: str = "remat bench", frontier: Any = None
) -> None:
    """Activation memory ratio against step time ratio, one labelled point per strategy.

    ``frontier``: optional ``(time_ratios, memory_ratios)`` drawn as a line (the planner's
    predicted frontier).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'remat[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 5))
    colors = [plt.get_cmap("tab20")(k) for k in range(20)]
    xs = [r.time_ratio for r in rows]
    ys = [r.activation_ratio for r in rows]
    span_x = (max(xs) - min(xs)) or 1.0
    span_y = (max(ys) - min(ys)) or 1.0
    placed: list[tuple[float, float]] = []
    for i, r in enumerate(rows):
        ax.scatter(r.time_ratio, r.activation_ratio, s=40, color=colors[i % len(colors)])
        # strategies often share a point (same bytes, similar time): stack labels that would collide
        near = sum(
            abs(r.time_ratio - x) < 0.2 * span_x and abs(r.activation_ratio - y) < 0.04 * span_y
            for x, y in placed
        )
        placed.append((r.time_ratio, r.activation_ratio))
        ax.annotate(
            r.strategy,
            (r.time_ratio, r.activation_ratio),
            textcoords="offset points",
            xytext=(5, 4 + 11 * near),
            fontsize=8,
            color="0.2",
            arrowprops={"arrowstyle": "-", "color": "0.7", "lw": 0.5} if near else None,
        )
    if frontier is not None:
        xs, ys = frontier
        ax.plot(xs, ys, "--", color="gray", label="planner: predicted frontier")
        ax.legend()
    ax.set_xlabel("step time / no checkpointing")
    ax.set_ylabel("activation memory / no checkpointing")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
