"""timeline.png: a Gantt chart of a run's last iterations, one row per lane, read in a second:
who was busy (bars, coloured by what they did), who waited (gaps).

    draw(Path("runs/x/timeline.json"), Path("runs/x/timeline.png"), last=3)   # -> the lanes drawn

A span nested in another of its lane (the trainer's `update` inside `train`) is drawn thinner on
top of it; a lane's sub-lanes (`lane #2`, ...: a pool's parallel calls) share its row; `idle` is
light grey; instants (restarts, faults) are red ticks. Time starts at the first span shown.
"""
from __future__ import annotations

from pathlib import Path

from orz.timeline.trace import lanes, load

ROW_INCHES, MARGIN_INCHES, WIDTH_INCHES, DPI = 0.3, 1.6, 13.0, 100


def figure_size(rows: int) -> tuple[int, int]:
    """(width, height) in pixels of a chart of `rows` lanes."""
    return int(WIDTH_INCHES * DPI), int((ROW_INCHES * rows + MARGIN_INCHES) * DPI)


def _depths(spans: list[dict]) -> list[int]:
    """Each span's nesting depth within its lane (spans sorted by start, enclosing first)."""
    depths, open_ends = [], []
    for e in spans:
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(e["ts"] + e["dur"])
    return depths


def draw(timeline: Path, out: Path, last: int = 3) -> list[str]:
    """Writes the chart of the last `last` iterations; returns its rows (lanes), top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load(timeline)
    names = lanes(events)
    shown = sorted({e["args"]["iteration"] for e in events if e["ph"] == "X" and e["args"].get("iteration", -1) >= 0})
    shown = set(shown[-last:])
    spans = [e for e in events if e["ph"] == "X" and e["args"].get("iteration") in shown]
    if not spans:
        raise ValueError(f"{timeline}: no iteration's spans to draw")
    t0, t1 = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    instants = [e for e in events if e["ph"] == "i" and t0 <= e["ts"] <= t1]
    row_of = {ids: lane.split(" #")[0] for ids, lane in names.items()}  # sub-lanes share their lane's row
    labels = sorted({row_of[e["pid"], e["tid"]] for e in spans + instants},
                    key=lambda lane: min(ids for ids, name in row_of.items() if name == lane))
    colours, palette = {"idle": "#e8e8e8"}, plt.get_cmap("tab20").colors
    width, height = figure_size(len(labels))
    fig, ax = plt.subplots(figsize=(width / DPI, height / DPI), dpi=DPI)
    for y, label in enumerate(labels):
        own = sorted((e for e in spans if row_of[e["pid"], e["tid"]] == label), key=lambda e: (e["ts"], -e["dur"]))
        for e, depth in zip(own, _depths(own)):
            name = e["name"].split(" ×")[0]
            colour = colours.setdefault(name, palette[(len(colours) - 1) % len(palette)])
            thick = 0.8 * 0.6**depth
            ax.broken_barh([((e["ts"] - t0) / 1e6, e["dur"] / 1e6)], (y - thick / 2, thick), facecolors=colour,
                           label=name if name not in ax.get_legend_handles_labels()[1] else None)
        for e in instants:
            if row_of[e["pid"], e["tid"]] == label:
                ax.plot([(e["ts"] - t0) / 1e6] * 2, [y - 0.45, y + 0.45], color="red", linewidth=1.5)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel(f"seconds (iterations {min(shown)}–{max(shown)})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.subplots_adjust(left=0.16, right=0.79, top=1 - 0.3 / (height / DPI), bottom=0.9 / (height / DPI))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return labels
