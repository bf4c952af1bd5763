"""The ``xfw`` command line: a thin click shell over :mod:`xfw.workflow`. Each command parses its
options, makes one workflow call, prints the outcome and exits with its code::

    xfw validate recipes/tiny/llava_sft.yaml
    xfw run recipes/tiny/llava_sft.yaml --backend torch
    xfw compare recipes/tiny/llava_sft.yaml --backends paddle,torch
    xfw sweep recipes/tiny/llava_sft.yaml --set batch.micro=1,2 --set recompute=false,true --backends torch
    xfw maxbatch recipes/llava7b_lora.yaml --backends torch --candidates 64,32,16
    xfw estimate recipes/llava7b_lora.yaml
    xfw report runs/sweep-tiny-llava-sft --layout scaling
    xfw parity recipes/tiny/llava_sft.yaml --steps 10
    xfw nightly suites/cpu_smoke.yaml --history runs/nightly
    xfw env

Exit codes: 0 success; 1 a run failed (its result and the others are still written), or a
regression (nightly) or a step outside tolerance (parity); 2 bad input, found before anything
launched; 130 interrupted.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from xfw import terminal
from xfw.cliargs import (RepeatOrAuto, LAYOUT_NAMES, _backend_list, _backend_names, _fail, _finish, _interpreters, _log, _one_backend,
                         _progress, _with_repeat, as_option, force_option, launcher, out_option, overrides_of,
                         python_option, rendezvous_options, repeat_option, set_option, workflow, count_type, _instances,
                         executor_options, pairs_type)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="xfw")
def main() -> None:
    """Compare one training recipe across frameworks: throughput, memory, settings."""
    # SIGTERM (cron's timeout, Slurm) is Ctrl-C from the start: a preparation it cuts removes its
    # temporary directory and the command says so and exits 130 (workflow.guarded keeps it during runs).
    terminal.sigterm_is_interrupt()


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@set_option
@click.option("--print-spec", is_flag=True, help="Print the resolved spec (every default filled in) as JSON.")
@click.option("--prepare", is_flag=True, help="Also prepare each recipe's real data (the step every workflow "
              "takes before it launches); without it, validate writes nothing and says whether the data is prepared.")
def validate(recipes, overrides, print_spec, prepare) -> None:
    """Check recipes without launching anything."""
    from xfw.recipe.schema import to_dict

    try:
        loaded = workflow.load_all(list(recipes), list(overrides), prepare=prepare)
        for recipe in loaded:  # a command checks its overrides' backends against --backends; here, the adapters
            workflow.refuse_unknown_overrides(recipe)
    except workflow.UsageError as err:
        _fail(str(err))
    except KeyboardInterrupt:
        terminal.exit_interrupted()
    for path, recipe in zip(recipes, loaded):
        click.echo(f"{path}: ok ({recipe.name}: {recipe.model.preset} {recipe.stage}, "
                   f"global batch {recipe.batch.global_size} = micro {recipe.batch.micro} x "
                   f"{recipe.num_processes} proc x {recipe.grad_accum_steps} accum)")
        if recipe.data.kind != "synthetic":
            click.echo(f"  {workflow.data_summary(recipe)}")
        for line in overrides_of.describe(recipe):  # backends.<name>.override: shown, never silently
            click.echo(f"  {line}")
        if print_spec:
            click.echo(json.dumps(to_dict(recipe), indent=2))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--backend", required=True, help="Backend to run, e.g. torch or paddle.")
@set_option
@as_option
@repeat_option
@python_option
@out_option
@rendezvous_options
@force_option
@click.option("--print-command", is_flag=True,
              help="Print the exact launch command and environment (and write spec.json) without running.")
def run(recipe, backend, overrides, comparison, repeat, pythons, out_dir, node_rank, master_addr, master_port, force,
        print_command) -> None:
    """Run one recipe on one backend and report it."""
    _finish(lambda: workflow.compare(
        [recipe], _one_backend(backend), overrides=_with_repeat(overrides, repeat, comparison),
        interpreters=_interpreters(pythons, backend, "--backend"),
        out_dir=out_dir, rendezvous=launcher.Rendezvous(node_rank, master_addr, master_port),
        print_command=print_command, force=force, progress=None if print_command else _progress(), log=_log))


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends; contrast = (first - second) / second.")
@set_option
@as_option
@click.option("--repeat", type=RepeatOrAuto(), default=None, metavar="K|auto",
              help="Run each backend K times (same as --set measure.repeat=K); the report shows the median and the "
                   "spread, and flags a contrast within the noise. With --ab: K alternated pairs, or auto: start at 3 "
                   "and add 3 at a time until decided (needs --max-pairs).")
@python_option
@out_option
@rendezvous_options
@click.option("--parity", "parity_dirs", multiple=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Where to look for a parity run of the recipe (xfw parity's --out); repeatable. Also searched: "
                   "--out (and one level below) and runs/parity-<recipe>.")
@force_option
@click.option("--explain", is_flag=True, help="After the runs, profile a few steps per side and align them by "
                                              "module and category (explain.md, explain.png; docs/explain.md).")
@click.option("--contrast", default=None, metavar="FIRST:SECOND",
              help="The two backends the contrast (and --ab) is of, e.g. paddle@3.3.1:paddle@3.0.0 "
                   "(default: the first two of --backends).")
@click.option("--ab", is_flag=True,
              help="A/B the contrast's two backends: run them alternately (A B B A ...) --repeat N times and give "
                   "their ratio with a 95% interval, the smallest change N pairs could detect and a verdict "
                   "(paired t-test on log ratios; docs/builds.md).")
@click.option("--margin", default="0.05", show_default=True, metavar="DELTA",
              help="With --ab: a relative ips margin; builds within ±DELTA (0.05 = 5%) count as the same "
                   "(docs/builds.md says why 5%).")
@click.option("--max-pairs", "max_pairs", type=pairs_type(), default=None, metavar="N",
              help="With --ab: sequential pairs: start at --repeat (3 if not given), add 3 at a time until decided "
                   "or N pairs are spent (alpha spent across looks).")
@executor_options
def compare(recipes, backends, overrides, comparison, repeat, pythons, out_dir, node_rank, master_addr, master_port,
            parity_dirs, force, explain, contrast, ab, margin, max_pairs) -> None:
    """Run recipes on several backends, one at a time, and print the contrast table. The settings
    section shows each recipe's parity status: the newest parity.json with the same recipe
    fingerprint in --parity DIR, in --out (or one level below) or in runs/parity-<recipe>."""
    if repeat == "auto" and max_pairs is None:
        raise click.UsageError("--repeat auto adds alternated pairs until decided: give its budget with --max-pairs N")
    if repeat == "auto":
        repeat = None  # sequential: start at 3 pairs (--max-pairs)
    if max_pairs is not None:
        _finish(lambda: workflow.ab_sequential_cli(
            list(recipes), _backend_names(backends), overrides=_with_repeat(overrides, None, comparison), ab=ab,
            repeat=repeat, max_pairs=max_pairs, margin=margin, interpreters=_interpreters(pythons, backends),
            out_dir=out_dir, force=force, progress=_progress(), log=_log))
        return
    _finish(lambda: workflow.compare(
        list(recipes), _backend_names(backends), overrides=_with_repeat(overrides, repeat, comparison),
        interpreters=_interpreters(pythons, backends), out_dir=out_dir,
        rendezvous=launcher.Rendezvous(node_rank, master_addr, master_port), parity_dirs=list(parity_dirs),
        force=force, progress=_progress(), log=_log, explain=explain, ab=ab and workflow.ab_margin(margin),
        contrast=contrast))


@main.command(name="explain")
@click.argument("recipe", type=click.Path(), required=False)
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends; the gap = first - second.")
@set_option
@as_option
@repeat_option
@python_option
@out_option
@force_option
@click.option("--categories", is_flag=True, help="Print how operators are put into categories (the map both "
                                                 "sides share) and exit; no RECIPE needed.")
def explain_command(recipe, backends, overrides, comparison, repeat, pythons, out_dir, force, categories) -> None:
    """Compare RECIPE, then explain the gap: each side profiles a few steps after its measured window
    (module hooks, the framework's profiler) and the report aligns them by canonical module name and
    by category, with a waterfall of the step-time difference (docs/explain.md)."""
    if categories:  # whatever else was given is checked as the command would (one line, exit 2), then the map
        from xfw.contract.explain import category_rules

        _interpreters(pythons, backends)  # the list parsed, every instance's path checked
        from xfw.run.launch.instances import known_adapters

        known = known_adapters()
        unknown = [i.name for i in _instances(backends) if i.adapter not in known]
        if unknown:
            _fail(f"--backends {unknown[0]}: no adapter of that name (known: {', '.join(known)})")
        if recipe is not None:
            try:
                workflow.load_all([recipe], _with_repeat(overrides, repeat, comparison))
            except workflow.UsageError as err:
                _fail(str(err))
        click.echo(category_rules())
        return
    if recipe is None:
        raise click.UsageError("Missing argument 'RECIPE' (or --categories).")
    _finish(lambda: workflow.compare(
        [recipe], _backend_names(backends), overrides=_with_repeat(overrides, repeat, comparison),
        interpreters=_interpreters(pythons, backends), out_dir=out_dir, force=force, progress=_progress(), log=_log,
        explain=True))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--set", "axes", multiple=True, metavar="KEY.PATH=V1,V2,...",
              help="A swept recipe field and its values (YAML; commas inside [] or quotes do not split). "
                   "Repeatable: the sweep is the cartesian product.")
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends, each run at every point.")
@as_option
@repeat_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Sweep directory (default: runs/sweep-<recipe>); the same --out resumes, skipping finished runs.")
@force_option
@executor_options
def sweep(recipe, axes, backends, comparison, repeat, pythons, out_dir, force) -> None:
    """Run a recipe at every combination of --set values, one run at a time; resumable (both comparisons
    at once: --set comparison=like-for-like,published)."""
    _finish(lambda: workflow.sweep(
        recipe, list(axes), _backend_names(backends), fixed=_with_repeat((), repeat, comparison),
        interpreters=_interpreters(pythons, backends), out_dir=out_dir, force=force, progress=_progress(), log=_log))


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--backends", "backends", default="paddle,torch", show_default=True,
              help="Comma-separated backends, searched one after the other.")
@click.option("--candidates", default=None, metavar="M1,M2,...",
              help="Micro-batches to try, largest first, stopping at the first that fits "
                   "(default: double from the recipe's micro-batch until out of memory).")
@click.option("--max-micro", type=count_type("max_micro"), default=4096, show_default=True,
              help="Largest micro-batch a doubling search tries.")
@set_option
@python_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for the probes' run directories (default: runs/maxbatch-<recipe>); the same --out "
                   "resumes, keeping settled probes.")
@force_option
@executor_options
def maxbatch(recipe, backends, candidates, max_micro, overrides, pythons, out_dir, force) -> None:
    """Find the largest micro-batch that fits, per backend; each probe a separate process."""
    _finish(lambda: workflow.maxbatch(
        recipe, _backend_names(backends), overrides=list(overrides), candidates=candidates, max_micro=max_micro,
        interpreters=_interpreters(pythons, backends), out_dir=out_dir, force=force, progress=_progress(), log=_log))


@main.command()
@click.argument("recipe", type=click.Path(), required=False)
@set_option
@click.option("--run", "run_dir", type=click.Path(), default=None,
              help="Estimate this run directory's own spec and print what it measured beside the estimate.")
def estimate(recipe, overrides, run_dir) -> None:
    """Predict memory per GPU before running: model states by sharding and precision, activations."""
    _finish(lambda: workflow.estimate(recipe, list(overrides), run_dir))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--backends", default=None, help="Comma-separated backends and their order (default: as found).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Where report.md/.csv/.html (report-<layout>.*) go (default: the first directory given, "
                   "replacing its report).")
@click.option("--layout", type=click.Choice(LAYOUT_NAMES), default="contrast", show_default=True,
              help="contrast: the backends side by side (ips, contrast, memory, parameters, settings); "
                   "strategies: per process (GPU) count, each framework's sharding strategies with step time, "
                   "batches/s and memory; ranks: each rank's measured time and memory, and the final loss; batch: "
                   "throughput per global batch size, out-of-memory sizes kept; scaling: throughput per process "
                   "count and its efficiency against the smallest; cost: the cost of 1M samples at "
                   "--price-per-gpu-hour.")
@click.option("--price-per-gpu-hour", type=float, default=None, metavar="USD",
              help="Price of one GPU-hour, for --layout cost.")
def report(run_dirs, backends, out_dir, layout, price_per_gpu_hour) -> None:
    """Rebuild a report (table, CSV, HTML; chart for contrast) from existing run directories."""
    _finish(lambda: workflow.report(list(run_dirs), _backend_list(backends) if backends else None, out_dir,
                                    layout=layout, price_per_gpu_hour=price_per_gpu_hour))


@main.command()
@click.argument("node_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Where the assembled runs and their report go (may be one of the node directories).")
@force_option
def assemble(node_dirs, out_dir, force) -> None:
    """Assemble multi-node runs from the directories each node wrote (its --out): every rank's records,
    the global throughput, a per-rank table. On a shared --out the nodes assemble their runs themselves."""
    _finish(lambda: workflow.assemble(list(node_dirs), out_dir, force=force))


@main.command(name="env")
@click.option("--backends", default=None,
              help="Backends to describe (instances too: paddle@3.2.0 builds its environment first; default: "
                   "paddle, torch and every other adapter whose .venv/NAME exists, e.g. jax).")
@python_option
@click.option("--remove", "remove", default=None, metavar="NAME",
              help="Delete the built environment of instance NAME (e.g. paddle@3.2.0) and say what it freed.")
@click.option("--clean", is_flag=True, help="Remove what builds killed midway left (their .NAME.building-PID "
                                            "directories) and say what it freed.")
def env_command(backends, pythons, remove, clean) -> None:
    """Show each backend's interpreter, whether its adapter imports, its versions and build, and the
    environments xfw has built for instances (docs/builds.md)."""
    if clean:
        _finish(lambda: workflow.clean_envs())
    if remove is not None:
        _finish(lambda: workflow.remove_env(remove))
    from xfw.run.launch.instances import env_backends

    names = _backend_names(backends) if backends is not None else env_backends()
    _finish(lambda: workflow.describe_backends(names, _interpreters(pythons, backends), log=_log))


from xfw import cli_studies  # noqa: E402  (registered below; it never imports this module)

for _command in cli_studies.COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":
    main()
