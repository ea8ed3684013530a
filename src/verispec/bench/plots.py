"""The matrix's pictures: a speedup heatmap over the cells (aggregate tok/s over
verispec's none cell, per model), and per-cell bars of every arm and peer."""

from __future__ import annotations

from pathlib import Path


def _label(col) -> str:
    return f"{col[0]}\n{col[1]}{'+g' if col[2] else ''}"


def _per_model(result: dict, out: Path, kind: str, draw) -> list[Path]:
    """For each model with measured cells: draw(ax_factory, cols, arms, by) on a new figure,
    saved as out/KIND-MODEL.png. `by` maps (arm, lane, workload, grammar) to the row."""
    from verispec.bench.matrix import LANES, slug
    from verispec.plots import pyplot

    plt = pyplot()
    written = []
    for model in result["models"]:
        rows = [r for r in result["rows"] if r["model"] == model and "agg_tok_s" in r]
        if not rows:
            continue
        cols = sorted({(r["lane"], r["workload"], r["grammar"]) for r in rows},
                      key=lambda c: (list(LANES).index(c[0]), c[1], c[2]))
        arms = list(dict.fromkeys(r["arm"] for r in rows))
        by = {(r["arm"], r["lane"], r["workload"], r["grammar"]): r for r in rows}
        fig = draw(plt, model, cols, arms, by)
        fig.tight_layout()
        path = out / f"{kind}-{slug(model)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def heatmap(result: dict, out: Path) -> list[Path]:
    def draw(plt, model, cols, arms, by):
        grid = [[(by.get((a, *c)) or {}).get("vs_none") for c in cols] for a in arms]
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cols)), 0.6 * len(arms) + 2))
        values = [[v if v is not None else float("nan") for v in row] for row in grid]
        image = ax.imshow(values, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(cols)), [_label(c) for c in cols], fontsize=7)
        ax.set_yticks(range(len(arms)), arms, fontsize=8)
        ax.set_title(f"{model}: aggregate tok/s vs verispec without speculation (same lane, workload, grammar)",
                     fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
        return fig

    return _per_model(result, out, "heatmap", draw)


def bars(result: dict, out: Path) -> list[Path]:
    def draw(plt, model, cols, arms, by):
        fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(cols)), 4.5))
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(cols))]
            ax.bar(xs, [(by.get((arm, *c)) or {}).get("agg_tok_s", 0) for c in cols], width, label=arm)
        ax.set_xticks(range(len(cols)), [_label(c) for c in cols], fontsize=7)
        ax.set_ylabel("aggregate tok/s (median)")
        ax.set_title(f"{model}: every arm and peer per cell", fontsize=9)
        ax.legend(fontsize=7, ncols=min(4, len(arms)))
        return fig

    return _per_model(result, out, "bars", draw)
