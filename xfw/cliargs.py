"""What every ``xfw`` command shares: its common options, the reading of ``--backends`` and
``--python`` into backend names and interpreters, one-line usage errors (exit 2), and how a
workflow's outcome is printed. :mod:`xfw.cli` declares the commands themselves."""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path

import click

from xfw import terminal
from xfw.run.commands.counts import COUNT_BOUNDS


class _Lazy:
    """A module imported when first used, so ``xfw --help`` costs click alone (under 0.3 s, not the
    numpy, report and launcher imports a command needs)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


workflow = _Lazy("xfw.workflow")
launcher = _Lazy("xfw.run.launch.launcher")
overrides_of = _Lazy("xfw.recipe.overrides")
LAYOUT_NAMES = ("contrast", "strategies", "ranks", "batch", "scaling", "cost")
"""``xfw.report.layouts.LAYOUTS``' names, written out here so the CLI loads without the report layer
(tests/unit/test_cli.py holds them equal)."""


def _printable(text: str) -> str:
    """Control characters a user typed (or a file held) shown escaped: an error is one line per problem."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def _fail(message: str) -> None:
    message = _printable(message)
    click.echo(f"error: {message}" if "\n" not in message else
               "error:\n" + "\n".join(f"  {m}" for m in message.splitlines()), err=True)
    sys.exit(2)


def _pairs(flag: str, pairs: tuple[str, ...], example: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            _fail(f"{flag} {pair!r}: expected NAME=PATH, e.g. {example}")
        if name in out:
            _fail(f"{flag} {pair!r}: {name} is given twice")
        out[name] = path
    return out


def _interpreters(pairs: tuple[str, ...], backends: str | None = None, flag: str = "--backends") -> dict[str, str]:
    """``--python NAME=PATH`` pairs, and each instance's ``ADAPTER@LABEL=PATH`` in ``backends``."""
    out = _pairs("--python", pairs, "--python paddle=/opt/paddle/bin/python")
    for instance in _instances(backends, flag) if backends else []:
        given = instance.python or instance.wheel  # a wheel file is built (workflow.prepare_backends)
        if given and instance.name in out:
            _fail(f"--python {instance.name}=...: {flag} already gives {instance.name}'s build")
        if given:
            out[instance.name] = given
    return out


def _instances(text: str, flag: str = "--backends"):
    from xfw.run.launch import instances

    try:
        return instances.parse_list(text, flag=flag)
    except instances.InstanceError as err:
        _fail(str(err))


def _one_backend(text: str) -> list[str]:
    names = _backend_names(text, "--backend")
    if len(names) != 1:
        _fail(f"--backend {text!r}: one backend (xfw compare --backends runs several)")
    return names


def _backend_names(text: str, flag: str = "--backends") -> list[str]:
    """The backends' names, instances included (``paddle@3.2.0``; an ``=PATH`` goes to :func:`_interpreters`)."""
    return [instance.name for instance in _instances(text, flag)]


def _backend_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(set(names)) != len(names):
        _fail(f"--backends {text!r}: a backend is named twice")
    return names


def _with_repeat(overrides: tuple[str, ...], repeat: int | None, comparison: str | None = None) -> list[str]:
    """The overrides with --repeat K and --as C added (``measure.repeat=K``, ``comparison=C``)."""
    extra = [f"measure.repeat={repeat}"] if repeat else []
    return [*overrides, *extra, *([f"comparison={comparison}"] if comparison else [])]


def _progress():
    from xfw.report.progress import make_progress  # rich loads only when something runs

    return terminal.Display(make_progress())


def _log(line: str) -> None:
    terminal.echo(line, err=True)


def _finish(call) -> None:
    """Run one workflow call; print its outcome (report on stdout, files and notes on stderr); exit."""
    from xfw.run.launch import jobs, slurm  # the executor (--executor, executor_options) its jobs run through

    try:
        with jobs.executing(_executor()):
            outcome = call()
    except (workflow.UsageError, slurm.SlurmError) as err:
        _fail(str(err))
    except slurm.Detached as gone:  # --detach: submitted; the report job writes the report (docs/slurm.md)
        terminal.echo(f"detached: Slurm job(s) {' '.join(gone.job_ids)} submitted; report job {gone.report_id} runs "
                      f"after them (afterany) and writes the report ({gone.where}/slurm-report-{gone.report_id}.out)",
                      err=True)
        terminal.echo(f"to attach or report before then: xfw {shlex.join(gone.command)}", err=True)
        sys.exit(0)
    except KeyboardInterrupt:
        terminal.exit_interrupted()
    if outcome.text:
        terminal.echo(outcome.text)
    for kind, path in outcome.paths.items():
        terminal.echo(f"{kind}: {path}", err=True)
    for note in outcome.notes:
        terminal.echo(note, err=True)
    sys.exit(outcome.exit_code)


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="Override a recipe field (value parsed as YAML), e.g. --set batch.micro=2. Repeatable.")
python_option = click.option("--python", "pythons", multiple=True, metavar="NAME=PATH",
                             help="Interpreter for a backend (default: .venv/NAME/bin/python). Repeatable.")
def count_type(name: str) -> click.IntRange:
    """A count option's type: an integer in [1, its documented bound] (``xfw.run.commands.counts``), refused by
    click in one line (exit 2) before any work."""
    return click.IntRange(1, COUNT_BOUNDS[name])


class _PairsRange(click.IntRange):
    """``--max-pairs``: at least the pairs an A/B starts with (xfw.report.ab.MIN_PAIRS), so the range its help
    shows is the one the check keeps (issue 42: help and check agree). The minimum is read when first needed
    (the command's help, or a value to check): ``xfw --help`` imports no report module."""

    def __init__(self) -> None:
        super().__init__(1, COUNT_BOUNDS["repeat"])

    @property
    def min(self) -> int:
        from xfw.report.ab import MIN_PAIRS

        return MIN_PAIRS

    @min.setter
    def min(self, _value) -> None:
        pass


def pairs_type() -> click.IntRange:
    return _PairsRange()


class RepeatOrAuto(click.ParamType):
    """compare's --repeat: a count within its bound, or ``auto`` (sequential A/B pairs, with --max-pairs)."""

    name = "K|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        return count_type("repeat").convert(value, param, ctx)


repeat_option = click.option("--repeat", type=count_type("repeat"), default=None, metavar="K",
                             help="Run each backend K times (same as --set measure.repeat=K); the report shows "
                                  "the median and the spread, and flags a contrast within the noise.")
as_option = click.option(
    "--as", "comparison", type=click.Choice(["like-for-like", "published"]), default=None,
    help="Which comparison: like-for-like (the recipe's default: one algorithm on both sides, the framework "
         "comparison) or published (each side with the mechanisms its own benchmark script ran, from the recipe's "
         "published-settings file; every value shown with its source). Same as --set comparison=...")
force_option = click.option("--force", is_flag=True,
                            help="Replace runs of other settings (or other recipes) already in the output directory "
                                 "instead of refusing.")
out_option = click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                          help="Directory for run directories and the report (default: runs/<time>-<recipe>).")


def _executor():
    """The --executor of this command (executor_options), or None (here, one run at a time)."""
    ctx = click.get_current_context(silent=True)
    chosen = (ctx.meta if ctx else {}).get("xfw.executor", {})
    from xfw.run.launch import slurm

    if ctx is not None and ctx.params.get("suite"):  # a suite's slurm: section; the command line overrides it
        from xfw.run.commands.suite import SuiteError, suite_slurm

        try:
            chosen = {**suite_slurm(ctx.params["suite"]), **chosen}
        except SuiteError as err:
            raise slurm.SlurmError(str(err)) from None

    if chosen.get("executor", "local") == "local":
        if chosen.get("detach"):
            raise slurm.SlurmError("--detach: only with --executor slurm (a local run has nothing to leave running)")
        return None

    return slurm.SlurmExecutor(slurm.SlurmOptions(
        partition=chosen.get("partition"), account=chosen.get("account"), qos=chosen.get("qos"),
        time_min=chosen.get("time_min"), gpus_per_node=chosen.get("gpus_per_node"),
        cpus_per_task=chosen.get("cpus_per_task"), exclusive=chosen.get("exclusive", True),
        sbatch_args=tuple(chosen.get("sbatch_args", ())), max_queued=chosen.get("max_queued") or 64,
        constraint=chosen.get("constraint"), detach=bool(chosen.get("detach"))), log=_log,
        command=[arg for arg in sys.argv[1:] if arg != "--detach"])


def executor_options(fn):
    """Where the runs go (docs/slurm.md): --executor local|slurm and Slurm's options. They land in the
    click context (not the command's arguments); _finish runs the workflow through that executor."""
    def keep(key):
        def callback(ctx, param, value):
            if value is not None and value != ():
                ctx.meta.setdefault("xfw.executor", {})[key] = value
            return value
        return callback
    options = [
        ("--executor", dict(type=click.Choice(["local", "slurm"]), default=None,
                            help="Where the runs go: here one at a time (default: local, or a suite's slurm.executor), "
                                 "or each run a Slurm job (docs/slurm.md).")),
        ("--partition", dict(default=None, metavar="NAME", help="Slurm partition (default: the cluster's default).")),
        ("--account", dict(default=None, metavar="NAME", help="Slurm account to charge.")),
        ("--qos", dict(default=None, metavar="NAME", help="Slurm quality of service.")),
        ("--time", dict(type=click.IntRange(1), default=None, metavar="MIN",
                        help="Slurm time limit per job in minutes (default: the recipe's measure.timeout_s + 2 min).")),
        ("--gpus-per-node", dict(type=click.IntRange(1), default=None, metavar="N", help="GPUs per node (Slurm).")),
        ("--cpus-per-task", dict(type=click.IntRange(1), default=None, metavar="N", help="CPUs per job (Slurm).")),
        ("--exclusive/--shared", dict(default=None,
                                      help="Whole nodes per job (default: exclusive: a shared node is no measurement).")),
        ("--sbatch-arg", dict(multiple=True, metavar="ARG", help="Extra sbatch argument, e.g. --sbatch-arg=--constraint=h800. Repeatable.")),
        ("--max-queued", dict(type=click.IntRange(1), default=None, metavar="N", help="Jobs in the queue at once (default 64).")),
        ("--constraint", dict(default=None, metavar="FEATURES", help="Node type/features every job asks for (sbatch --constraint).")),
        ("--detach", dict(is_flag=True, default=None, help="Submit the jobs and a report job after them, and return "
                                                           "(Slurm; the same command without --detach attaches).")),
    ]
    keys = ["executor", "partition", "account", "qos", "time_min", "gpus_per_node", "cpus_per_task", "exclusive",
            "sbatch_args", "max_queued", "constraint", "detach"]
    for (flag, kwargs), key in zip(reversed(options), reversed(keys)):
        fn = click.option(flag, key, expose_value=False, callback=keep(key), **kwargs)(fn)
    return fn


def rendezvous_options(fn):
    """Multi-node flags, passed through to the backend's launcher (torchrun, paddle.distributed.launch)."""
    fn = click.option("--master-port", type=int, default=None,
                      help="Rendezvous port of node 0 (default: a free port, single node).")(fn)
    fn = click.option("--master-addr", default="127.0.0.1", show_default=True,
                      help="Address of node 0 for multi-node runs.")(fn)
    fn = click.option("--node-rank", type=int, default=0, show_default=True,
                      help="This node's rank for multi-node runs (parallel.nnodes > 1).")(fn)
    return fn
