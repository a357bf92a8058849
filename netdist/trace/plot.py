"""A timeline picture of a trace: one lane per rank, its collectives as bars.

Needs matplotlib (``pip install 'netdist[plot]'``), imported only when drawing. The figure
is drawn on its own Agg canvas (no pyplot, so no global figure state and no display).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from netdist.errors import ConfigError
from netdist.trace.analysis import TraceSet, arrivals, collective_calls

__all__ = ["plot_timeline"]

_WIDTH_IN = 12.0
_LANE_IN = 0.45
_DPI = 100


def plot_timeline(trace: TraceSet | Mapping[str, Any], path: str | Path) -> Path:
    """Draw the collectives of ``trace`` (a loaded :class:`TraceSet` or a merged trace
    object) as a PNG at ``path``; returns the path.

    One horizontal lane per rank; each collective call is a bar from the rank's arrival
    to its return, coloured by op; a black tick marks the last arrival of each collective
    (the rank everyone else waited for). Time is in ms from the first event drawn.
    Raises ``ConfigError`` when matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise ConfigError("plotting a trace needs matplotlib: "
                          "pip install 'netdist[plot]'") from exc
    if isinstance(trace, TraceSet):
        events = trace.events()
        ranks = list(range(trace.world_size))
    else:
        events = list(trace.get("traceEvents", []))
        other = trace.get("otherData", {})
        world = other.get("world_size") if isinstance(other, Mapping) else None
        pids = {int(e["pid"]) for e in events if isinstance(e.get("pid"), int)}
        ranks = list(range(world)) if isinstance(world, int) else sorted(pids)
    calls = collective_calls(events)
    t0 = min((c.arrival_us for c in calls), default=0.0)
    ops = sorted({c.op for c in calls})
    palette = [f"C{i % 10}" for i in range(len(ops))]
    colour = dict(zip(ops, palette))

    fig = Figure(figsize=(_WIDTH_IN, 1.2 + _LANE_IN * max(len(ranks), 1)), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for rank in ranks:
        for op in ops:
            bars = [((c.arrival_us - t0) / 1000.0, c.dur_us / 1000.0) for c in calls
                    if c.rank == rank and c.op == op]
            if bars:
                ax.broken_barh(bars, (rank - 0.35, 0.7), facecolors=colour[op],
                               edgecolor="none")
    arrival_of = {(c.group, c.seq, c.rank): c.arrival_us for c in calls}
    marks = [((arrival_of[(a.group, a.seq, a.last_rank)] - t0) / 1000.0, a.last_rank)
             for a in arrivals(calls) if a.last_rank is not None]
    if marks:
        ax.scatter([x for x, _ in marks], [y for _, y in marks], marker="|", s=250,
                   linewidths=1.5, color="black", zorder=3)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, -0.6)  # rank 0 on top
    ax.set_xlabel("time (ms)")
    ax.set_title("collectives per rank (| = last arrival)")
    ax.grid(True, axis="x", alpha=0.3)
    handles: list[Any] = [Patch(facecolor=colour[op], label=op) for op in ops]
    if marks:
        handles.append(Line2D([], [], color="black", marker="|", linestyle="none",
                              markersize=12, label="last arrival"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize="small", frameon=False)
    fig.subplots_adjust(left=0.08, right=0.84, top=0.88,
                        bottom=min(0.35, 0.6 / (1.2 + _LANE_IN * max(len(ranks), 1))))
    out = Path(path)
    fig.savefig(out, format="png")
    return out
