"""The grouped bar chart of seed 003: one group per (model, stage), one bar per backend,
the value on each bar and the contrast above each group::

    plot_comparison(rows, ["paddle", "torch"], "runs/.../chart.png")

A failed side gets no bar but its status written where the bar would stand, so a crash is
visible in the picture, not silently missing.
"""

from __future__ import annotations

import math
from pathlib import Path

from xfw.report import comparison
from xfw.report.compare import ComparisonRow, strip_common, variant_label
from xfw.report.contrast import ONE_RUN, fmt_headline_contrast, fmt_rate

BACKEND_COLORS = {"paddle": "#2f6fdf", "torch": "#ee4c2c"}
"""One colour per backend in every chart (comparisons, sweeps, single-backend runs, nightly trends)."""
_FALLBACK = ["#6a9955", "#b07cc6", "#c0a000", "#8c564b"]


def backend_color(name: str, index: int = 0) -> str:
    return BACKEND_COLORS.get(name, _FALLBACK[index % len(_FALLBACK)])


def _short(key: str) -> str:
    """``parallel.nproc_per_node`` -> ``nproc_per_node``: the section is clear from the value."""
    return key.split(".", 1)[-1]


def chart_labels(rows: list[ComparisonRow]) -> list[str]:
    """One label per group: model and stage (once, when every row shares them), and the sweep point,
    one key per line, where rows differ."""
    variants = strip_common([r.variant for r in rows])
    same = len({(r.model, r.stage) for r in rows}) == 1 and any(variants)
    labels = []
    for r, v in zip(rows, variants):
        point = "\n".join(f"{_short(k)}={val}" for k, val in v.items())
        labels.append(point if same else f"{r.model}\n{r.stage}" + (f"\n{point}" if point else ""))
    return labels


MAX_DRAWN_IPS = 1e15
"""A bar taller than this (a step time of 1e-308 s in hand-edited records) is not drawn: "off scale"."""


def _shown(side) -> bool:
    """A side whose bar is drawn: ok, with a finite ips (and whiskers) a chart's axis can hold."""
    values = [side.ips, side.ips_low, side.ips_high]
    return side.ok and side.ips is not None and all(
        v is None or (math.isfinite(v) and 0 <= v < MAX_DRAWN_IPS) for v in values)


def chart_title(rows: list[ComparisonRow], backends: list[str]) -> str:
    """What the chart compares (xfw.report.comparison.compared): two builds of one framework, two frameworks,
    one backend; and a deliberate difference (a per-backend override) where the sides have one."""
    what = comparison.compared(backends)
    title = {"two frameworks": "Training speed by framework"}.get(what, f"Training speed of {what}")
    deliberate = list(dict.fromkeys(k.removeprefix("override.") for r in rows for k in r.deliberate_by))
    if deliberate:
        title += f", with a deliberate difference: {', '.join(deliberate)}"
    return title


def plot_comparison(rows: list[ComparisonRow], backends: list[str], path: str | Path, *,
                    title: str | None = None) -> Path:
    """Readable for any number of rows: the figure widens with the rows and their labels, labels are
    one key per line (rotated when crowded), a failed side's status is written upright in its slot,
    and repeats draw an error bar from the lowest to the highest ips. ``title``: by default what the
    chart compares (:func:`chart_title`)."""
    title = title or chart_title(rows, backends)
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    path = Path(path)
    width = 0.8 / len(backends)
    labels = chart_labels(rows)
    widest = max((len(line) for label in labels for line in label.split("\n")), default=10)
    slot = max(1.6, 0.075 * widest + 0.5 * len(backends))
    crowded = len(rows) * slot > 24
    fig, ax = plt.subplots(figsize=(min(max(6.0, slot * len(rows) + 2), 26 if crowded else 28), 5.2))
    tallest = max([s.ips_high or s.ips for r in rows for s in r.sides.values() if _shown(s)] or [1.0])
    small = 9 if len(rows) * len(backends) <= 12 else 7
    for i, name in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(rows))]
        sides = [r.sides[name] for r in rows]
        values = [s.ips if _shown(s) else 0.0 for s in sides]
        errors = [[s.ips - s.ips_low if _shown(s) and s.num_repeats > 1 else 0.0 for s in sides],
                  [s.ips_high - s.ips if _shown(s) and s.num_repeats > 1 else 0.0 for s in sides]]
        repeated = any(_shown(s) and s.num_repeats > 1 for s in sides)
        bars = ax.bar(xs, values, width, label=name, color=backend_color(name, i),
                      yerr=errors if repeated else None, capsize=3 if repeated else 0,
                      error_kw={"elinewidth": 1, "ecolor": "#333333"})
        for bar, side, high in zip(bars, sides, errors[1]):
            x = bar.get_x() + bar.get_width() / 2
            if _shown(side):
                ax.text(x, bar.get_height() + high + tallest * 0.01, fmt_rate(side.ips), ha="center", va="bottom",
                        fontsize=small, rotation=90 if crowded else 0)
            else:  # upright in its own slot: two failed sides never write over each other
                ax.text(x, tallest * 0.02, "off scale" if side.ok else side.status, ha="center", va="bottom",
                        rotation=90, fontsize=small,
                        color="#b00020")
    if len(backends) > 1:
        for j, row in enumerate(rows):
            if row.contrast is None:
                continue
            top = max([s.ips_high or s.ips for s in row.sides.values() if _shown(s)] or [0.0])
            # What the table says, its spread (or "one run, no spread") on a line of its own under the figure.
            ax.text(j, top + tallest * (0.16 if crowded else 0.08),
                    fmt_headline_contrast(row, backends).replace(" (", "\n(", 1), ha="center", va="bottom",
                    fontsize=small + 1 if row.contrast is not None else small, fontweight="bold", linespacing=1.1)
    ax.set_xticks(range(len(rows)), labels, rotation=35 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor" if crowded else "default", fontsize=small)
    ax.set_ylabel("Training speed (ips, samples/s)")
    subtitle = f"contrast = ({backends[0]} − {backends[1]}) / {backends[1]}" if len(backends) > 1 else ""
    if any(_shown(s) and s.num_repeats > 1 for r in rows for s in r.sides.values()):
        subtitle += ("\n" if subtitle else "") + "bars: median of the repeats, whiskers: lowest to highest"
    else:
        subtitle += ("\n" if subtitle else "") + f"each bar {ONE_RUN} (--repeat 3 to see it)"
    if len({(r.model, r.stage) for r in rows}) == 1 and any(strip_common([r.variant for r in rows])):
        title += f": {rows[0].model} {rows[0].stage}"  # the labels then show only the sweep point
    ax.set_title(f"{title}\n({comparison.short_name(rows)})\n{subtitle}".strip(), fontsize=10, wrap=True)
    ax.set_ylim(0, tallest * (1.5 if crowded else 1.35))
    ax.legend()
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path, description: str = "") -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120, **({"metadata": {"Description": description}} if description else {}))
    plt.close(fig)
    tmp.replace(path)
    return path


_PART_COLORS = ["#8c8c8c", "#5f9e8f", "#e8a33d", "#d8d8d8", "#b07cc6", "#c0a000"]  # no backend's colour


def _backend_of(label: str) -> str:
    """``paddle step`` / ``paddle@3.2.0`` -> ``paddle``: the framework whose colour a bar takes."""
    return label.split(" ")[0].partition("@")[0]


def plot_breakdown(entries: list[tuple[str, str, dict]], parts: list[str], labels: dict[str, str],
                   path: str | Path, *, subtitle: str = "") -> Path:
    """The step breakdown (``xfw.report.breakdown``): one stacked column per (row, backend), one
    colour per part, in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(entries) + 4.0), 4.6))
    bottoms = [0.0] * len(entries)
    for k, part in enumerate(parts):
        values = [e[2].get(part, 0.0) * 1e3 for e in entries]
        if not any(values):
            continue
        ax.bar(range(len(entries)), values, 0.6, bottom=bottoms, label=labels.get(part, part),
               color=_PART_COLORS[k % len(_PART_COLORS)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for j, top in enumerate(bottoms):
        ax.text(j, top * 1.01, f"{top:.1f} ms", ha="center", va="bottom", fontsize=9)
    crowded = len(entries) >= 5
    ax.set_xticks(range(len(entries)), [f"{label}\n{backend}" for label, backend, _ in entries],
                  rotation=30 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor" if crowded else "default", fontsize=8)
    for tick, (_, backend, _) in zip(ax.get_xticklabels(), entries):
        tick.set_color(backend_color(_backend_of(backend)))  # one colour per backend, as in every chart
    ax.set_ylabel("mean step time (ms)")
    ax.set_title("Where each side's step goes" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.set_ylim(0, max(bottoms or [1.0]) * 1.15 or 1.0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # never over a value
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return _save(fig, Path(path))


UNRELIABLE_MARK = "UNRELIABLE here"
"""What an explain chart says across its top when its page says the explanation is unreliable."""


def plot_waterfall(start: tuple[str, float], steps: list[tuple[str, float]], end: tuple[str, float],
                   path: str | Path, *, title: str, unreliable: str = "") -> Path:
    """A waterfall (``xfw explain``): ``start``'s step time, each part's difference (seconds; red
    adds time, green removes it), ending at ``end``'s step time. ``unreliable`` (why, in a few words) marks
    the chart as the page marks it: :data:`UNRELIABLE_MARK` and why in the title, the parts hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(steps) + 3), 4.6 + (0.5 if unreliable else 0)))
    ax.bar(0, start[1] * 1e3, 0.6, color=backend_color(_backend_of(start[0]), 0))
    level = start[1]
    for j, (_, delta) in enumerate(steps, start=1):
        low = min(level, level + delta)
        ax.bar(j, abs(delta) * 1e3, 0.6, bottom=low * 1e3, color="#d9534f" if delta > 0 else "#5cb85c",
               hatch="//" if unreliable else None, alpha=0.55 if unreliable else 1.0)
        ax.text(j, max(level, level + delta) * 1e3, f"{delta * 1e3:+.2f}", ha="center", va="bottom", fontsize=8)
        level += delta
    ax.bar(len(steps) + 1, end[1] * 1e3, 0.6, color=backend_color(_backend_of(end[0]), 1))
    names = [start[0], *(name for name, _ in steps), end[0]]
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=11)
    if unreliable:
        import textwrap

        ax.set_title(f"{title}\n" + "\n".join(textwrap.wrap(f"{UNRELIABLE_MARK}: {unreliable}; the parts are not "
                                                            "findings (explain.md says why)",
                                                            int(fig.get_figwidth() * 9))),
                     fontsize=10, color="#b00020")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return _save(fig, Path(path), f"{UNRELIABLE_MARK}: {unreliable}" if unreliable else "")
