"""How far to trust a comparison's numbers, said beside them: how long each side was measured and
how much its step time moved (:func:`noise_notes`), a warning when a window is too short to trust
(:func:`short_windows`), and why the sides' first losses differ (:func:`starting_points`)."""

from __future__ import annotations

from xfw.report import comparison
from xfw.report.compare import ComparisonRow, is_parsed, row_name

MIN_WINDOW_S = 5.0
"""A measured window shorter than this is warned about (:func:`short_windows`)."""
TARGET_WINDOW_S = 10.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def noise_notes(rows: list[ComparisonRow], backends: list[str]) -> list[str]:
    """How long each side was measured and how much its step time moved: the window, the measured
    steps and the p10–p90 step time (and the spread over repeats where there are some)."""
    notes = []
    for row in rows:
        parts = []
        for name in backends:
            s = row.sides[name]
            if not s.ok or s.window_time_s is None:
                continue
            steps = s.steps_per_process or s.num_measured_steps
            text = f"{name} {steps} steps" + (f" per process ({s.num_processes} processes)" if s.num_processes > 1
                                               else "") + f" in {s.window_time_s:.3g} s"
            if s.step_time_p10_s is not None and s.step_time_median_s:
                text += (f", step time p10–p90 {_ms(s.step_time_p10_s)}–{_ms(s.step_time_p90_s)} "
                         f"(±{(s.step_time_p90_s - s.step_time_p10_s) / 2 / s.step_time_median_s:.0%} of the median)")
            if s.num_repeats > 1:
                text += f", {s.num_repeats} repeats" + (f", ips spread {s.ips_spread:.1%}" if s.ips_spread else "")
            parts.append(text)
        if parts:
            notes.append(("Measured: " if len(rows) == 1 else f"Measured, {row_name(row)}: ") + "; ".join(parts) + ".")
    return notes


def starting_points(rows: list[ComparisonRow]) -> list[str]:
    """Why the sides' first losses differ, where they do: each started from its own random weights
    (the frameworks draw them differently); ``xfw parity`` starts both from one file."""
    out = []
    for row in rows:
        sides = [s for s in row.sides.values() if s.ok and s.loss_first is not None]
        if len(sides) < 2:
            continue
        losses = [s.loss_first for s in sides]
        if max(losses) - min(losses) <= 1e-3 * max(abs(v) for v in losses):
            continue
        weights = {s.setup.get("weights") or "random" for s in sides}
        framework = comparison.one_framework([s.backend for s in sides])
        if framework and weights == {"random"}:  # two builds: cross-framework parity is no next step here
            out.append(f"{row_name(row)}: first losses differ (" + ", ".join(f"{s.backend} {s.loss_first:.4g}"
                                                                        for s in sides) + f"): the two builds of "
                       f"{framework} drew the recipe's seeded random weights, or computed the first step, differently "
                       "(model.weights: random); the speed and memory compared do not depend on it.")
            continue
        parity = row.parity or {}
        losses_checked = (f"the parity run ({parity.get('path')}) started both from one exported file and passed: "
                          "the losses agree there" if parity.get("status") == "passed" else
                          "`xfw parity` on the recipe runs both from one exported file to compare losses")
        why = ("each side started from its own random weights (model.weights: random; the frameworks draw them "
               "differently), so the same model starts at different losses; the speed and memory compared do not "
               f"depend on it, and {losses_checked}"
               if weights == {"random"} else f"the sides started from {', '.join(sorted(weights))}")
        out.append(f"{row_name(row)}: first losses differ (" + ", ".join(f"{s.backend} {s.loss_first:.4g}"
                                                                    for s in sides) + f"): {why}.")
    return out


def short_windows(rows: list[ComparisonRow]) -> list[str]:
    """A warning per side whose measured window is shorter than :data:`MIN_WINDOW_S`: why it cannot be
    trusted and what to set."""
    out = []
    for row in rows:
        for s in row.sides.values():
            if not s.ok or s.window_time_s is None or s.window_time_s >= MIN_WINDOW_S or is_parsed(s):
                continue
            steps = max(s.steps_per_process or s.num_measured_steps, 1)  # one process's: what measure.steps counts
            wanted = max(steps + 1, int(steps * TARGET_WINDOW_S / max(s.window_time_s, 1e-3)) + 1)
            counted = f"{steps} steps" + (f" per process, {s.num_processes} processes" if s.num_processes > 1 else "")
            repeat = (f" (its {s.num_repeats} repeats give the spread shown)" if s.num_repeats > 1
                      else " and/or --repeat 3 to see the spread")
            out.append(f"{row_name(row)} / {s.backend}: the measured window was {s.window_time_s:.2g} s "
                       f"({counted}), too short to trust: on a shared machine one scheduler "
                       f"pause moves ips by tens of percent; set measure.steps={wanted} (about "
                       f"{TARGET_WINDOW_S:g} s){repeat}")
    return out
