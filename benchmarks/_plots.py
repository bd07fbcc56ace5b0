"""Shared by the benchmark scripts: the plots docs/performance.md shows (SVG, written next
to the tables by ``--write``). Needs matplotlib (the ``bench`` nox session installs it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

#: Where the plots go, relative to the markdown file ``--write`` updates.
IMG_DIR = "img"


def plot_path(markdown: Path, name: str) -> Path:
    """``<markdown's folder>/img/<name>.svg``, its folder created."""
    path = markdown.parent / IMG_DIR / f"{name}.svg"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "asyncsync", "font.size": 10})  # stable SVG ids
    return plt


def lines(
    path: Path,
    title: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    *,
    xlabel: str,
    ylabel: str,
    floor: float | None = None,
    floor_label: str = "",
) -> None:
    """One line per series over ``x`` (log-log); ``None`` points are left out."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, ys in series.items():
        pts = [(a, b) for a, b in zip(x, ys, strict=True) if b is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    if floor is not None:
        ax.axhline(floor, color="grey", linestyle=":", label=floor_label)
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_xticks(list(x), [str(int(v)) for v in x])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def bars(
    path: Path,
    title: str,
    rows: Sequence[tuple[str, float]],
    *,
    xlabel: str,
    highlight: str = "asyncsync",
) -> None:
    """Horizontal bars, first row on top; rows whose label contains ``highlight`` are
    drawn in the accent colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.2))
    labels = [label for label, _ in rows][::-1]
    values = [value for _, value in rows][::-1]
    colors = ["tab:blue" if highlight in label else "tab:gray" for label in labels]
    ax.barh(labels, values, color=colors)
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.2f}", va="center", fontsize=8)
    ax.set(xlabel=xlabel, title=title)
    ax.set_xlim(0, max(values) * 1.18)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
