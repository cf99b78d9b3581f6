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
    for r in rows:
        ax.scatter(r.time_ratio, r.activation_ratio, s=40)
        ax.annotate(
            r.strategy,
            (r.time_ratio, r.activation_ratio),
            textcoords="offset points",
            xytext=(5, 4),
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
