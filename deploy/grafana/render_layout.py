"""Draw the panel grid of the Grafana dashboard (titles, types, metrics) to a PNG.

A layout render from the JSON, not a screenshot: no Grafana and no data are involved.

    python deploy/grafana/render_layout.py [dashboard.json] [out.png]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

HERE = Path(__file__).resolve().parent
COLORS = {"timeseries": "#dbe9f6", "stat": "#e3f3df", "table": "#f6efdb"}


def render(dashboard: Path, out: Path) -> None:
    dash = json.loads(dashboard.read_text())
    panels = dash["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig, ax = plt.subplots(figsize=(16, 16 * height / 24 * 0.42))
    ax.set_xlim(0, 24)
    ax.set_ylim(height + 1.6, 0)
    ax.axis("off")
    ax.text(
        0,
        0.2,
        f"{dash['title']} — layout render of {dashboard.name} (not a screenshot: panel grid, "
        "titles and queried metrics from the JSON)",
        fontsize=11,
        weight="bold",
        va="top",
    )
    for p in panels:
        g = p["gridPos"]
        x, y, w, h = g["x"], g["y"] + 1.2, g["w"], g["h"]
        if p["type"] == "row":
            ax.add_patch(FancyBboxPatch((x, y + 0.15), w, h - 0.3, boxstyle="round,pad=0.02", fc="#4a5a6a"))
            ax.text(x + 0.2, y + h / 2, p["title"], color="white", fontsize=10, weight="bold", va="center")
            continue
        ax.add_patch(
            FancyBboxPatch(
                (x + 0.08, y + 0.08),
                w - 0.16,
                h - 0.16,
                boxstyle="round,pad=0.02",
                fc=COLORS.get(p["type"], "#eeeeee"),
                ec="#7a8a9a",
                lw=0.8,
            )
        )
        ax.text(x + 0.3, y + 0.55, p["title"], fontsize=8.5, weight="bold", va="top")
        metrics = sorted({m for t in p["targets"] for m in re.findall(r"\b(visenc_[a-z0-9_]+|up)\b", t["expr"])})
        exprs = " ".join(t["expr"] for t in p["targets"])
        quantiles = sorted({float(q) for q in re.findall(r"histogram_quantile\(([\d.]+)", exprs)})
        kinds = " · ".join(f"p{q * 100:g}" for q in quantiles)
        lines = [p["type"] + (f"  ({kinds})" if kinds else ""), *metrics]
        ax.text(
            x + 0.3,
            y + 1.25,
            "\n".join(lines[: max(1, int(h * 1.6) - 2)]),
            fontsize=6.5,
            va="top",
            family="monospace",
            color="#333333",
        )
    fig.savefig(out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    args = sys.argv[1:]
    render(
        Path(args[0]) if args else HERE / "dashboards" / "visenc.json",
        Path(args[1]) if len(args) > 1 else HERE.parent.parent / "docs" / "dashboard.png",
    )
