"""The serving-path profile's timeline picture: 40 ms from the middle of one pass, one lane per
process — the device's steps (rank 0), the worker's launches and replies, the scheduler's inputs
(apply, commit, send, views) and the HTTP process's reads of the scheduler's frames. Drawn with
matplotlib (`pip install 'ledgerserve[plot]'`); without it, one line says how to get it."""

from __future__ import annotations

import io
import sys

from scripts.common.plot import INSTALL_HINT
from scripts.common.report_files import write_file
from scripts.serving.profile_report import MS, Spans

WIDTH_NS = 40_000_000
LANES = ("http", "scheduler", "worker host", "device")
COLORS = {"device": "#1f77b4", "launch": "#2ca02c", "reply": "#98df8a", "apply": "#ff7f0e", "commit": "#d62728"}
COLORS |= {"send": "#9467bd", "views": "#8c564b", "http": "#e377c2"}


def bars(sp: Spans, start_ns: int, end_ns: int) -> list[tuple[str, str, int, int]]:
    """(lane, kind, start, end) of everything that overlaps [start_ns, end_ns)."""
    out: list[tuple[str, str, int, int]] = []
    for s in sp.steps:
        out += [("device", "device", s.gpu_start_ns, s.gpu_end_ns), ("worker host", "launch", s.recv_ns, s.launched_ns)]
        out.append(("worker host", "reply", s.done_ns, s.sent_ns))
    for i in sp.inputs:
        marks = (i.recv_ns, i.applied_ns, i.synced_ns, i.sent_ns, i.end_ns)
        out += [("scheduler", kind, a, b) for kind, a, b in zip(("apply", "commit", "send", "views"), marks, marks[1:])]
    out += [("http", "http", o.recv_ns, o.handled_ns) for o in sp.outputs]
    return [b for b in out if b[3] > start_ns and b[2] < end_ns]


def timeline(sp: Spans, window_ns: list[int], path: str, title: str) -> None:
    middle = (window_ns[0] + window_ns[1]) // 2
    start_ns = middle - WIDTH_NS // 2
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"profile_serving: {INSTALL_HINT}", file=sys.stderr)
        return
    fig = Figure(figsize=(14, 3.5))
    ax = fig.subplots()
    for lane, kind, a, b in bars(sp, start_ns, start_ns + WIDTH_NS):
        y = LANES.index(lane)
        extent = [((a - start_ns) / MS, max(b - a, 1000) / MS)]
        ax.broken_barh(extent, (y - 0.35, 0.7), color=COLORS[kind], edgecolor="white", linewidth=0.6)  # steps apart
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_xlim(0, WIDTH_NS / MS)
    ax.set_xlabel("ms")
    ax.set_title(f"serving path, {title}", fontsize=9)
    handles = [ax.bar(0, 0, color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, fontsize=7, ncol=len(COLORS), loc="upper right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_file(path, buf.getvalue())
