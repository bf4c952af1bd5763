"""Live progress for long runs, from the records the launcher tails.

On a terminal a rich progress bar per run; elsewhere (CI logs, nightly jobs) one plain line
every few seconds and one per finished run, e.g.::

    [torch] tiny-llava-sft: 12/23 steps (measure), mean 0.017 s/step, loss 5.21
    [torch] tiny-llava-sft: ok, 468 samples/s (mean 0.0171 s/step over 20 measured steps), 23 steps in 4.9 s
"""

from __future__ import annotations

import sys
import time

from xfw.report.results import RunResult

PLAIN_INTERVAL_S = 5.0


def _describe_last(state: dict) -> str:
    """Steps done; in the measured window the mean step time so far, the same quantity the finished
    line gives for the whole window (warm-up steps show their last step time, labelled)."""
    parts = [f"{state['done']}/{state['total']} steps"]
    if state.get("phase"):
        parts[0] += f" ({state['phase']})"
    if state.get("measured"):
        parts.append(f"mean {state['measured_s'] / state['measured']:.3g} s/step")
    elif state.get("step_time_s") is not None:
        parts.append(f"last {state['step_time_s']:.3g} s/step")
    if state.get("loss") is not None:
        parts.append(f"loss {state['loss']:.4g}")
    return ", ".join(parts)


def _count(state: dict, new_records: list[dict]) -> bool:
    """Advance ``state`` by the steps of one rank (the first seen): every rank takes the same steps,
    so a 2-process run of 13 steps shows 13, not 26. True when a step arrived."""
    steps = [r for r in new_records if r.get("kind") == "step"]
    if steps and "rank" not in state:
        state["rank"] = min(r["rank"] for r in steps)
    mine = [r for r in steps if r["rank"] == state.get("rank")]
    for r in mine:
        state.update(done=state["done"] + 1, phase=r["phase"], step_time_s=r["step_time_s"], loss=r["loss"])
        if r["phase"] == "measure":
            state["measured"] = state.get("measured", 0) + 1
            state["measured_s"] = state.get("measured_s", 0.0) + r["step_time_s"]
    return bool(mine)


def finished_line(result: RunResult) -> str:
    m = result.measurement
    if result.ok:
        text = f"ok, {m.ips:,.1f} samples/s" if m.ips is not None else "ok"
        steps = m.per_rank[0]["num_measured_steps"] if m.per_rank else 0
        if steps and m.window_time_s:  # the progress line's "mean s/step", over the whole window
            text += f" (mean {m.window_time_s / steps:.3g} s/step over {steps} measured steps)"
        ranks = max(len(m.per_rank), 1)
        text += f", {(m.num_warmup_steps + m.num_measured_steps) // ranks} steps in {result.wall_time_s:.1f} s"
        return text + (f" ({result.reason})" if result.reason else "")
    return f"{result.status.upper()}: {result.reason}"


class PlainProgress:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.state: dict[str, dict] = {}

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def started(self, backend: str, recipe: str, total_steps: int) -> None:
        self.state[backend] = {"recipe": recipe, "total": total_steps, "done": 0, "printed": time.monotonic()}
        self._print(f"[{backend}] {recipe}: launching ({total_steps} steps per rank)")

    def update(self, backend: str, new_records: list[dict]) -> None:
        """A line when the first step arrives, when the measured window starts, then every few seconds."""
        state = self.state[backend]
        phase = state.get("phase")
        if not _count(state, new_records):
            return
        if phase != state.get("phase") or time.monotonic() - state["printed"] >= PLAIN_INTERVAL_S:
            state["printed"] = time.monotonic()
            self._print(f"[{backend}] {state['recipe']}: {_describe_last(state)}")

    def finished(self, result: RunResult) -> None:
        self._print(f"[{result.backend}] {result.recipe}: {finished_line(result)}")


class RichProgress(PlainProgress):
    """A bar per run on a terminal; the finished line stays above the bars."""

    def __init__(self):
        super().__init__()
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                            transient=True)
        self.tasks: dict[str, int] = {}

    def started(self, backend: str, recipe: str, total_steps: int) -> None:
        self.state[backend] = {"recipe": recipe, "total": total_steps, "done": 0}
        if not self.tasks:
            self.bar.start()
        self.tasks[backend] = self.bar.add_task("", total=total_steps, label=f"[{backend}] {recipe}",
                                                info="starting")

    def update(self, backend: str, new_records: list[dict]) -> None:
        state = self.state[backend]
        _count(state, new_records)
        info = _describe_last(state).split(", ", 1)[1] if state["done"] else "starting"
        self.bar.update(self.tasks[backend], completed=state["done"], info=info)

    def finished(self, result: RunResult) -> None:
        task = self.tasks.pop(result.backend)
        self.bar.remove_task(task)
        if not self.tasks:
            self.bar.stop()
        from rich.markup import escape

        style = "green" if result.ok else "bold red"
        line = escape(f"[{result.backend}] {result.recipe}: {finished_line(result)}")
        self.console.print(f"[{style}]{line}[/]")


def make_progress():
    return RichProgress() if sys.stderr.isatty() else PlainProgress()
