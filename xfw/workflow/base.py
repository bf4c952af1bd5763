"""What every workflow shares: the command outcome and the usage error, input checked before
anything launches, reports written, and the guard a command runs under (its lock, SIGTERM).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from xfw.contract import knobs as knob_declaration
from xfw.contract.atomic import write_json_atomic, write_text_atomic
from xfw.report import compare as cmp
from xfw.report import contrast, table
from xfw.report.plot import plot_comparison
from xfw.report import breakdown
from xfw.report.results import RunResult
from xfw.report.table import Page
from xfw.recipe import command
from xfw.run.launch import instances, jobs, launcher, lock
from xfw.recipe.overrides import OVERRIDE, backend_overrides
from xfw.recipe import Recipe, RecipeError, load_recipe
from xfw.recipe.spec import resolve_spec


Log = Callable[[str], None]
class UsageError(ValueError):
    """Bad input found before anything launched; the message is complete."""


@dataclass
class Outcome:
    """What a command produced: text for stdout, files and notes for stderr, an exit code."""

    text: str = ""
    paths: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0


def silent(_line: str) -> None:
    pass


def load_all(paths: list[str], overrides: list[str], *, prepare: bool = True) -> list[Recipe]:
    """Validate every recipe; raise one UsageError listing every problem. Then, unless ``prepare`` is False
    (``xfw validate`` without ``--prepare``), the workflow's data step: each recipe's real data prepared
    (:func:`prepare_all`), before anything launches."""
    recipes, problems = [], []
    for path in paths:
        try:
            recipes.append(load_recipe(path, overrides))
        except RecipeError as err:
            problems.append(str(err))
            continue
        problems += [f"{path}: {problem}" for problem in knob_problems(recipes[-1])]
    if problems:
        raise UsageError("\n".join(problems))
    names = [r.name for r in recipes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(f"two recipes are named {duplicates[0]!r}: run directories would collide")
    if prepare:
        prepare_all(paths, recipes)
    return recipes


def prepare_all(paths: list[str], recipes: list[Recipe]) -> None:
    """Each recipe's real data prepared, or found prepared (``xfw.run.data.prepare_data``, the one writer of the
    data cache, saying on stderr what it prepares); UsageError listing every recipe whose data cannot be used."""
    from xfw.run import data as real

    problems = []
    for path, recipe in zip(paths, recipes):
        try:
            real.prepare_data(recipe)
        except real.DataError as err:
            problems.append(f"{path}: {err}")
    if problems:
        raise UsageError("\n".join(problems))


def knob_problems(recipe: Recipe, root: Path = launcher.PROJECT_ROOT) -> list[str]:
    """Each ``backends.<name>`` checked against its adapter's declaration (``xfw.contract.knobs``:
    ``adapters/*/xfw_<name>/knobs.json``, read as data: no adapter or framework starts). A backend
    that runs a command, or whose adapter declares nothing here, is left to its own checks."""
    problems = []
    for name, knobs in recipe.backends.items():
        adapter = instances.adapter_of(name)  # an instance's knobs are its adapter's (xfw.run.launch.instances)
        found = sorted(root.glob(f"adapters/*/xfw_{adapter}/{knob_declaration.KNOBS_FILE}"))
        if "command" in knobs or not found:
            continue
        knobs = {k: v for k, v in knobs.items() if k != OVERRIDE}  # not a knob: checked as the recipe (xfw.recipe.overrides)
        declared = knob_declaration.read_spec(found[0])
        problem = knob_declaration.check(name, knobs, declared["knobs"], declared["types"])
        if problem:
            problems.append(problem)
    return problems


def data_summary(recipe: Recipe) -> str:
    """One line on a recipe's real data (``xfw validate``): samples, lengths and where it is when prepared, else
    that it is not (nothing is written here)."""
    from xfw.contract import presets
    from xfw.run import data as real

    arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
    found, directory = real.find_prepared(recipe, arch)
    if found is None:
        return f"data: not prepared (checked; xfw validate --prepare writes it to {directory})"
    data = {"stats": found["stats"], "prepared": found["directory"]}
    stats = data["stats"]
    text = f"data: {stats['num_samples']} samples, {stats['num_images']} images"
    if stats.get("max_seq_len"):
        text += (f", sequence length mean {stats['mean_seq_len']:.1f} / max {stats['max_seq_len']} "
                 f"({stats['truncated']} cut at data.seq_len), template {stats['template']}")
    return f"{text}; prepared in {data['prepared']}"


def prepare_backends(names: list[str], interpreters: dict[str, str], recipes: list[Recipe] = (),
                     log: Log = silent, *, runs: list[str] | None = None) -> jobs.Backends:
    """Resolve and describe each backend (fails fast, before any launch). A backend that runs a
    command in every one of ``recipes`` needs no interpreter and no description (xfw.recipe.command)."""
    if not names:
        raise UsageError("no backends given")
    for recipe in recipes:  # ``runs``: the backends the command's recipes are for, when ``names`` is a part of them
        refuse_stray_overrides(recipe, runs or names)
    stray = sorted(set(interpreters) - set(names))
    if stray:
        raise UsageError(f"--python {stray[0]}=...: {stray[0]!r} is not a backend of this command "
                         f"(it runs {', '.join(names)})")
    out, problems = {}, []
    for name in names:
        if command.is_command(list(recipes), name):
            if name in interpreters:
                problems.append(f"--python {name}=...: backend {name!r} runs the recipe's command "
                                f"(backends.{name}.command), not an interpreter; set the command's first item instead")
            out[name] = (launcher.Backend(name, ""), {"command": True})
            continue
        adapter = instances.adapter_of(name)
        known = instances.known_adapters()
        if adapter != name and adapter not in known and name not in interpreters:
            problems.append(f"--backends {name}: unknown adapter {adapter!r} before the @ (known: {', '.join(known)})")
            continue
        if adapter != name and command.is_command(list(recipes), adapter):
            problems.append(f"--backends {name}: backends.{adapter} runs a command (backends.{adapter}.command); "
                            "an instance of it has no environment of its own to run")
            continue
        try:
            build = _built_instance(name, interpreters, log)
            backend = launcher.resolve_backend(name, {**interpreters, **build.get("python", {})})
            description = launcher.describe_backend(backend)
        except (launcher.BackendError, instances.InstanceError) as err:
            problems.append(str(err))
            continue
        if adapter != name and description.get("backend", adapter) != adapter:  # an instance's interpreter
            problems.append(f"--backends {name}: {backend.python} runs the {description.get('backend')!r} "
                            f"adapter's framework, not {adapter!r}'s (xfw_{adapter} imports there but describes "
                            f"itself as {description.get('backend')!r})")
            continue
        out[name] = (backend, {**description, "build": build_facts(name, backend.python, description,
                                                                   build.get("record"))})
    if problems:
        raise UsageError("\n".join(problems))
    return out


def _built_instance(name: str, interpreters: dict[str, str], log: Log) -> dict:
    """An instance xfw builds (``paddle@3.2.0``, or a wheel given as ``paddle@L=/w/x.whl``): its environment,
    built once (progress on ``log``); ``{"python": {name: interpreter}, "record": xfw-build.json}``."""
    if "@" not in name:
        return {}
    given = interpreters.get(name, "")
    instance = instances.parse(f"{name}={given}" if given.endswith(".whl") else name) if not given or \
        given.endswith(".whl") else None
    if instance is None or not instance.built:
        return {}
    python = instances.ensure_env(instance, log)
    return {"python": {name: str(python)}, "record": instances.read_build(python.parent.parent)}


def build_facts(name: str, python: str, description: dict, record: dict | None) -> dict:
    """What every report names a backend's build by: framework version, its git commit (where the build
    records one), the wheel's sha256 (where xfw built the environment), where it came from."""
    default = launcher.PROJECT_ROOT / ".venv" / name / "bin" / "python"
    source = (record or {}).get("source") or (f"the default environment (.venv/{name})"
                                              if Path(python) == default else f"interpreter {python}")
    return {"framework_version": description.get("framework_version"), "commit": description.get("framework_commit"),
            "wheel_sha256": (record or {}).get("wheel_sha256"), "source": source}


def refuse_stray_overrides(recipe: Recipe, backend_names: list[str]) -> None:
    """A backend's override (``backends.<name>.override``) that this command would not apply is refused
    in one line: a misspelt name, or a backend left out of ``--backends``, would be silently ignored. An
    adapter's override reaches its instances (``backends.paddle.override`` for ``paddle@3.2.0``)."""
    reached = set(backend_names) | {instances.adapter_of(b) for b in backend_names}
    for name in backend_overrides(recipe):
        if name not in reached:
            raise UsageError(f"{recipe.name}: backends.{name}.{OVERRIDE}: {name!r} is not a backend of this command "
                             f"(--backends {','.join(backend_names)}); the override would change nothing")


def refuse_unknown_overrides(recipe: Recipe, root: Path = launcher.PROJECT_ROOT) -> None:
    """``xfw validate`` (no backends given): an override of a backend that is no adapter xfw has (nor an
    instance of one, nor a command) is refused in one line: misspelt, it would change nothing."""
    known = instances.known_adapters(root)
    for name in backend_overrides(recipe):
        if instances.adapter_of(name) not in known and "command" not in recipe.backends.get(name, {}):
            raise UsageError(f"{recipe.name}: backends.{name}.{OVERRIDE}: {name!r} is no backend xfw has (adapters: "
                             f"{', '.join(known)}); misspelt? the override would change nothing")


def refuse_commands(recipe: Recipe, backend_names: list[str], why: str) -> None:
    attached = [name for name in backend_names if command.command_of(recipe, name) is not None]
    if attached:
        raise UsageError(f"{recipe.name}: backends.{attached[0]}.command: {why}; use compare, sweep or nightly")


def recipe_error(fn, *args):
    try:
        return fn(*args)
    except ValueError as err:  # RecipeError included: one line naming the file and key
        raise UsageError(str(err)) from None


def write_page(page: Page, out_dir: Path, stem: str = "report") -> Outcome:
    """``stem``.md, .csv and .html in ``out_dir`` from one page; the terminal gets it without images.
    A file that cannot be written (a full disk) is named in the notes, with exit code 1."""
    outcome = Outcome(text=table.to_markdown(page, images=False))
    renderers = {"markdown": (f"{stem}.md", table.to_markdown), "csv": (f"{stem}.csv", table.to_csv),
                 "html": (f"{stem}.html", table.to_html)}
    for kind, (name, render) in renderers.items():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out_dir / name, render(page))
            outcome.paths[kind] = out_dir / name
        except OSError as err:
            outcome.notes.append(f"could not write {out_dir / name}: {err.strerror or err} (the report is printed above)")
            outcome.exit_code = 1
    return outcome


PARITY_STATUS_FILE = "parity-status.json"
"""Each recipe's parity status as a compare looked it up, beside its runs (read back by ``xfw report``)."""


def read_parity_status(directory: Path) -> dict[str, dict] | None:
    """The parity statuses a compare wrote into ``directory`` (:data:`PARITY_STATUS_FILE`); None without
    one, or where it cannot be read as recipe -> status."""
    from xfw.contract.atomic import UnreadableFile, read_json_object

    try:
        parity = read_json_object(directory / PARITY_STATUS_FILE).get("parity")
    except (UnreadableFile, OSError, ValueError):
        return None
    if not isinstance(parity, dict) or not all(isinstance(v, dict) and isinstance(v.get("status"), str)
                                               for v in parity.values()):
        return None
    return parity


def write_report(results: list[RunResult], backends: list[str], out_dir: Path, *, chart: bool = True,
                 parity: dict[str, dict] | None = None, warnings: list[str] = (), ab: bool | float = False) -> Outcome:
    """report.md/csv/html and chart.png; ``parity`` (recipe name -> status) adds the parity lines;
    ``ab``: the A/B verdict of the first two backends per recipe under the table, and ab.json.
    Exit code 1 when any run is not ok."""
    rows = cmp.compare_runs(results, backends, parity=parity)
    if parity is not None:  # kept beside the runs: ``xfw report`` on them shows the same parity lines
        try:
            write_json_atomic(out_dir / PARITY_STATUS_FILE, {"schema": 1, "parity": parity})
        except OSError:
            pass  # the lines are in this report itself
    extra = ab_blocks(results, backends, out_dir, rows, ab) if ab and len(backends) > 1 else []
    try:
        chart_path = plot_comparison(rows, backends, out_dir / "chart.png") if chart else None
    except OSError as err:
        chart_path, problem = None, f"could not write {out_dir / 'chart.png'}: {err.strerror or err}"
    else:
        problem = ""
    page = contrast.contrast_page(rows, backends, chart=chart_path, warnings=list(warnings), extra=extra)
    page.blocks = breakdown.insert_blocks(page.blocks, breakdown.breakdown_blocks(rows, backends, out_dir if chart else None))
    outcome = write_page(page, out_dir)
    if chart_path is not None:
        outcome.paths["chart"] = chart_path
        if any(isinstance(b, table.Image) and b.path.name == "breakdown.png" for b in page.blocks):
            outcome.paths["breakdown"] = out_dir / "breakdown.png"
    if problem:
        outcome.notes.append(problem)
        outcome.exit_code = 1
    return judge_runs(outcome, results)


def ab_blocks(results: list[RunResult], backends: list[str], out_dir: Path, rows=(), ab: bool | float = True) -> list:
    """Each recipe's A/B of ``backends[0]`` against ``backends[1]`` (xfw.report.ab) as a paragraph;
    written to ab.json beside the report (a program reads the verdicts there). ``ab``: True, or the
    ``--margin`` (a float); each row's contrast cell is set from the same decision (``ab_cell``)."""
    from xfw.report.ab import MARGIN, ab_from_results
    from xfw.report.table import Paragraph

    margin = MARGIN if ab is True else float(ab)
    verdicts, blocks = [], []
    for recipe in dict.fromkeys(r.recipe for r in results):
        found = ab_from_results([r for r in results if r.recipe == recipe], backends[0], backends[1], margin=margin)
        for row in rows:
            if row.recipe == recipe:
                row.ab_cell = found.cell()
        verdicts.append({"recipe": recipe, **found.to_dict(), "text": found.text()})
        blocks.append(Paragraph(f"**{recipe}: {found.text()}**"))
    try:
        write_json_atomic(out_dir / "ab.json", {"schema": 1, "verdicts": verdicts})
    except OSError:
        pass  # the verdicts are in the report itself
    return blocks


def not_applicable(r: RunResult) -> bool:
    """A sweep point (a run with a variant) its backend refused as ``unsupported`` (stage 1 on one
    process: nothing to shard): a combination that cannot run here by construction, shown in the
    report with its reason, not a failure of the sweep. A plain run asked for is judged as any other."""
    return r.status == "unsupported" and bool(r.variant)


def judge_runs(outcome: Outcome, results: list[RunResult]) -> Outcome:
    """Exit code 1 (and a note) when any run is not ok: failed, unreadable or incomplete; sweep
    points that are not applicable (:func:`not_applicable`) are noted, never a failure."""
    skipped = [r for r in results if not_applicable(r)]
    if skipped:
        outcome.notes.append(f"{len(skipped)} of {len(results)} sweep points are not applicable here (unsupported: "
                             "the report gives each reason), not failures")
    failed = [r for r in results if not r.ok and not not_applicable(r)]
    if failed:
        outcome.notes.append(f"{len(failed)} of {len(results)} runs did not succeed (their status is in the report)")
        outcome.exit_code = 1
    return outcome


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def guarded(out_dir: Path, node_rank: int | None = None) -> Iterator[None]:
    """While a command runs jobs: its output directory locked (per node for one node of a multi-node
    run), SIGTERM handled as Ctrl-C (the running adapter is stopped and recorded as cut off), and a
    refused job reported as bad input."""
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with lock.hold(out_dir, node_rank=node_rank):
            yield
    except (lock.LockedError, jobs.JobError) as err:
        raise UsageError(str(err)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def refuse_foreign(out_dir: Path, recipes: list[Recipe], force: bool) -> None:
    others = [] if force else jobs.foreign_recipes(out_dir, [r.name for r in recipes])
    if others:
        raise UsageError(f"{out_dir} already holds runs of {others[0]}"
                         + (f" and {len(others) - 1} other recipe(s)" if len(others) > 1 else "")
                         + "; choose another --out, or pass --force (its report will then show only this command's runs)")


def interrupted(outcome: Outcome) -> Outcome:
    outcome.notes.append("interrupted: finished runs are kept; the report above shows them")
    outcome.exit_code = 130
    return outcome


_HOST = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def check_rendezvous(rendezvous: launcher.Rendezvous) -> None:
    """--master-port is a TCP port; --master-addr an IP address or a host name this host resolves:
    checked before anything launches, not found by torchrun after a crash or its rendezvous timeout."""
    port, addr = rendezvous.master_port, rendezvous.master_addr
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--master-port {port}: a TCP port is 1..65535")
    try:
        ipaddress.ip_address(addr)
        return
    except ValueError:
        pass
    if not _HOST.fullmatch(addr):
        raise UsageError(f"--master-addr {addr!r}: not an IP address or a host name")
    try:
        socket.getaddrinfo(addr, port or 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise UsageError(f"--master-addr {addr!r}: this host cannot resolve it ({getattr(err, 'strerror', None) or err})") \
            from None


def check_node(recipes: list[Recipe], rendezvous: launcher.Rendezvous) -> None:
    """The rendezvous flags fit the recipes: a node rank inside parallel.nnodes, one port for all nodes,
    a port and an address that can be (:func:`check_rendezvous`)."""
    check_rendezvous(rendezvous)
    for recipe in recipes:
        nnodes = recipe.parallel.nnodes
        if not 0 <= rendezvous.node_rank < nnodes:
            raise UsageError(f"--node-rank {rendezvous.node_rank}: {recipe.name} runs on parallel.nnodes = {nnodes} "
                             f"node(s), so the rank is 0" + (f"..{nnodes - 1}" if nnodes > 1 else ""))
        if nnodes > 1 and rendezvous.master_port is None:
            raise UsageError(f"{recipe.name}: parallel.nnodes = {nnodes} needs --master-port (the same on every node)")


def one_node(recipes: list[Recipe], command: str) -> None:
    multi = next((r for r in recipes if r.parallel.nnodes > 1), None)
    if multi is not None:
        raise UsageError(f"{multi.name}: parallel.nnodes = {multi.parallel.nnodes}: xfw {command} runs on one node; "
                         "run each node with xfw run or compare --node-rank R (docs/multinode.md)")
