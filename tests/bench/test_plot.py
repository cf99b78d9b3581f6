"""The memory/time picture of ``remat bench`` (remat.bench.plot): labels that never overlap."""

from __future__ import annotations

import pytest

from remat.bench import report
from tests.support.bench import ACT, QUIET, make_result


def test_spread_labels_keep_order_and_gap_within_bounds():
    from remat.bench.plot import spread_labels

    wanted = [0.5, 0.5, 0.5, 0.51, 0.95, 0.96, 0.0]
    ys = spread_labels(wanted, 0.1, low=0.05, high=0.95)
    order = sorted(range(len(wanted)), key=lambda i: (wanted[i], i))
    placed = [ys[i] for i in order]
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert 0.05 - 1e-9 <= min(ys) and max(ys) <= 0.95 + 1e-9


def test_picture_labels_and_caption_never_overlap(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (remat[plot]) is not installed")
    from remat.bench.plot import plot

    # many strategies at the same point: the case where labels collided before
    times = {"none": QUIET["none"]}
    act = {"none": 1000}
    for k in range(12):
        times[f"strategy-{k}"] = [1.3 + 0.001 * k] * 5
        act[f"strategy-{k}"] = 200 + k % 2
    result = make_result(times, act)
    path = tmp_path / "bench.png"
    fig, labels = plot(
        result.rows,
        str(path),
        recommended=[r.strategy for r in result.recommended()],
        caption=[report.recommendation(result), result.noise.describe()],
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure was closed after saving: draw it again
    canvas.draw()
    renderer = canvas.get_renderer()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text, not its line
    boxes += [t.get_window_extent(renderer) for t in fig.texts]  # the caption
    ax = fig.axes[0]
    boxes += [ax.xaxis.label.get_window_extent(renderer), ax.title.get_window_extent(renderer)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert len(labels) == len(result.rows)


def test_axes_and_labels_name_the_columns_they_show(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (remat[plot]) is not installed")
    from remat.bench.plot import plot

    result = make_result(QUIET, ACT)
    fig, labels = plot(result.rows, str(tmp_path / "b.png"), caption=[report.recommendation(result)])
    ax = fig.axes[0]
    assert "act x column" in ax.get_ylabel() and "time x column" in ax.get_xlabel()
    full = next(r for r in result.rows if r.strategy == "full")
    # the label's ratios are the act x and time x columns, named as such (not "memory")
    assert f"full: {full.activation_ratio:.2f}x act, {full.time_ratio:.2f}x time" in [
        t.get_text() for t in labels
    ]
    # the recommendation's lines stay lines under the axes
    assert "\n  0.48x the activations: auto-50%" in fig.texts[0].get_text()
