"""Bar charts of a benchmark run: per shape, the TF/s of every implementation next to ours, one panel per bench.

``python -m benchmarks --plot RUN.jsonl [--plot-out FIG.png]`` draws a run streamed with ``--jsonl`` (those in
``benchmarks/results/`` included). A family of implementations is drawn as one bar at its best: tokamax's swept
configs (``tokamax[...]``) as the fastest of them, since the targets' bar is tokamax tuned. The dense matmul of the same
FLOPs is a bar of its own and the ``hbm-floor`` (the bytes the op must move, at the HBM rate the run measured: the read
rate, or the copy rate in older records) a black tick where it lies below the dense bar (where the op is
memory-bound); our bar is labelled with its TF/s and its ratios to the dense bar and to tokamax's. Benches without a
FLOP model (routing) or with a table of their own (ep) are not drawn.
"""

import dataclasses
import itertools
import math
import os

from benchmarks import common

OURS = ("moe_jax:pallas", "fused:pallas")  # the first of these a row has is "ours"
DENSE, FLOOR = "dense", "hbm-floor"
PEER = "tokamax"  # the families named tokamax* (its grouped matmul, alone or with XLA's glue) are the peer
LEGEND = {  # the benches' implementation names, in words (benchmarks/glu.py and layer.py define them)
    "moe_jax:pallas": "moe_jax, Mosaic GPU kernels",
    "moe_jax:xla": "moe_jax, XLA reference",
    "fused:pallas": "moe_jax, GLU fused into the GEMMs",
    "fused-recompute:pallas": "moe_jax fused, gate_up recomputed in the backward",
    "gemm:pallas": "moe_jax gate_up GEMM alone, no GLU",
    "gemm+xla-glu:pallas": "moe_jax GEMM, then the GLU in XLA",
    "unfused:pallas": "moe_jax GEMMs with XLA elementwise glue",
    "tokamax": "tokamax, its fastest config in the run",
    "tokamax-gemms": "tokamax grouped matmuls + XLA glue",
    "tokamax+xla-glu": "tokamax grouped matmul, then the GLU in XLA",
    "ragged_dot": "jax.lax.ragged_dot",
    DENSE: "dense XLA matmul, same FLOPs",
    FLOOR: "HBM floor: the least bytes at the run's measured HBM rate",
}
UNPLOTTED_BENCHES = ("routing", "ep", "ep-bwd")
BAR_HEIGHT = 0.8  # of a row's height, shared by its bars
# The same colour for a family in every figure; families not named here take the remaining tab10 colours.
COLORS = {
    "moe_jax:pallas": "tab:blue",
    "fused:pallas": "tab:blue",
    "moe_jax:xla": "tab:purple",
    "ragged_dot": "tab:green",
    DENSE: "0.65",
}
OTHER_COLORS = ("tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


@dataclasses.dataclass(frozen=True)
class Row:
    """One shape (and routing) of a bench: the best TF/s of each implementation family, in the run's order."""

    label: str
    tflops: dict[str, float]
    floor_tflops: float | None

    def ours(self) -> str | None:
        return next((family for family in OURS if family in self.tflops), None)

    def binding_floor(self) -> float | None:
        """The HBM floor where it binds, below the dense bar; above it the op is compute-bound and the floor would
        only stretch the axis."""
        if self.floor_tflops and self.floor_tflops < self.tflops.get(DENSE, math.inf):
            return self.floor_tflops
        return None

    def annotation(self) -> str:
        """Our TF/s and its ratios to the dense matmul and to the fastest tokamax family ("" without ours)."""
        ours = self.ours()
        if ours is None:
            return ""
        value = self.tflops[ours]
        text = f" {value:.0f} TF/s"
        if DENSE in self.tflops:
            text += f" = {value / self.tflops[DENSE]:.2f}x dense"
        peers = [tflops for name, tflops in self.tflops.items() if name.startswith(PEER)]
        if peers:
            text += f", {value / max(peers):.2f}x tokamax"
        return text


def family(impl: str) -> str:
    """The implementation a record belongs to: a swept config, "tokamax[128x64x128 s4 ...]", to "tokamax"."""
    return impl.split("[")[0]


def bench_rows(records: list[common.Record], bench: str) -> list[Row]:
    """The rows of one bench: one per (shape, routing) that timed anything but the references.

    The references (dense, hbm-floor) are recorded once per shape (routing "-" in gmm) and shared by its routings.
    """
    timed = [r for r in records if r.bench == bench and r.tflops]
    references = {(r.shape, r.impl): r.tflops for r in timed if r.impl in (DENSE, FLOOR)}
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for r in timed:
        if r.impl == FLOOR or (r.impl == DENSE and r.routing == "-"):
            continue
        best = rows.setdefault((r.shape, r.routing), {})
        best[family(r.impl)] = max(best.get(family(r.impl), 0.0), r.tflops)
    routings = {routing for _, routing in rows}
    result = []
    for (shape, routing), best in rows.items():
        if DENSE not in best and (shape, DENSE) in references:
            best[DENSE] = references[(shape, DENSE)]
        label = shape if len(routings) == 1 else f"{shape} ({routing})"
        result.append(Row(label, best, references.get((shape, FLOOR))))
    return result


def figure(meta: dict, records: list[common.Record], titles: dict[str, str]):
    """A matplotlib Figure with one horizontal bar chart per plotted bench of the run, in the order of ``titles``
    (bench -> panel title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (bench, rows) for bench in titles if bench not in UNPLOTTED_BENCHES and (rows := bench_rows(records, bench))
    ]
    if not panels:
        raise SystemExit("nothing to plot: the run has no timed records of a bench with a FLOP model")
    families = list(dict.fromkeys(f for _, rows in panels for row in rows for f in row.tflops))
    colors = _colors(families)
    heights = [len(rows) * (0.35 + 0.22 * len({f for row in rows for f in row.tflops})) + 1.2 for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(13, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    timer = {r.timing.timer for r in records if r.timing is not None}
    fig.suptitle(
        f"{meta['device_kind']}, git {meta['git_revision']}, {meta['date'][:10]}, "
        f"{'GPU kernel time' if timer == {'device'} else 'wall clock'}: TF/s (FLOP model of benchmarks/common.py)",
        fontsize=10,
    )
    for ax, (bench, rows) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, titles[bench], rows, colors)
    fig.tight_layout()
    return fig


def _colors(families: list[str]) -> dict[str, str]:
    """Fixed colours for the families in COLORS, orange for tokamax's, the rest in turn."""
    others = itertools.cycle(OTHER_COLORS)
    return {
        f: COLORS.get(f) or ("tab:orange" if f.startswith(PEER) else next(others))
        for f in sorted(families, key=_draw_order)
    }


def _draw_order(name: str) -> tuple[int, str]:
    """Ours first, the dense reference last, the others by name."""
    return (0 if name in OURS else 2 if name == DENSE else 1, name)


def _draw_panel(ax, title: str, rows: list[Row], colors: dict) -> None:
    for y, row in enumerate(rows):
        present = sorted(row.tflops, key=_draw_order)
        height = BAR_HEIGHT / len(present)
        for i, name in enumerate(present):
            center = y - BAR_HEIGHT / 2 + (i + 0.5) * height
            value = row.tflops[name]
            ax.barh(center, value, height=height, color=colors[name], label=LEGEND.get(name, name))
            if name == row.ours():
                ax.annotate(row.annotation(), (value, center), va="center", fontsize=7)
            else:  # a bar's own value, so that one too short to see still says what it is
                ax.annotate(f" {value:.3g}", (value, center), va="center", fontsize=6, color="0.35")
        floor = row.binding_floor()
        if floor:
            ax.plot([floor] * 2, [y - 0.45, y + 0.45], color="black", linewidth=1.5, label=LEGEND[FLOOR])
    # Room right of the longest bar for our label.
    ax.set_xlim(0, 1.4 * max(max(row.tflops.values()) for row in rows))
    ax.set_yticks(range(len(rows)), [row.label for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("TF/s")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    # One legend entry per name, in drawing order.
    handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    ax.legend(handles.values(), handles.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def plot_run(path: str, titles: dict[str, str], out: str | None = None) -> list[common.Record]:
    """Draws the run streamed to ``path`` (JSONL) into ``out`` (default: the same name with .png); returns its
    records."""
    meta, records = common.read_run(path)
    out = out or os.path.splitext(path)[0] + ".png"
    figure(meta, records, titles).savefig(out, dpi=110)
    print(f"wrote {out}")
    return records
