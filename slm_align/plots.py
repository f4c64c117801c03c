"""PNG plots of training curves from a metrics JSONL file (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = ("reward/mean", "watchdog/probe_reward", "kl", "entropy", "clip_frac", "ratio/mean",
          "completion/length", "guard/skipped", "guard/rollbacks")


def plot_curves(metrics_path: Path, out_path: Path, keys=CURVES, events=()) -> Path:
    """One panel per metric over steps, saved as a PNG; each watchdog event (a dict with ``step``
    and ``detector``, see envelope/watchdog.py) is a dashed vertical line on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line)
            for line in Path(metrics_path).read_text(encoding="utf-8").splitlines() if line]
    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    cols = 4
    fig, axes = plt.subplots((len(keys) + cols - 1) // cols, cols,
                             figsize=(4 * cols, 3 * ((len(keys) + cols - 1) // cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot(*zip(*points), marker=".")
        ax.set_title(key)
        for event in events:
            ax.axvline(event["step"], color="red", linestyle="--", linewidth=1,
                       label=event["detector"])
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=80)
    plt.close(fig)
    return out_path
