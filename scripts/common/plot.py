"""The benchmarks' figures, drawn with matplotlib, an optional extra: `pip install
'ledgerserve[plot]'`. Without it a script still writes its JSON report, and says in one
line how to get the figure.

`render_png(panels)` draws side-by-side panels and returns the PNG bytes:
- `CdfPanel`: empirical CDFs of some series (one line each, with a legend);
- `BarPanel`: one bar per label.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from scripts.common.report_files import write_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
INSTALL_HINT = "matplotlib is not installed: pip install 'ledgerserve[plot]' to draw it"
GREY = "#969696"
BLUE = "#1f77b4"


@dataclass
class CdfPanel:
    title: str
    series: dict[str, list[float]]  # label: values; each becomes one CDF line
    xlabel: str = ""
    log_x: bool = False


@dataclass
class BarPanel:
    title: str
    bars: list[tuple[str, float]]  # (label, value)
    colors: list[str] = field(default_factory=list)  # per bar; default one colour
    value_label: str = ""
    horizontal: bool = False


Panel = CdfPanel | BarPanel


def _draw_cdf(ax, panel: CdfPanel) -> None:
    for label, values in panel.series.items():
        ordered = sorted(values)
        if ordered:  # from 0 at the smallest value: a single value still draws a line
            fractions = [i / len(ordered) for i in range(len(ordered) + 1)]
            ax.step([ordered[0], *ordered], fractions, where="post", label=label)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel("fraction of requests")
    if panel.log_x:
        ax.set_xscale("log")
    if any(panel.series.values()):
        ax.legend(fontsize=7)


def _draw_bars(ax, panel: BarPanel) -> None:
    labels, values = [label for label, _ in panel.bars], [value for _, value in panel.bars]
    colors = panel.colors or [BLUE] * len(values)
    if panel.horizontal:
        ax.barh(labels, values, color=colors)
        ax.invert_yaxis()  # the first bar on top
        ax.set_xlabel(panel.value_label)
        ax.tick_params(axis="y", labelsize=7)
    else:
        ax.bar(labels, values, color=colors)
        ax.set_ylabel(panel.value_label)


def render_png(panels: Sequence[Panel]) -> bytes:
    """The panels side by side, as PNG bytes. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    fig = Figure(figsize=(6 * len(panels), 5))
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        ax.set_title(panel.title)
        if isinstance(panel, CdfPanel):
            _draw_cdf(ax, panel)
        else:
            _draw_bars(ax, panel)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()


def write_png(path: str, panels: Sequence[Panel]) -> bool:
    """Draw the panels into `path`; without matplotlib, say so in one line and return False."""
    try:
        data = render_png(panels)
    except ImportError:
        print(f"no plot written to {path}: {INSTALL_HINT}", file=sys.stderr)
        return False
    write_file(path, data)
    return True
