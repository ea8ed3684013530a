"""The matrix's pictures: a speedup heatmap over the cells (aggregate tok/s over
verispec's none cell, per model), and per-lane bars of every arm and peer per workload."""

from __future__ import annotations

from pathlib import Path


def _rows(result: dict, model: str) -> list[dict]:
    return [r for r in result["rows"] if r["model"] == model and "agg_tok_s" in r]


def _columns(rows: list[dict]) -> list[tuple[str, str, bool]]:
    from verispec.bench.matrix import LANES

    cols = {(r["lane"], r["workload"], r["grammar"]) for r in rows}
    return sorted(cols, key=lambda c: (list(LANES).index(c[0]), c[1], c[2]))


def _label(col) -> str:
    return f"{col[0]}\n{col[1]}{'+g' if col[2] else ''}"


def heatmap(result: dict, out: Path) -> list[Path]:
    from verispec.bench.matrix import slug
    from verispec.plots import pyplot

    plt = pyplot()
    written = []
    for model in result["models"]:
        rows = _rows(result, model)
        if not rows:
            continue
        cols = _columns(rows)
        arms = list(dict.fromkeys(r["arm"] for r in rows))
        by = {(r["arm"], r["lane"], r["workload"], r["grammar"]): r.get("vs_none") for r in rows}
        grid = [[by.get((a, *c)) for c in cols] for a in arms]
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
        fig.tight_layout()
        path = out / f"heatmap-{slug(model)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def bars(result: dict, out: Path) -> list[Path]:
    from verispec.bench.matrix import slug
    from verispec.plots import pyplot

    plt = pyplot()
    written = []
    for model in result["models"]:
        rows = _rows(result, model)
        if not rows:
            continue
        cols = _columns(rows)
        arms = list(dict.fromkeys(r["arm"] for r in rows))
        by = {(r["arm"], r["lane"], r["workload"], r["grammar"]): r["agg_tok_s"] for r in rows}
        fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(cols)), 4.5))
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(cols))]
            ax.bar(xs, [by.get((arm, *c), 0) for c in cols], width, label=arm)
        ax.set_xticks(range(len(cols)), [_label(c) for c in cols], fontsize=7)
        ax.set_ylabel("aggregate tok/s (median)")
        ax.set_title(f"{model}: every arm and peer per cell", fontsize=9)
        ax.legend(fontsize=7, ncols=min(4, len(arms)))
        fig.tight_layout()
        path = out / f"bars-{slug(model)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
