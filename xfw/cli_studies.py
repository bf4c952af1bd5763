"""The commands that run many runs to answer one question — ``parity``, ``converge``, ``bisect``, ``nightly``,
``selfcheck`` — as thin click commands over :mod:`xfw.workflow`, registered on :func:`xfw.cli.main` (which
imports this module; nothing here imports it back).
"""

from __future__ import annotations

from pathlib import Path

import click

from xfw.cliargs import (_backend_list, _backend_names, _fail, _finish, _interpreters, _log, _pairs, _progress,
                         _with_repeat, as_option, count_type, executor_options, force_option, launcher,
                         pairs_type, python_option, rendezvous_options, set_option, workflow)


@click.command()
@click.argument("recipe", type=click.Path())
@click.option("--backends", default="paddle,torch", show_default=True,
              help="REFERENCE,OTHER: the reference exports the starting weights both sides load.")
@click.option("--steps", type=count_type("steps"), default=10, show_default=True, help="Training steps to compare.")
@set_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for the weights, both runs and parity.json (default: runs/parity-<recipe>).")
@click.option("--weights", "weights", multiple=True, metavar="NAME=DIR",
              help="Start backend NAME from DIR (a model.safetensors directory, e.g. the shared export with one "
                   "weight changed) instead of the shared export: checks that parity finds the difference. Repeatable.")
@force_option
def parity(recipe, backends, steps, overrides, pythons, out_dir, weights, force) -> None:
    """Train both backends from the same weights on the same batches (fp32, CPU-exact) and
    compare the loss and the gradient norm per step; exit 1 when a step is outside tolerance. A
    failing run names the first module whose output differs on the first batch, or says why none."""
    _finish(lambda: workflow.parity(recipe, _backend_names(backends), steps=steps, overrides=list(overrides),
                                    interpreters=_interpreters(pythons, backends), out_dir=out_dir, force=force,
                                    weights=_pairs("--weights", weights, "--weights paddle=runs/changed")))


@click.command()
@click.argument("recipe", type=click.Path())
@click.option("--backends", default="paddle,torch", show_default=True,
              help="OTHER,REFERENCE, as compare orders them: contrasts are the first side against the second, the "
                   "reference, which exports each seed's start and whose mean final eval loss is the default target.")
@click.option("--seeds", default="3", show_default=True, metavar="N|auto",
              help="Seeds per side (the same list on both): each varies the start and the batch order. auto: start "
                   "at 2 and add one at a time until decided (needs --max-seeds).")
@click.option("--max-seeds", "max_seeds", type=int, default=None, metavar="N",
              help="Sequential: add seeds one at a time, from --seeds, until the final eval loss is decided or N seeds "
                   "ran; alpha is spent across the looks so the error rate holds.")
@click.option("--margin", default="0.02", show_default=True, metavar="DELTA",
              help="Relative eval-loss margin: final eval losses within ±DELTA (0.02 = 2%) count as the same "
                   "(docs/converge.md says why 2%).")
@click.option("--direction", default="two-sided", show_default=True, metavar="two-sided|SIDE-worse",
              help="two-sided (is either side worse?), or e.g. torch-worse: only ask whether that side's eval loss "
                   "is worse (one-sided, as MLPerf asks whether quality was lost).")
@click.option("--steps", type=count_type("steps"), default=300, show_default=True,
              help="Optimizer steps each seed trains.")
@click.option("--eval-every", "eval_every", type=count_type("eval_every"), default=25, show_default=True,
              help="Evaluate the held-out split every K steps (and before the first, and after the last).")
@click.option("--eval-samples", "eval_samples", type=count_type("eval_samples"), default=None,
              help="Samples held out (default: the recipe's data.eval_samples, else 10% of the data set).")
@click.option("--target", type=float, default=None, metavar="LOSS",
              help="The eval loss to reach (default: the reference side's mean final eval loss).")
@set_option
@as_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for every run, the starts and converge.* (default: runs/converge-<recipe>); the same "
                   "--out resumes a killed converge.")
@force_option
@executor_options
def converge(recipe, backends, seeds, max_seeds, margin, direction, steps, eval_every, eval_samples, target,
             overrides, comparison, pythons, out_dir, force) -> None:
    """Speed at equal quality: both sides train the recipe as it says (its precision and parallel settings)
    for several seeds from one exported start per seed, on identical batches, evaluating a held-out split
    every K steps; then a paired decision on the final eval loss (same within --margin, worse, or undecided
    with the seeds it would need; alpha 0.05) and each side's time to a target eval loss from its measured
    ips. docs/converge.md."""
    _finish(lambda: workflow.converge(recipe, _backend_names(backends), seeds=seeds, steps=steps, eval_every=eval_every,
                                      eval_samples=eval_samples, target=target, max_seeds=max_seeds, margin=margin,
                                      direction=direction,
                                      overrides=_with_repeat(overrides, None, comparison),
                                      interpreters=_interpreters(pythons, backends), out_dir=out_dir, force=force,
                                      progress=_progress(), log=_log))


@click.command()
@click.argument("recipe", type=click.Path())
@click.option("--builds", "builds_path", required=True, type=click.Path(), metavar="FILE",
              help="The builds in order, one a line as --backends writes them: paddle@3.2.0, "
                   "paddle@nightly-1102=/opt/nightly-1102/bin/python (# starts a comment).")
@click.option("--good", required=True, metavar="NAME", help="A build without the change (ADAPTER@LABEL, a line of FILE).")
@click.option("--bad", required=True, metavar="NAME", help="A later build with it (ADAPTER@LABEL, a line of FILE).")
@click.option("--repeat", default="5", show_default=True, metavar="N|auto",
              help="Alternated pairs per judgement, at least 3; auto: start at 3 and add 3 at a time until decided "
                   "(needs --max-pairs).")
@click.option("--max-pairs", "max_pairs", type=pairs_type(), default=None, metavar="N",
              help="The most pairs one judgement may spend (with --repeat auto; alpha is spent across its looks).")
@click.option("--margin", default="0.05", show_default=True, metavar="DELTA",
              help="Relative ips margin: a build within ±DELTA (0.05 = 5%) of another counts as the same "
                   "(docs/builds.md says why 5%).")
@set_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for every A/B and bisect.* (default: runs/bisect-<recipe>); the same --out resumes.")
@force_option
@executor_options
def bisect(recipe, builds_path, good, bad, repeat, max_pairs, margin, overrides, out_dir, force) -> None:
    """Find the first build with a change, never naming a wrong one: judge the bad build against the good
    one, then the build halfway between, against both ends, until they meet; confirm the last pair with an
    A/B of its own, or report the range it could not split. Each judgement: paired t interval of log ratios
    with --margin, pairs added while undecided (--repeat auto). docs/builds.md."""
    _finish(lambda: workflow.bisect(recipe, builds_path, good=good, bad=bad, overrides=list(overrides), repeat=repeat,
                                    max_pairs=max_pairs, margin=margin,
                                    out_dir=out_dir, force=force, progress=_progress(), log=_log))


@click.command()
@click.argument("suite", type=click.Path())
@click.option("--history", "history_dir", type=click.Path(path_type=Path), required=True,
              help="History directory: history.jsonl, nights/<night>/..., report.html (created if missing).")
@click.option("--night", default=None, metavar="ID",
              help="Night id (default: resume this suite's unfinished night, else today's UTC date).")
@set_option
@as_option
@python_option
@click.option("--backends", "only_backends", default=None, metavar="A,B",
              help="Run only these of the suite's backends (e.g. torch on a node without a Paddle GPU build).")
@click.option("--report-only", is_flag=True, help="Run nothing: rewrite the night's report from what is recorded.")
@rendezvous_options
@executor_options
def nightly(suite, history_dir, night, overrides, comparison, only_backends, pythons, report_only, node_rank,
            master_addr, master_port) -> None:
    """Run a suite, add it to the history, flag regressions against earlier nights, write report.html.

    Exit 0: no regression; 1: a regression or a failed run (listed first in the report); 2: bad input.
    Killed at any moment, the same command resumes the night and keeps every finished run."""
    _finish(lambda: workflow.nightly(
        suite, history_dir, night=night, overrides=_with_repeat(overrides, None, comparison), report_only=report_only,
        only_backends=_backend_names(only_backends) if only_backends is not None else None,
        interpreters=_interpreters(pythons, only_backends), rendezvous=launcher.Rendezvous(node_rank, master_addr, master_port),
        progress=None if report_only else _progress(), log=_log))


@click.command()
@click.option("--backends", default="paddle,torch", show_default=True, help="Comma-separated backends to check.")
@click.option("--families", default=None, metavar="F1,F2,...",
              help="Model families, each through its tiny recipe (default: llava, about 5 minutes on 2 cores; "
                   "--full: llava,qwen2vl,sd15,sd3).")
@click.option("--full", is_flag=True, default=False,
              help="Every family (llava, qwen2vl, sd15, sd3), about 4x the quick default's time.")
@click.option("--paths", default=None, metavar="P1,P2,...",
              help="Settings paths (default: all): fp32, bf16-o1, bf16-o2, fp16-o2, recompute, attention-eager, "
                   "stage2, stage3.")
@as_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Where the runs and selfcheck.json go (default: runs/selfcheck, where compare looks).")
@executor_options
def selfcheck(backends, families, full, paths, comparison, pythons, out_dir) -> None:
    """The first command on a new machine: check every settings path the seed rows use, on every
    backend, and say which work here; compare warns about runs through unchecked paths. The default
    checks one family (LLaVA, about 5 minutes on 2 cores); --full checks all four."""
    from xfw.report.selfcheck import BY_NAME
    from xfw.run.commands.selfcheck import FAMILY_RECIPES, QUICK_FAMILIES

    if full and families:
        _fail("--full checks every family: give it or --families, not both")
    chosen = ",".join(FAMILY_RECIPES) if full else families or ",".join(QUICK_FAMILIES)
    _finish(lambda: workflow.selfcheck(
        _backend_names(backends), families=_backend_list(chosen),
        paths=_backend_list(paths) if paths else list(BY_NAME), interpreters=_interpreters(pythons, backends),
        out_dir=out_dir, progress=_progress(), log=_log, comparison=comparison))


COMMANDS = (parity, converge, bisect, nightly, selfcheck)
