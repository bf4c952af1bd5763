"""The ``xfw`` command line: a thin click shell over :mod:`xfw.workflow`.

    xfw validate recipes/tiny/llava_sft.yaml
    xfw run recipes/tiny/llava_sft.yaml --backend torch
    xfw compare recipes/tiny/llava_sft.yaml --backends paddle,torch
    xfw sweep recipes/tiny/llava_sft.yaml --set batch.micro=1,2 --set recompute=false,true --backends torch
    xfw maxbatch recipes/llava7b_lora.yaml --backends torch --candidates 64,32,16
    xfw estimate recipes/llava7b_lora.yaml
    xfw report runs/20261122-161500-tiny-llava-sft
    xfw report runs/sweep-tiny-llava-sft --layout scaling
    xfw env

Exit codes: 0 success; 1 a run failed (its result and the others are still written);
2 bad input, found before anything launched.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from xfw.run import launcher
from xfw import workflow
from xfw.report.layouts import LAYOUTS
from xfw.run.recipe import to_dict


def _fail(message: str) -> None:
    click.echo(f"error: {message}" if "\n" not in message else
               "error:\n" + "\n".join(f"  {m}" for m in message.splitlines()), err=True)
    sys.exit(2)


def _interpreters(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            _fail(f"--python {pair!r}: expected NAME=PATH, e.g. --python paddle=/opt/paddle/bin/python")
        out[name] = path
    return out


def _backend_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(set(names)) != len(names):
        _fail(f"--backends {text!r}: a backend is named twice")
    return names


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="Override a recipe field (value parsed as YAML), e.g. --set batch.micro=2. Repeatable.")
python_option = click.option("--python", "pythons", multiple=True, metavar="NAME=PATH",
                             help="Interpreter for a backend (default: .venv/NAME/bin/python). Repeatable.")


def rendezvous_options(fn):
    """Multi-node flags, passed through to the backend's launcher (torchrun, paddle.distributed.launch)."""
    fn = click.option("--master-port", type=int, default=None,
                      help="Rendezvous port of node 0 (default: a free port, single node).")(fn)
    fn = click.option("--master-addr", default="127.0.0.1", show_default=True,
                      help="Address of node 0 for multi-node runs.")(fn)
    fn = click.option("--node-rank", type=int, default=0, show_default=True,
                      help="This node's rank for multi-node runs (parallel.nnodes > 1).")(fn)
    return fn


repeat_option = click.option("--repeat", type=click.IntRange(min=1), default=None, metavar="K",
                             help="Run each backend K times (same as --set measure.repeat=K); the report shows "
                                  "the median and the spread, and flags a contrast within the noise.")


def _with_repeat(overrides: tuple[str, ...], repeat: int | None) -> tuple[str, ...]:
    return (*overrides, f"measure.repeat={repeat}") if repeat else overrides


out_option = click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                          help="Directory for run directories and the report (default: runs/<time>-<recipe>).")


def _prepare(recipe_paths, backend_names, overrides, pythons):
    try:
        recipes = workflow.load_all(list(recipe_paths), list(overrides))
        backends = workflow.prepare_backends(backend_names, _interpreters(pythons))
    except workflow.UsageError as err:
        _fail(str(err))
    return recipes, backends


def _show(report: "workflow.Report") -> None:
    """The report on stdout, where its files went on stderr."""
    click.echo(report.markdown)
    for kind, path in report.paths.items():
        click.echo(f"{kind}: {path}", err=True)


def _failures_exit_code(results) -> int:
    """1 when any run is not ok (said on stderr), else 0."""
    failed = [r for r in results if not r.ok]
    if failed:
        click.echo(f"{len(failed)} of {len(results)} runs did not succeed (see 'Failed runs' above)", err=True)
    return 1 if failed else 0


def _execute(recipe_paths, backend_names, overrides, pythons, out_dir, rendezvous, print_command=False,
             parity_dirs=None) -> int:
    """Run, report, print. ``parity_dirs`` (a list, possibly empty): look up and show parity status."""
    from xfw.report.progress import make_progress

    recipes, backends = _prepare(recipe_paths, backend_names, overrides, pythons)
    out_dir = out_dir or workflow.default_out_dir(recipes)
    if print_command:
        click.echo("\n".join(workflow.launch_commands(recipes, backends, out_dir, rendezvous)))
        return 0
    click.echo(f"runs in {out_dir}", err=True)
    results = workflow.run_all(recipes, backends, out_dir, make_progress(), rendezvous)
    parity = None if parity_dirs is None else workflow.parity_statuses(recipes, out_dir, parity_dirs)
    report = workflow.write_report(results, backend_names, out_dir, parity=parity)
    _show(report)
    return _failures_exit_code(results)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="xfw")
def main() -> None:
    """Compare one training recipe across frameworks: throughput, memory, settings."""


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@set_option
@click.option("--print-spec", is_flag=True, help="Print the resolved spec (every default filled in) as JSON.")
def validate(recipes, overrides, print_spec) -> None:
    """Check recipes without launching anything."""
    try:
        loaded = workflow.load_all(list(recipes), list(overrides))
    except workflow.UsageError as err:
        _fail(str(err))
    for path, recipe in zip(recipes, loaded):
        click.echo(f"{path}: ok ({recipe.name}: {recipe.model.preset} {recipe.stage}, "
                   f"global batch {recipe.batch.global_size} = micro {recipe.batch.micro} x "
                   f"{recipe.num_processes} proc x {recipe.grad_accum_steps} accum)")
        if print_spec:
            click.echo(json.dumps(to_dict(recipe), indent=2))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--backend", required=True, help="Backend to run, e.g. torch or paddle.")
@set_option
@repeat_option
@python_option
@out_option
@rendezvous_options
@click.option("--print-command", is_flag=True,
              help="Print the exact launch command and environment (and write spec.json) without running.")
def run(recipe, backend, overrides, repeat, pythons, out_dir, node_rank, master_addr, master_port,
        print_command) -> None:
    """Run one recipe on one backend and report it."""
    rendezvous = launcher.Rendezvous(node_rank, master_addr, master_port)
    sys.exit(_execute([recipe], [backend], _with_repeat(overrides, repeat), pythons, out_dir, rendezvous,
                      print_command))


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends; contrast = (first - second) / second.")
@set_option
@repeat_option
@python_option
@out_option
@rendezvous_options
@click.option("--parity", "parity_dirs", multiple=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Where to look for a parity run of the recipe (xfw parity's --out); repeatable. Also searched: "
                   "--out (and one level below) and runs/parity-<recipe>.")
def compare(recipes, backends, overrides, repeat, pythons, out_dir, node_rank, master_addr, master_port,
            parity_dirs) -> None:
    """Run recipes on several backends, one at a time, and print the contrast table. The settings
    section shows each recipe's parity status: the newest parity.json with the same recipe
    fingerprint in --parity DIR, in --out (or one level below) or in runs/parity-<recipe>."""
    rendezvous = launcher.Rendezvous(node_rank, master_addr, master_port)
    sys.exit(_execute(recipes, _backend_list(backends), _with_repeat(overrides, repeat), pythons, out_dir,
                      rendezvous, parity_dirs=list(parity_dirs)))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--set", "axes", multiple=True, metavar="KEY.PATH=V1,V2,...",
              help="A swept recipe field and its values (YAML; commas inside [] or quotes do not split). "
                   "Repeatable: the sweep is the cartesian product.")
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends, each run at every point.")
@repeat_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Sweep directory (default: runs/sweep-<recipe>); the same --out resumes, skipping finished runs.")
def sweep(recipe, axes, backends, repeat, pythons, out_dir) -> None:
    """Run a recipe at every combination of --set values, one run at a time; resumable."""
    from xfw.report.progress import make_progress

    try:
        points = workflow.plan_sweep(recipe, list(axes), list(_with_repeat((), repeat)))
        prepared = workflow.prepare_backends(_backend_list(backends), _interpreters(pythons))
    except workflow.UsageError as err:
        _fail(str(err))
    out_dir = out_dir or workflow.default_sweep_dir(points)
    click.echo(f"sweep of {len(points)} points x {len(prepared)} backends in {out_dir}", err=True)
    results, report = workflow.run_sweep(points, prepared, out_dir, make_progress(),
                                         log=lambda line: click.echo(line, err=True))
    _show(report)
    sys.exit(_failures_exit_code(results))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends, searched one after the other.")
@click.option("--candidates", default=None, metavar="M1,M2,...",
              help="Micro-batches to try, largest first, stopping at the first that fits "
                   "(default: double from the recipe's micro-batch until out of memory).")
@click.option("--max-micro", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Largest micro-batch a doubling search tries.")
@set_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for the probes' run directories (default: runs/maxbatch-<recipe>); the same --out "
                   "resumes, keeping settled probes.")
def maxbatch(recipe, backends, candidates, max_micro, overrides, pythons, out_dir) -> None:
    """Find the largest micro-batch that fits, per backend; each probe a separate process."""
    from xfw.report.progress import make_progress

    try:
        values = workflow.plan_maxbatch(recipe, list(overrides), candidates)
        prepared = workflow.prepare_backends(_backend_list(backends), _interpreters(pythons))
    except workflow.UsageError as err:
        _fail(str(err))
    out_dir = out_dir or workflow.default_maxbatch_dir(recipe, list(overrides))
    click.echo(f"probes in {out_dir}", err=True)
    found, report = workflow.run_maxbatch(recipe, prepared, out_dir, candidates=values, overrides=list(overrides),
                                          max_micro=max_micro, progress=make_progress(),
                                          log=lambda line: click.echo(line, err=True))
    _show(report)
    settled = all(f.edge and all(p.status in ("ok", "oom") for p in f.probes) for f in found)
    sys.exit(0 if settled else 1)


@main.command()
@click.argument("recipe", type=click.Path(), required=False)
@set_option
@click.option("--run", "run_dir", type=click.Path(), default=None,
              help="Estimate this run directory's own spec and print what it measured beside the estimate.")
def estimate(recipe, overrides, run_dir) -> None:
    """Predict memory per GPU before running: model states by sharding and precision, activations."""
    try:
        click.echo(workflow.estimate_markdown(recipe, list(overrides), run_dir))
    except workflow.UsageError as err:
        _fail(str(err))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--backends", default=None, help="Comma-separated backends and their order (default: as found).")
@out_option
@click.option("--layout", type=click.Choice(list(LAYOUTS)), default="contrast", show_default=True,
              help="contrast: backends side by side (seed 003); strategies: per GPU count and sharding (seed 000); "
                   "ranks: per-rank time and memory (seed 001); batch: throughput per global batch with OOM rows "
                   "(seed 002); scaling: linear-scaling efficiency; cost: cost per 1M samples (seed 004).")
@click.option("--price-per-gpu-hour", type=float, default=None, metavar="USD",
              help="Price of one GPU-hour, for --layout cost.")
def report(run_dirs, backends, out_dir, layout, price_per_gpu_hour) -> None:
    """Rebuild a report (table, CSV, HTML; chart for contrast) from existing run directories."""
    try:
        rep = workflow.report_from_dirs(list(run_dirs), _backend_list(backends) if backends else None, out_dir,
                                        layout=layout, price_per_gpu_hour=price_per_gpu_hour)
    except workflow.UsageError as err:
        _fail(str(err))
    _show(rep)


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--backends", default="torch,paddle", show_default=True,
              help="REFERENCE,OTHER: the reference exports the starting weights both sides load.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Training steps to compare.")
@set_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for the weights, both runs and parity.json (default: runs/parity-<recipe>).")
def parity(recipe, backends, steps, overrides, pythons, out_dir) -> None:
    """Train both backends from the same weights on the same batches (fp32, CPU-exact) and
    compare the loss per step; exit 1 when a step is outside tolerance."""
    from xfw.run import parity as par

    names = _backend_list(backends)
    if len(names) != 2:
        _fail(f"--backends {backends!r}: parity compares exactly two backends")
    try:
        name = workflow.load_all([recipe], list(overrides))[0].name
        report = par.run_parity(recipe, list(overrides), steps, out_dir or Path("runs") / f"parity-{name}",
                                _interpreters(pythons), backends=(names[0], names[1]))
    except (workflow.UsageError, par.ParityError) as err:
        _fail(str(err))
    click.echo(report.markdown())
    sys.exit(0 if report.passed else 1)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


@main.command()
@click.argument("suite", type=click.Path())
@click.option("--history", "history_dir", type=click.Path(path_type=Path), required=True,
              help="History directory: history.jsonl, nights/<night>/..., report.html (created if missing).")
@click.option("--night", default=None, metavar="ID",
              help="Night id (default: resume this suite's unfinished night, else today's UTC date).")
@set_option
@python_option
@click.option("--backends", "only_backends", default=None, metavar="A,B",
              help="Run only these of the suite's backends (e.g. torch on a node without a Paddle GPU build).")
@click.option("--report-only", is_flag=True, help="Run nothing: rewrite the night's report from what is recorded.")
def nightly(suite, history_dir, night, overrides, only_backends, pythons, report_only) -> None:
    """Run a suite, add it to the history, flag regressions against earlier nights, write report.html.

    Exit 0: no regression; 1: a regression or a failed run (listed first in the report); 2: bad input.
    Killed at any moment, the same command resumes the night and keeps every finished run."""
    from xfw.run import nightly as nt
    from xfw.report.history import NIGHTS_DIR
    from xfw.report.nightly_report import write_night_report
    from xfw.report.verdicts import load_verdicts
    from xfw.report.progress import make_progress
    from xfw.run.suite import SuiteError, load_suite

    try:
        loaded = load_suite(suite, list(overrides))
    except SuiteError as err:
        _fail(str(err))
    if report_only:
        night = night or (nt.History(history_dir).nights() or [None])[-1]
        if night is None or not (history_dir / NIGHTS_DIR / night / "nightly.json").exists():
            _fail(f"--report-only: no recorded night {night or ''} in {history_dir}".replace("  ", " "))
        verdicts = load_verdicts(history_dir / NIGHTS_DIR / night)
        path = write_night_report(history_dir, night, suite_name=loaded.name)
        click.echo(f"report: {path}", err=True)
        sys.exit(1 if any(v.flagged for v in verdicts) else 0)
    names = list(loaded.backends)
    if only_backends is not None:
        names = _backend_list(only_backends)
        stray = [n for n in names if n not in loaded.backends]
        if stray:
            _fail(f"--backends {stray[0]}: not a backend of {suite} (it runs {', '.join(loaded.backends)})")
    try:
        backends = workflow.prepare_backends(names, _interpreters(pythons))
    except workflow.UsageError as err:
        _fail(str(err))
    # A scheduler's polite stop (cron's `timeout`, Slurm's time limit) arrives as SIGTERM: stop the
    # running adapter the way Ctrl-C does, so it is recorded as cut off and rerun on resume.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        outcome = nt.run_night(loaded, backends, history_dir, night=night, overrides=list(overrides),
                               progress=make_progress(), log=lambda line: click.echo(line, err=True))
    except KeyboardInterrupt:
        click.echo("interrupted: finished runs are kept; the same command resumes this night", err=True)
        sys.exit(130)
    outcome.report_path = write_night_report(history_dir, outcome.night, suite_name=loaded.name)
    nt.finish_night(outcome)
    flagged = outcome.regressions
    if flagged:
        click.echo(f"{len(flagged)} regression(s) or failure(s) in night {outcome.night}:")
        for verdict in flagged:
            click.echo(f"  {verdict.line()}")
    else:
        click.echo(f"night {outcome.night}: no regressions ({len(outcome.results)} runs, "
                   f"{outcome.kept} kept from an earlier attempt)")
    click.echo(f"report: {outcome.report_path}\nhistory: {history_dir / 'history.jsonl'}", err=True)
    sys.exit(outcome.exit_code)


@main.command(name="env")
@click.option("--backends", default="paddle,torch", show_default=True, help="Backends to describe.")
@python_option
def env_command(backends, pythons) -> None:
    """Show each backend's interpreter, whether its adapter imports, and its versions."""
    interpreters, status = _interpreters(pythons), 0
    for name in _backend_list(backends):
        try:
            backend = launcher.resolve_backend(name, interpreters)
            info = launcher.describe_backend(backend)
        except launcher.BackendError as err:
            click.echo(f"{name}: NOT AVAILABLE — {err}")
            status = 1
            continue
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        click.echo(f"{name}: {backend.python}\n  device: {info.get('device')} ({info.get('device_name')})\n"
                   f"  versions: {versions}")
    sys.exit(status)


if __name__ == "__main__":
    main()
