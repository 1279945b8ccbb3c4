"""Where a run's numbers go: a JSONL file (one line per iteration, every figure), the trackers
(orz.ppo.trackers: TensorBoard, W&B, MLflow), and at the end a PNG of the curves people look at
first (reward, accuracy, held-out accuracy).

    logger = MetricsLogger("runs/x", trackers=[TensorBoard(Path("runs/x"))])
    logger.log(step, {"reward/accuracy": 0.4, ...})
    logger.close()            # writes runs/x/curves.png
"""
import json
import math
from pathlib import Path

PLOTTED = (  # (panel title, metric keys drawn in it)
    ("training reward", ("reward/mean", "reward/accuracy")),
    ("held-out accuracy", ("eval/accuracy_greedy", "eval/avg_at_k")),  # greedy; sampled avg@k
    ("response length", ("response/length_mean",)),
    ("policy", ("actor/entropy", "actor/approx_kl", "actor/clip_frac")),
)


class MetricsLogger:
    def __init__(self, out_dir: str | Path, trackers: list = (), resume_from_step: int = -1):
        """resume_from_step: a resumed run keeps the file's lines up to its checkpoint's step, byte
        for byte; the later ones belong to iterations that will run again (and a line a killed run
        left unfinished, without its newline, to one that will). A new run (-1) starts an empty file."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if self.path.exists():
            finished = self.path.read_text().split("\n")[:-1]  # after the last newline: "" or an unfinished line
            kept = [line for line in finished if json.loads(line)["step"] <= resume_from_step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        self.trackers = list(trackers)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for tracker in self.trackers:
            tracker.log(step, clean)

    def history(self) -> list[dict]:
        return history(self.path)

    def plot(self) -> Path | None:
        return plot_curves(self.dir)

    def close(self, plot: bool = True) -> Path | None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        return self.plot() if plot else None


def history(path: Path) -> list[dict]:
    """metrics.jsonl's rows (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def plot_curves(out_dir: Path) -> Path | None:
    """out_dir/curves.png from out_dir/metrics.jsonl: one panel per group of PLOTTED that has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = history(Path(out_dir) / "metrics.jsonl")
    panels = [(title, [k for k in keys if any(k in r for r in rows)]) for title, keys in PLOTTED]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
