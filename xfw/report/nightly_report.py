"""The nightly report: one self-contained HTML file (images inlined, no script, no network).

Top to bottom: the regressions (or a line saying there are none), failed runs, the night's
contrast table (seed 003) and bar chart, each converge entry's answer (its headline and chart),
every (entry, backend) against its baseline, a trend plot per entry (throughput, peak memory and, on
GPUs, MFU over the nights; a converge entry's final eval loss; one line per backend, flagged points
circled in red), and the environment of each night::

    path = write_night_report(Path("/data/xfw-nightly"), "2026-11-22", suite_name="h800-nightly")
    # /data/xfw-nightly/nights/2026-11-22/{report.html, report.md, chart.png, trend-*.png}
    # /data/xfw-nightly/report.html  (the same page: the latest night)
"""

from __future__ import annotations

import json
from pathlib import Path

from xfw.contract.atomic import UnreadableFile, read_json_object, write_text_atomic
from xfw.report import compare as cmp
from xfw.report import comparison, contrast, selfcheck
from xfw.report.trust import short_windows
from xfw.report.converge import CONVERGE_FILE, ConvergeReport
from xfw.report.history import NIGHTS_DIR, History, night_order
from xfw.report.plot import backend_color, plot_comparison
from xfw.report.nodes import load_runs
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Table, to_html, to_markdown
from xfw.report.readback import CONVERGE, read_checked
from xfw.report.verdicts import Verdict, load_verdicts, memory_of, memory_source_of, read_night_verdicts

TREND_NIGHTS = 30
"""Nights shown in each trend plot (the most recent)."""
QUALITY_METRICS = {"eval_loss": "final eval loss", "separation": "vs the other side tonight",
                   "curves": "seed runs"}
"""How the verdict table names a converge entry's quality verdicts."""


def _fmt_value(v: Verdict, value: float | None) -> str:
    if value is None:
        return "–"
    if v.metric == "ips":
        return contrast.fmt_rate(value)
    if v.kind == "quality":
        return f"{value:.4g}"
    source = contrast.SOURCE_LABELS.get(v.mem_source, v.mem_source)
    return f"{value / 2**20:.1f} MiB" + (f" ({source})" if source else "")


def verdict_table(verdicts: list[Verdict]) -> Table:
    header = ["Entry", "Backend", "Metric", "Value", "Baseline", "Nights", "Change", "Tolerance", "Verdict", "Note"]
    cells, classes = [], []
    for v in verdicts:
        metric = v.metric if v.kind != "quality" else f"quality: {QUALITY_METRICS.get(v.metric, v.metric)}"
        cells.append([v.entry, v.backend, metric, _fmt_value(v, v.value), _fmt_value(v, v.baseline),
                      str(v.baseline_nights) if v.baseline is not None else "–",
                      f"{v.change:+.1%}" if v.change is not None else "–",
                      f"±{v.tolerance:.1%}" if v.tolerance is not None else "–", v.verdict, v.note])
        classes.append("regression" if v.flagged else "improvement" if v.verdict == "improvement" else "")
    return Table(header=header, cells=cells, numeric=(3, 4, 6, 7), row_classes=classes, name="verdicts",
                 records=[{k: getattr(v, k) for k in ("entry", "backend", "metric", "verdict", "value", "baseline",
                                                      "change", "tolerance")} for v in verdicts])


def trend_plot(rows: list[dict], entry: str, nights: list[str], flagged: set[tuple[str, str, str]],
               path: Path) -> Path:
    """Throughput and peak memory of one entry over ``nights``, a line per backend; MFU beside them
    when any night has one (GPU runs: ``xfw.report.mfu``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({r["backend"] for r in rows if r["entry"] == entry})
    latest = latest_memory_sources(rows, backends)
    metrics = [("ips", "ips (samples/s)", 1), ("memory", memory_label(latest), 2**20)]
    if any(r.get("mfu") is not None for r in rows if r["entry"] == entry):
        metrics.append(("mfu", "MFU (%, model FLOPs)", 0.01))
    if any(r.get("final_eval_loss") is not None for r in rows if r["entry"] == entry):  # a converge entry
        metrics.append(("eval_loss", "final eval loss (mean of seeds)", 1))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 3.4))
    xs = list(range(len(nights)))
    for i, backend in enumerate(backends):
        color = backend_color(backend, i)  # the same colour as in every other chart
        for ax, (metric, _, scale) in zip(axes, metrics):
            points = []
            for x, night in zip(xs, nights):
                ok = [r for r in rows if r["night"] == night and r["entry"] == entry and r["backend"] == backend
                      and (r["status"] == "ok" or metric == "eval_loss")  # the curves ran whatever the speed run did
                      and (metric != "memory" or memory_source_of(r) == latest[backend])]
                values = [v for v in (_metric(r, metric) for r in ok) if v is not None]
                if values:
                    points.append((x, sorted(values)[len(values) // 2] / scale, night))
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color, label=backend)
            bad = [p for p in points if (p[2], backend, metric) in flagged]
            if bad:
                ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=160, facecolors="none",
                           edgecolors="#b00020", linewidths=2.2, zorder=5)
    for ax, (metric, label, _) in zip(axes, metrics):
        ax.set_xticks(xs, nights, rotation=30 if len(nights) > 4 else 0, ha="right" if len(nights) > 4 else "center",
                      fontsize=8)
        ax.set_ylabel(label)
        if metric != "eval_loss":
            ax.set_ylim(bottom=0)
        else:  # a loss is read by its changes, not from zero; at least ±5% shown, so rounding looks flat
            low, high = ax.get_ylim() if ax.lines else (0.0, 1.0)
            mid, half = (low + high) / 2, max((high - low) / 2, 0.05 * abs((low + high) / 2))
            ax.set_ylim(mid - half, mid + half)
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="y", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # no line at all when every run failed
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{entry}: {', '.join(m[1].split(' (')[0] if m[0] in ('memory', 'eval_loss') else m[0] for m in metrics)}"
                 " per night",
                 fontsize=11)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _metric(row: dict, metric: str) -> float | None:
    if metric == "eval_loss":
        return row.get("final_eval_loss")
    return row["ips"] if metric == "ips" else memory_of(row) if metric == "memory" else row.get("mfu")


def latest_memory_sources(rows: list[dict], backends: list[str]) -> dict[str, str | None]:
    """Each backend's memory source on its latest night: the trend draws only nights measured the
    same way (a history from before the shared measure holds Paddle's host allocator figure)."""
    return {b: next((memory_source_of(r) for r in reversed(rows) if r["backend"] == b and memory_source_of(r)), None)
            for b in backends}


def memory_label(sources: dict[str, str | None]) -> str:
    """The memory axis's label: the shared measure (``verdicts.memory_of``), each backend's source
    named where they differ."""
    shown = {v for v in sources.values() if v}
    label = "training memory (MiB)" if shown == {"rss_training"} else "peak memory (MiB)"
    if len(shown) > 1:
        label += "\n" + ", ".join(f"{b}: {v.replace('_', ' ')}" for b, v in sources.items() if v)
    return label


def _night_states(history_dir: Path, nights: list[str]) -> list[dict]:
    states = []
    for night in nights:
        try:
            states.append(read_json_object(history_dir / NIGHTS_DIR / night / "night.json") or {"night": night})
        except (OSError, ValueError):
            states.append({"night": night})
    return states


def _overrides(state: dict) -> str:
    """The suite's own ``set``, each entry's own ``set`` and the command line's ``--set`` for the night."""
    parts = [f"suite: {' '.join(state['suite_overrides'])}"] if state.get("suite_overrides") else []
    parts += [f"entry {label}: {' '.join(values)}" for label, values in (state.get("entry_overrides") or {}).items()]
    parts += [f"--set {' '.join(state['overrides'])}"] if state.get("overrides") else []
    return "; ".join(parts) or "–"


def environment_table(states: list[dict], rows: list[dict]) -> Table:
    header = ["Night", "Started (UTC)", "Host", "Device", "Frameworks", "Python", "xfw commit", "Overrides"]
    cells = []
    for state in states:
        night = state.get("night", "?")
        env = state.get("env", {})
        devices = sorted({r.get("device_name") or "?" for r in rows if r["night"] == night and r.get("device_name")})
        frameworks = ", ".join(f"{name} {d.get('framework_version', '?')}"
                               for name, d in sorted(state.get("backends", {}).items()))
        sha = env.get("xfw_git_sha") or "–"
        cells.append([night, state.get("started_utc", "–"), env.get("host", {}).get("hostname", "–"),
                      ", ".join(devices) or "–", frameworks or "–", env.get("python", "–"),
                      sha[:12] + ("-dirty" if sha.endswith("-dirty") else ""),
                      _overrides(state)])
    return Table(header=header, cells=cells, name="env")


def converge_dirs(night_dir: Path) -> list[Path]:
    """The night's converge entries' directories (``xfw converge``'s layout: ``speed/``, ``seed-<s>/``)."""
    return [d for d in sorted(night_dir.iterdir()) if d.is_dir() and ((d / CONVERGE_FILE).is_file()
                                                                      or (d / "speed").is_dir())]


def night_runs(night_dir: Path) -> list:
    """The night's speed runs: each ordinary entry's runs and each converge entry's speed runs. The
    selfcheck's runs are the machine's checks, and a converge entry's learning curves (no warm-up, every
    step synchronised) and exported starts are its quality answer, not the night's speed numbers."""
    converging = set(converge_dirs(night_dir))
    paths = [d / "speed" if d in converging else d for d in sorted(night_dir.iterdir())
             if d.is_dir() and d.name != selfcheck.NIGHT_DIR]
    return load_runs([d for d in paths if d.is_dir()])


def converge_blocks(history_dir: Path, night_dir: Path, verdicts: list[Verdict]) -> list:
    """Each converge entry's answer tonight: its headline (speed at equal quality, the final eval loss
    verdict between the sides), its quality verdicts against the previous nights, its chart."""
    blocks: list = []
    for d in converge_dirs(night_dir):
        blocks.append(Heading(f"Converge: {d.name}", 3))
        try:  # checked against its shape first: a hand-edited file is one line here, never a crash
            data = read_checked(d / CONVERGE_FILE, CONVERGE)
            if not data:
                raise FileNotFoundError(f"{d / CONVERGE_FILE}: no convergence report")
            report = ConvergeReport.from_dict(data)
        except (OSError, ValueError, UnreadableFile, KeyError, TypeError) as err:
            blocks.append(Paragraph(f"No convergence report in {d}: {str(err)[:300]}"))
            continue
        quality = [v for v in verdicts if v.entry == d.name and v.kind == "quality"]
        blocks.append(Bullets(report.headline))
        if quality:
            blocks.append(Bullets([v.line().removeprefix("quality: ") + f" — {v.verdict}" for v in quality],
                                  box="bad" if any(v.flagged for v in quality) else "good",
                                  title=f"Quality against the previous nights and between the sides: "
                                        f"{sum(v.flagged for v in quality)} flagged"))
        if (d / "converge.png").is_file():
            blocks.append(Image(d / "converge.png", f"eval loss per eval point of {d.name}, both sides"))
        blocks.append(Paragraph(f"Every eval point, the time to target and the seeds' runs: "
                                f"{d.resolve().relative_to(history_dir.resolve())}/converge.html (or .md, .csv) "
                                "under the history directory.", muted=True))
    if blocks:
        blocks.insert(0, Heading("Quality: converge entries"))
    return blocks


def regressions_box(verdicts: list[Verdict]) -> Bullets:
    """The page's first block: the regressions; a green "No regressions" only where something was compared
    (a first night, where every verdict has no earlier night, says that nothing was)."""
    flagged = [v for v in verdicts if v.flagged]
    compared = [v for v in verdicts if v.baseline is not None]
    if flagged:
        return Bullets([v.line() for v in flagged], box="bad", name="regressions",
                       title=f"{len(flagged)} regression(s) or failure(s)")
    if not compared:  # a first night (or a changed workload): nothing to hold tonight against
        return Bullets([], name="regressions",
                       title=f"Nothing compared: none of tonight's {len(verdicts)} verdicts had an earlier night of "
                             "the same workload to compare with (a first night, or the workloads changed), so no "
                             "regression could be found or ruled out.")
    uncompared = len(verdicts) - len(compared)
    return Bullets([], box="good", name="regressions",
                   title=f"No regressions against the previous nights ({len(compared)} of {len(verdicts)} verdicts "
                         "compared" + (f"; {uncompared} had no earlier night to compare with" if uncompared else "")
                         + ").")


def night_page(history_dir: Path, night: str, *, suite_name: str) -> Page:
    """The night's page (plots written into the night's directory on the way)."""
    night_dir = history_dir / NIGHTS_DIR / night
    rows = History(history_dir).rows()
    order = night_order(rows)
    shown = order[:order.index(night) + 1][-TREND_NIGHTS:] if night in order else [night]
    verdicts = load_verdicts(night_dir)
    flagged = [v for v in verdicts if v.flagged]
    results = night_runs(night_dir)
    backends = cmp.backends_in(results)
    cmp_rows = cmp.compare_runs(results, backends)
    chart = plot_comparison(cmp_rows, backends, night_dir / "chart.png", title=f"Training speed, night {night}")
    named = comparison.short_name(cmp_rows) if cmp_rows else "no runs"
    entries = list(dict.fromkeys(r["entry"] for r in rows if r["night"] == night))
    trends = [trend_plot([r for r in rows if r["night"] in shown], entry, shown,
                         {(night, v.backend, "eval_loss" if v.kind == "quality" else v.metric)
                          for v in flagged if v.entry == entry},
                         night_dir / f"trend-{entry}.png") for entry in entries]
    window = read_night_verdicts(night_dir).get("policy", {}).get("window", "?")  # checked by load_verdicts
    blocks: list = [regressions_box(verdicts)]
    checked = selfcheck.load_verdicts(night_dir / selfcheck.NIGHT_DIR)
    if checked:
        failing = [f"{v.backend}, {selfcheck.BY_NAME[v.path].title}: {v.detail}" for v in checked if v.verdict == "fail"]
        blocks += [Bullets(failing, box="bad", name="selfcheck", title=f"Selfcheck: {len(failing)} path(s) fail")
                   if failing else Bullets([], box="good", name="selfcheck",
                                           title="Selfcheck: every path checked here passes.")]
    failed = contrast.failures(cmp_rows)
    if failed:
        blocks += [Heading("Failed runs"), Bullets(failed)]
    blocks += [Heading(f"This night: {' vs '.join(backends)}, {named}"), contrast.contrast_table(cmp_rows, backends),
               Image(chart, "bar chart of throughput per backend")]
    if len(backends) > 1:
        blocks.append(Paragraph(f"Contrast = ({backends[0]} − {backends[1]}) / {backends[1]} on samples per second "
                                "over the measured window.", muted=True))
    blocks += [Paragraph(f"⚠ {contrast.row_name(row)}: {w}") for row in cmp_rows for w in row.warnings
               if "memory is measured from different sources" in w]
    blocks += [Paragraph(f"⚠ {w}") for w in short_windows(cmp_rows)]
    blocks += converge_blocks(history_dir, night_dir, verdicts)
    blocks += [Heading("Against the previous nights"), verdict_table(verdicts),
               Heading(f"Trends (last {len(shown)} night{'s' if len(shown) != 1 else ''})"),
               *(Image(path, f"trend of {entry}") for path, entry in zip(trends, entries)),
               Heading("Environment of each night"), environment_table(_night_states(history_dir, shown), rows)]
    if checked:
        blocks += [Heading("Selfcheck of this machine"), *selfcheck.verdict_blocks(checked)]
    return Page(title=f"xfw nightly: {suite_name}, night {night}", level=1, blocks=blocks,
                subtitle=f"{len(results)} runs, each compared with the median of up to {window} previous nights "
                         f"of the same workload; history: {history_dir.resolve()}",
                footer=f"Written by xfw nightly ({named}). Throughput is global samples per second over each run's "
                       f"measured window; memory is the measure both backends share, per rank: {memory_words(cmp_rows)} "
                       "(source in the table). MFU (GPU runs) divides "
                       "the family's model FLOPs by the datasheet peak named in the table's notes. Verdicts: a "
                       "change beyond max(floor, k × measured noise) is flagged; a converge entry's final eval loss "
                       "(mean over seeds) rising beyond max(loss_rise, k × measured noise), or the night's own test "
                       "naming a side worse, is a quality regression.")


def memory_words(rows: list) -> str:
    """The footer's memory, as the table shows it: each measure the night's runs used, by name."""
    sources = sorted({s.memory_source for row in rows for s in row.sides.values() if s.ok and s.memory_source})
    if not sources:
        return "the CUDA allocator's peak on a GPU, the training memory on a CPU"
    return "; ".join(contrast.measure_name(x) for x in sources)


def write_night_report(history_dir: Path, night: str, *, suite_name: str) -> Path:
    """Write the night's report.html/.md (and the latest copy at the history's top); returns its path."""
    night_dir = history_dir / NIGHTS_DIR / night
    page = night_page(history_dir, night, suite_name=suite_name)
    html = to_html(page)
    report = night_dir / "report.html"
    write_text_atomic(report, html)
    write_text_atomic(night_dir / "report.md", to_markdown(page))
    write_text_atomic(history_dir / "report.html", html)
    return report
