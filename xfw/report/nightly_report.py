"""The nightly report: one self-contained HTML file (images inlined, no script, no network).

Top to bottom: the regressions (or a line saying there are none), failed runs, the night's
contrast table (seed 003) and bar chart, every (entry, backend) against its baseline, a trend plot
per entry (throughput and peak memory over the nights, one line per backend, flagged points
circled in red), and the environment of each night::

    path = write_night_report(Path("/data/xfw-nightly"), "2026-11-22", suite_name="h800-nightly")
    # /data/xfw-nightly/nights/2026-11-22/{report.html, report.md, chart.png, trend-*.png}
    # /data/xfw-nightly/report.html  (the same page: the latest night)
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from xfw.report import compare as cmp
from xfw.report import render
from xfw.report.history import NIGHTS_DIR, History, night_order
from xfw.report.verdicts import Verdict, load_verdicts, memory_of
from xfw.report.plot import plot_comparison
from xfw.report.results import load_runs
from xfw.contract.atomic import write_text_atomic

TREND_NIGHTS = 30
"""Nights shown in each trend plot (the most recent)."""
_COLORS = {"paddle": "#2f6fdf", "torch": "#ee4c2c"}
_FALLBACK = ["#6a9955", "#b07cc6", "#c0a000"]
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1200px;color:#1b1b1b}
h1{font-size:22px;margin-bottom:4px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
.sub{color:#555;margin-top:0}
.box{padding:10px 14px;border-radius:6px;margin:12px 0}
.bad{background:#fde8e8;border:2px solid #b00020} .good{background:#e6f4ea;border:2px solid #1e7b34}
.bad li{color:#7a0016;margin:3px 0}
table{border-collapse:collapse;margin:8px 0;font-size:14px}
th{background:#dde7f7;text-align:left;padding:5px 9px;border:1px solid #b9c6dd}
td{padding:4px 9px;border:1px solid #d5d5d5} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.regression td{background:#fde8e8} tr.improvement td{background:#e6f4ea}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
.trends{display:grid;grid-template-columns:1fr;gap:8px}
footer{color:#666;font-size:12px;margin-top:30px}
"""


def _esc(value) -> str:
    return html.escape("" if value is None else str(value))


def _png_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def html_table(header: list[str], cells: list[list[str]], *, css_class: str = "",
               row_classes: list[str] | None = None) -> str:
    numeric = {i for i, h in enumerate(header) if h.endswith("ips") or h in ("Contrast", "Change", "Value",
                                                                           "Baseline", "Tolerance")}
    out = [f'<table class="{_esc(css_class)}">', "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(cells):
        cls = f' class="{_esc(row_classes[i])}"' if row_classes and row_classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f'<td{" class=num" if j in numeric else ""}>{_esc(c)}</td>'
                                          for j, c in enumerate(row)) + "</tr>")
    return "\n".join(out + ["</table>"])


def _fmt_value(v: Verdict, value: float | None) -> str:
    if value is None:
        return "–"
    return render.fmt_rate(value) if v.metric == "ips" else f"{value / 2**20:.1f} MiB"


def verdict_table(verdicts: list[Verdict]) -> tuple[list[str], list[list[str]], list[str]]:
    header = ["Entry", "Backend", "Metric", "Value", "Baseline", "Nights", "Change", "Tolerance", "Verdict", "Note"]
    cells, classes = [], []
    for v in verdicts:
        cells.append([v.entry, v.backend, v.metric, _fmt_value(v, v.value), _fmt_value(v, v.baseline),
                      str(v.baseline_nights) if v.baseline is not None else "–",
                      f"{v.change:+.1%}" if v.change is not None else "–",
                      f"±{v.tolerance:.1%}" if v.tolerance is not None else "–", v.verdict, v.note])
        classes.append("regression" if v.flagged else "improvement" if v.verdict == "improvement" else "")
    return header, cells, classes


def trend_plot(rows: list[dict], entry: str, nights: list[str], flagged: set[tuple[str, str, str]],
               path: Path) -> Path:
    """Throughput and peak memory of one entry over ``nights``, a line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({r["backend"] for r in rows if r["entry"] == entry})
    fig, (ax_ips, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.4))
    xs = list(range(len(nights)))
    for i, backend in enumerate(backends):
        color = _COLORS.get(backend, _FALLBACK[i % len(_FALLBACK)])
        for ax, metric in ((ax_ips, "ips"), (ax_mem, "memory")):
            points = []
            for x, night in zip(xs, nights):
                ok = [r for r in rows if r["night"] == night and r["entry"] == entry and r["backend"] == backend
                      and r["status"] == "ok"]
                values = [r["ips"] if metric == "ips" else memory_of(r) for r in ok]
                values = [v for v in values if v is not None]
                if values:
                    value = sorted(values)[len(values) // 2]
                    points.append((x, value / (1 if metric == "ips" else 2**20), night))
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color, label=backend)
            bad = [p for p in points if (p[2], backend, metric) in flagged]
            if bad:
                ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=160, facecolors="none",
                           edgecolors="#b00020", linewidths=2.2, zorder=5)
    sources = {b: next((r.get("mem_source") for r in rows if r["backend"] == b and r.get("mem_source")), None)
               for b in backends}
    mem_label = "peak memory (MiB)"
    if len({v for v in sources.values() if v}) > 1:  # e.g. peak RSS beside an allocator: say so on the axis
        mem_label += "\n" + ", ".join(f"{b}: {v.replace('_', ' ')}" for b, v in sources.items() if v)
    for ax, label in ((ax_ips, "ips (samples/s)"), (ax_mem, mem_label)):
        ax.set_xticks(xs, nights, rotation=30 if len(nights) > 4 else 0, ha="right" if len(nights) > 4 else "center",
                      fontsize=8)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="y", alpha=0.3)
    ax_ips.legend(fontsize=8)
    fig.suptitle(f"{entry}: throughput and peak memory per night", fontsize=11)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _night_states(history_dir: Path, nights: list[str]) -> list[dict]:
    states = []
    for night in nights:
        try:
            states.append(json.loads((history_dir / NIGHTS_DIR / night / "night.json").read_text()))
        except (OSError, json.JSONDecodeError):
            states.append({"night": night})
    return states


def environment_table(states: list[dict], rows: list[dict]) -> tuple[list[str], list[list[str]]]:
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
                      " ".join(state.get("overrides", [])) or "–"])
    return header, cells


def night_markdown(night: str, suite_name: str, verdicts: list[Verdict], contrast_md: str) -> str:
    flagged = [v for v in verdicts if v.flagged]
    out = [f"# xfw nightly: {suite_name}, night {night}", ""]
    if flagged:
        out += [f"## {len(flagged)} regression(s) or failure(s)", ""] + [f"- {v.line()}" for v in flagged] + [""]
    else:
        out += ["No regressions against the previous nights.", ""]
    out += [contrast_md, ""]
    header, cells, _ = verdict_table(verdicts)
    out += ["## Against the previous nights", "", render.markdown_table(header, cells), ""]
    return "\n".join(out)


def write_night_report(history_dir: Path, night: str, *, suite_name: str) -> Path:
    """Write the night's report.html/.md (and the latest copy at the history's top); returns its path."""
    night_dir = history_dir / NIGHTS_DIR / night
    rows = History(history_dir).rows()
    order = night_order(rows)
    shown = order[:order.index(night) + 1][-TREND_NIGHTS:] if night in order else [night]
    verdicts = load_verdicts(night_dir)
    flagged = [v for v in verdicts if v.flagged]
    results = load_runs([night_dir])
    backends = cmp.backends_in(results)
    cmp_rows = cmp.compare_runs(results, backends)
    header, cells = render.contrast_table(cmp_rows, backends)
    chart = plot_comparison(cmp_rows, backends, night_dir / "chart.png", title=f"Training speed, night {night}")
    entries = list(dict.fromkeys(r["entry"] for r in rows if r["night"] == night))
    trends = [trend_plot([r for r in rows if r["night"] in shown], entry, shown,
                         {(night, v.backend, v.metric) for v in flagged if v.entry == entry},
                         night_dir / f"trend-{entry}.png") for entry in entries]
    window = json.loads((night_dir / "nightly.json").read_text()).get("policy", {}).get("window", "?")
    env_header, env_cells = environment_table(_night_states(history_dir, shown), rows)
    v_header, v_cells, v_classes = verdict_table(verdicts)
    failed = render.failures(cmp_rows)

    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8>"
             f"<title>xfw nightly {_esc(suite_name)} {_esc(night)}</title><style>{_CSS}</style></head><body>",
             f"<h1>xfw nightly: {_esc(suite_name)}, night {_esc(night)}</h1>",
             f"<p class=sub>{len(results)} runs, each compared with the median of up to {_esc(window)} previous nights "
             f"of the same workload; history: {_esc(history_dir.resolve())}</p>"]
    if flagged:
        parts.append(f'<section id=regressions class="box bad"><strong>{len(flagged)} regression(s) or '
                     f"failure(s)</strong><ul>" + "".join(f"<li>{_esc(v.line())}</li>" for v in flagged)
                     + "</ul></section>")
    else:
        parts.append('<section id=regressions class="box good"><strong>No regressions</strong> against the '
                     "previous nights.</section>")
    if failed:
        parts.append("<h2>Failed runs</h2><ul>" + "".join(f"<li>{_esc(f)}</li>" for f in failed) + "</ul>")
    parts += [f"<h2>This night: {_esc(' vs '.join(backends))}</h2>", html_table(header, cells, css_class="contrast"),
              _png_tag(chart, "bar chart of throughput per backend")]
    if len(backends) > 1:
        parts.append(f"<p class=sub>Contrast = ({_esc(backends[0])} − {_esc(backends[1])}) / {_esc(backends[1])} "
                     "on samples per second over the measured window.</p>")
    parts += ["<h2>Against the previous nights</h2>",
              html_table(v_header, v_cells, css_class="verdicts", row_classes=v_classes),
              f"<h2>Trends (last {len(shown)} night{'s' if len(shown) != 1 else ''})</h2><div class=trends>"]
    parts += [_png_tag(path, f"trend of {entry}") for path, entry in zip(trends, entries)]
    parts += ["</div><h2>Environment of each night</h2>", html_table(env_header, env_cells, css_class="env"),
              "<footer>Written by xfw nightly. Throughput is global samples per second over each run's measured "
              "window; memory is the peak allocated per rank (source in the table). Verdicts: a change beyond "
              "max(floor, k × measured noise) is flagged.</footer></body></html>"]
    page = "\n".join(parts)
    report = night_dir / "report.html"
    write_text_atomic(report, page)
    write_text_atomic(night_dir / "report.md", night_markdown(
        night, suite_name, verdicts, render.markdown_table(header, cells)))
    write_text_atomic(history_dir / "report.html", page)
    return report
