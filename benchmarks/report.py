"""What every benchmark prints and draws: fixed-width tables, bar and line charts, percentiles.

One place for the padding and the matplotlib set-up, so each benchmark says only which
columns it has and what it plots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column: header, width, alignment, and how a number is written.

    ``fmt`` (a format spec such as ``".1f"``) applies to numbers only; strings are padded as
    they are and ``None`` leaves the cell blank. ``suffix`` follows the number inside the width
    (``"x"`` for ratios). ``gap`` overrides the table's separator before this column.
    """

    header: str
    width: int = 0
    align: str = ">"
    fmt: str = ""
    suffix: str = ""
    gap: str | None = None

    def head(self) -> str:
        """The padded header."""
        return f"{self.header:{self.align}{self.width}}"

    def cell(self, value: object) -> str:
        """The padded cell of ``value``."""
        if value is None:
            return " " * self.width
        if isinstance(value, str):
            return f"{value:{self.align}{self.width}}"
        text = f"{value:{self.align}{max(0, self.width - len(self.suffix))}{self.fmt}}"
        return text + self.suffix


def render_table(columns: Sequence[Column], rows: Iterable[Sequence[object]], *, sep: str = " ") -> list[str]:
    """The header line and one line per row (the caller adds notes and joins)."""

    def line(cells: Sequence[str]) -> str:
        out = ""
        for index, (column, text) in enumerate(zip(columns, cells, strict=True)):
            if index:
                out += sep if column.gap is None else column.gap
            out += text
        return out

    lines = [line([c.head() for c in columns])]
    lines += [line([c.cell(v) for c, v in zip(columns, row, strict=True)]) for row in rows]
    return lines


def percentile(values: Iterable[float], q: float, *, nearest_rank: bool = False) -> float:
    """The ``q``-th percentile (0-100) of ``values``; NaN when there are none.

    Linear interpolation between ranks (numpy's default, and ``statistics.median`` at 50)
    unless ``nearest_rank``: then the smallest value with at least ``q`` % of the values at or
    below it.
    """
    data = list(values)
    if not data:
        return math.nan
    if nearest_rank:
        ordered = sorted(data)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
    return float(np.percentile(np.asarray(data, dtype=float), q))


def latency_ms(seconds: Sequence[float]) -> dict[str, float]:
    """``p50_ms``, ``p99_ms`` and ``max_ms`` of latencies given in seconds (NaN when empty)."""
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms, default=math.nan)}


def _figure(size: tuple[float, float]) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bar_chart(
    path: Path, names: Sequence[str], values: Sequence[float], *, ylabel: str, title: str, size: tuple[float, float]
) -> None:
    """One bar per name (a non-finite value draws as 0), written as a PNG."""
    fig, ax = _figure(size)
    ax.bar(list(names), [v if math.isfinite(v) else 0.0 for v in values], color="#4477aa")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _save(fig, path)


def line_chart(
    path: Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    size: tuple[float, float],
    log_x_base: float | None = None,
    log_y: bool = False,
) -> None:
    """One line with markers per series of (x, y) points (non-finite y dropped), written as a PNG."""
    fig, ax = _figure(size)
    for label, points in series.items():
        finite = [p for p in points if math.isfinite(p[1])]
        ax.plot([p[0] for p in finite], [p[1] for p in finite], marker="o", label=label)
    if log_x_base is not None:
        ax.set_xscale("log", base=log_x_base)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    _save(fig, path)
