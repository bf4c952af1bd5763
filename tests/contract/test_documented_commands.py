"""Every CPU command written in README.md and docs/*.md works as written (issue 24).

The fenced ``bash`` blocks are read, continuation lines joined and comments dropped; each ``xfw``
command is run in a scratch directory that links the repository's files (so ``runs/...`` and the
commands' default output directories land there, shared by the commands in document order: ``xfw
report runs/demo`` reads what make demo's compare wrote). Commands that train (and ``xfw
explain``, which trains that window before its profiled steps) get ``--set measure.warmup_steps=1 --set
measure.steps=2`` appended (how long the window is does not change what the command does). A command
that cannot run here is skipped with the reason, and the skipped list is printed: a GPU-sized model, a
dataset or checkpoint path that does not exist, a placeholder, several nodes, a file that is the user's
own, or ``make`` (its compare is run as the README says it runs it). Each must exit 0, or the code its
document gives. A command another contract test already runs as written (its own --out, a window of a
few steps) is not run twice (:data:`COVERED`, checked against that test's source), and one written in
two documents (``xfw env`` and ``.venv/torch/bin/xfw env``) runs once. Counts that only repeat a path
run at their smallest: ``--repeat 2`` (the fewest that give a spread; ``--ab`` keeps its 3 pairs). Most
of the time is the frameworks starting (each run is a process that imports Paddle or PyTorch: about 6 s
of CPU each; a converge starts ten), so the commands run as :data:`PARTS` parts that share no ``runs/``
directory (:func:`parts`), each a class: ``--dist loadscope`` spreads them over the workers.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAINING = {"compare", "run", "sweep", "nightly", "converge"}
CHEAP = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=2"]
SELFCHECK_WHY = ("the full selfcheck trains 64 runs (about 9 minutes on 2 cores); tests/contract/test_selfcheck.py "
                 "runs its paths")
BISECT_WHY = ("builds an environment for each Paddle version it visits (its time and size as measured: docs/builds.md, "
              "Built environments) and A/Bs "
              "them; tests/unit/test_builds.py runs a bisect end to end, results/cpu/ab/ records this one")
PRELUDE = [("README.md (make demo)", "xfw compare recipes/tiny/llava_sft.yaml --backends paddle,torch --out runs/demo")]
"""What ``make demo`` runs (README: "runs `xfw compare recipes/tiny/llava_sft.yaml --backends paddle,torch`",
writing runs/demo), before the commands that read runs/demo."""


COVERED = {
    "xfw compare recipes/tiny/llava_sft.yaml --explain":
        ("tests/contract/test_explain_both_backends.py",
         '"compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch", "--explain"'),
    "xfw explain recipes/tiny/llava_sft.yaml":  # the same call (tests/unit/test_cli.py::test_explain_is_compare_...)
        ("tests/contract/test_explain_both_backends.py",
         '"compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch", "--explain"'),
    "xfw parity recipes/tiny/llava_sft.yaml --backends jax,torch --steps 10":
        ("tests/contract/test_jax_adapter.py", '"parity", RECIPE, "--backends", "jax,torch", "--steps", "10"'),
    "xfw compare recipes/tiny/llava_sft.yaml --backends jax,torch":
        ("tests/contract/test_jax_adapter.py", '"compare", RECIPE, "--backends", "jax,torch"'),
    "xfw compare recipes/tiny/llava_sft.yaml --backends jax,torch --set parallel.nproc_per_node=2 --set "
    "parallel.sharding=stage3":
        ("tests/contract/test_jax_adapter.py", ('"compare", RECIPE, "--backends", "jax,torch", "--set", '
                                                '"parallel.nproc_per_node=2"', '"parallel.sharding=stage3", *short')),
    "xfw compare recipes/tiny/llava_sft.yaml --as published":
        ("tests/contract/test_comparisons.py",
         ('"compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch"',
          '_compare(base / "published", "--as", "published")')),
    "xfw compare recipes/tiny/attach_trainer.yaml":
        ("tests/contract/test_attach_real.py",
         ('xfw("compare", f"recipes/tiny/{recipe}.yaml", "--backends", "paddle,torch"',
          '[("attach_trainer", "trainer callback")')),
    "xfw compare recipes/tiny/attach_loop.yaml":
        ("tests/contract/test_attach_real.py",
         ('xfw("compare", f"recipes/tiny/{recipe}.yaml", "--backends", "paddle,torch"',
          '("attach_loop", "optimizer step")]')),
    "xfw converge recipes/tiny/llava_json_sft.yaml --seeds 3 --steps 300 --eval-every 25":
        ("tests/contract/test_converge.py",
         ('RECIPE = "recipes/tiny/llava_json_sft.yaml"', '"--backends", "paddle,torch", "--seeds", "3"',
          '"converge", RECIPE, *COMMON, "--out"')),
    "xfw sweep recipes/tiny/llava_sft.yaml --set parallel.nproc_per_node=1,2 --set parallel.sharding=none,stage2":
        ("tests/contract/test_layouts_real.py",
         '"sweep", "recipes/tiny/llava_sft.yaml", "--set", "parallel.nproc_per_node=1,2", "--set",\n'
         '                        "parallel.sharding=none,stage2", "--backends", "paddle,torch"'),
    **{f"xfw report runs/sweep-demo --layout {layout}{price}":  # each layout rendered from that sweep's directory
       ("tests/contract/test_layouts_real.py",
        ('invoke("report", sweep_dir, "--layout", layout, "--out", out, *extra)', f'"{layout}"', *price_call))
       for layout, price, price_call in [("strategies", "", ()), ("scaling", "", ()), ("ranks", "", ()),
                                         ("cost", " --price-per-gpu-hour 2.5",
                                          ('["--price-per-gpu-hour", PRICE] if layout == "cost"', "PRICE = 2.5"))]},
    "xfw nightly suites/cpu_smoke.yaml --history runs/nightly":  # its first night, its own history
        ("tests/contract/test_nightly_suite.py", 'xfw("nightly", "suites/cpu_smoke.yaml", "--history", history)'),
    "xfw nightly suites/cpu_smoke.yaml --history runs/nightly --report-only":
        ("tests/contract/test_nightly_suite.py",
         'xfw("nightly", "suites/cpu_smoke.yaml", "--history", history, "--report-only")'),
    "xfw compare examples/attach/diffusers_lora.yaml":
        ("tests/contract/test_attach_shapes.py",
         ('RECIPE = ROOT / "examples" / "attach" / "diffusers_lora.yaml"',
          'xfw("compare", RECIPE, "--backends", "paddle,torch", "--out", out / "both")')),
}
"""Documented commands (as :func:`same_command` writes them) that another contract test runs as written (its
own --out or --history, and a measured window of a few steps as this test gives one, or the command's own), with the text of that call in its
source, one string or several that must all be there (checked below, so the coverage cannot silently go): not
run twice. ``xfw explain R`` counts as ``xfw compare R --explain``: the CLI makes the same call for both
(tests/unit/test_cli.py::test_explain_is_compare_with_explain). A converge counts as written with other counts (``--seeds/--steps/--eval-every``, which this test
rewrites to its smallest anyway) and other ``--set`` values: test_converge runs README's converge at 3 seeds
of 80 steps, a smaller learning rate and batch, and asserts on every part of its output."""


def documented_commands() -> list[tuple[str, str]]:
    """(document, command line) for every line of every fenced bash block, in order."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append((doc.name, line))
    return out


def words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def _recipes(argv: list[str]) -> list[Path]:
    return [ROOT / a for a in argv if a.endswith(".yaml") and not a.startswith("-")]


def skip_reason(argv: list[str]) -> str | None:
    """Why a documented command cannot run on this CPU machine, or None."""
    if not argv:
        return "not a command"
    program = argv[0].rsplit("/", 1)[-1]
    if argv[0].endswith("$") or program not in ("xfw",):
        return {"make": "sets up environments / runs the whole suite; make demo's compare runs as written below",
                "source": "activates the environment this test already runs in"}.get(program, "not an xfw command")
    text = " ".join(argv)
    if "--master-addr" in argv or "nnodes=2" in text:
        return "several nodes"
    if re.search(r"\b(RECIPE|HOST|DIR|PATH)\b", text):
        return "a placeholder for the reader's own value"
    if re.search(r"(^|[ =,])/(data|ckpt|opt|shared)/", text):
        return "needs a dataset, checkpoint or interpreter path that does not exist here"
    sub = argv[1] if len(argv) > 1 else ""
    if sub == "selfcheck" and "--families" not in argv:
        return SELFCHECK_WHY
    if sub == "bisect":
        return BISECT_WHY
    full_size = [p for p in _recipes(argv) if "tiny" not in p.parts and p.parent.name in ("recipes",)]
    if full_size and sub in ("compare", "run", "sweep", "maxbatch", "parity"):
        return f"{full_size[0].name}: a full-size model, for GPUs"
    missing = [p for p in _recipes(argv) if not p.exists()]
    if missing:
        return f"{missing[0].name}: the reader's own file, not in this repository"
    if sub == "nightly" and "h800" in text and "--report-only" not in argv:
        return "the seed's 12 full-size rows, for an 8-GPU node"
    if sub == "nightly" and "--report-only" in argv and "h800" in text:
        return "no h800 history here"
    return None


def unwritten_input(argv: list[str], scratch: Path) -> str | None:
    """A report or an assembly of run directories that a skipped command would have written."""
    if len(argv) > 1 and argv[1] in ("report", "assemble"):
        absent = [a for a in argv[2:] if a.startswith("runs/") and not (scratch / a).exists()]
        if absent:
            return f"reads {absent[0]}, which only a skipped command writes"
    return None


def expected_code(argv: list[str]) -> int:
    return 0  # every runnable documented command is documented to succeed here


def runnable(argv: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "xfw.cli", *argv[1:]]
    sub = argv[3]
    if sub in TRAINING | {"explain"} and "--print-command" not in argv and "--report-only" not in argv:
        argv += CHEAP  # explain: the same window, then its few profiled steps
    if sub == "compare" and "--repeat" in argv and "--ab" not in argv:
        argv += ["--repeat", "2"]  # the fewest that give a median and spread (an A/B needs its 3 pairs)
    if sub == "parity":
        argv += ["--steps", "2"]  # the last --steps counts: two steps already compare losses and gradients
    if sub == "converge":  # the last of each counts: two seeds of two steps already give a verdict and a target
        argv += [*(["--seeds", "2"] if "auto" not in argv else []), "--steps", "2", "--eval-every", "2"]
        # its speed runs: converge measures the recipe's steps scaled up to its 10 s target, at most 20 times
        # as many, at once when the curves' pace puts the window under 5 s (always, here): 20 steps a side
        # from one, not 40 from CHEAP's two
        argv += ["--set", "measure.steps=1"]
        if "--max-seeds" in argv:  # sequential: auto's start (2 seeds), then at most one added seed, not up to 8
            argv += ["--max-seeds", "3"]
    if sub == "parity" and "--out" not in argv:  # its default, runs/parity-<name>, is what compare --parity reads
        name = yaml.safe_load(_recipes(argv)[0].read_text())["name"]
        argv += ["--out", f"runs/parity-{name}"]
    return argv


PARTS = 6
"""The commands run as this many independent parts, each a class of its own (``make test``'s ``--dist
loadscope`` gives each class to a worker): parts of about 2-3 minutes that the workers fit beside the
other long modules (two parts of 9-10 minutes each were the suite's two longest items)."""
RUNS = re.compile(r"(?<![\w/.])runs/[^/\s,]+")


DEFAULTS = {"--backends": "paddle,torch"}
"""Options given their default value, which do not make a command another command."""


def same_command(line: str) -> str:
    """The command but for its --out, an option given its default, and where the ``xfw`` it calls lives."""
    argv, kept = words(line), []
    for i, a in enumerate(argv):
        before = argv[i - 1] if i else None
        default_option = a in DEFAULTS and i + 1 < len(argv) and argv[i + 1] == DEFAULTS[a]
        if a == "--out" or before == "--out" or default_option or (before in DEFAULTS and a == DEFAULTS[before]):
            continue
        kept.append("xfw" if i == 0 and a.endswith("/xfw") else a)
    return " ".join(kept)


def unique_commands() -> list[tuple[str, str]]:
    """(document, line) in document order, the same command (:func:`same_command`) kept once."""
    seen, out = set(), []
    for doc, line in PRELUDE + documented_commands():
        same = same_command(line)
        if same not in seen:
            seen.add(same)
            out.append((doc, line))
    return out


def covered_by(line: str) -> str | None:
    """The contract test that runs this documented command as written, or None."""
    found = COVERED.get(same_command(line))
    return found and f"run as written by {found[0]} (COVERED)"


def _option(argv: list[str], names: tuple[str, ...], default: str) -> str:
    """The value of the last of ``names`` given (click keeps the last), or ``default``."""
    return next((argv[i + 1] for i in reversed(range(len(argv) - 1)) if argv[i] in names), default)


def _cost(argv: list[str]) -> int:
    """About how long a command takes, in framework processes started (each one imports Paddle, PyTorch or
    JAX: most of the time on CPU), plus one for the CLI itself. A training command describes each backend,
    then runs it per recipe, repeat, sweep point and process; a built instance (``paddle@3.2.2``) checks its
    environment; explain profiles each run again; parity exports a start; converge runs the speed window,
    exports a start per seed and trains a curve per seed and backend (two seeds, its longest runs)."""
    sub = argv[1] if len(argv) > 1 else ""
    if sub not in TRAINING | {"parity", "explain"} or skip_reason(argv) or "--print-command" in argv:
        return 1
    if "--report-only" in argv:
        return 2
    names = _option(argv, ("--backends", "--backend"), "paddle,torch").split(",")
    repeat = int(_option(runnable(argv), ("--repeat",), "1"))
    recipes = max(1, len(_recipes(argv)))
    points = 1
    for i, a in enumerate(argv[:-1]):
        if a == "--set" and sub == "sweep":
            points *= len(argv[i + 1].split(","))
    # two ranks and their launcher: 3; a sweep over 1,2 processes: 2 on average; explain: a profiled run as well
    processes = 3 if "parallel.nproc_per_node=2" in " ".join(argv) else 2 if "nproc_per_node=1,2" in " ".join(argv) \
        else 1
    runs = len(names) * repeat * recipes * points * processes * (4 if sub == "explain" or "--explain" in argv else 1)
    if sub == "parity":
        runs = len(names) + 1
    if sub == "converge" or sub == "nightly" and "converge" in " ".join(argv):
        runs = 3 * (len(names) * 3 + 2)  # speed + 2 seeds per backend, 2 exports; curves evaluate every step
    if sub == "nightly" and "converge" not in " ".join(argv):
        runs = len(names) * 3 * 2  # the smoke suite's three entries, each recorded into the history
    return int(1 + len(names) + sum("@" in n for n in names) + runs)


def directories(line: str) -> set[str]:
    """The ``runs/<name>`` directories a command names, and parity's default one (what compare --parity reads)."""
    found = set(RUNS.findall(line))
    argv = words(line)
    if len(argv) > 2 and argv[1] == "parity" and not skip_reason(argv):
        found |= set(RUNS.findall(" ".join(runnable(argv)[3:])))
    return found


def parts(commands: list[tuple[str, str]], n: int) -> list[list[tuple[str, str]]]:
    """The commands split into ``n`` parts that share no ``runs/<name>`` directory (a report stays with
    the sweep that wrote what it reads), each in document order, the training commands spread evenly."""
    group = list(range(len(commands)))

    def root(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    first: dict[str, int] = {}
    for i, (_, line) in enumerate(commands):
        for directory in directories(line):
            group[root(i)] = root(first.setdefault(directory, i))
    members: dict[int, list[int]] = {}
    for i in range(len(commands)):
        members.setdefault(root(i), []).append(i)
    cost = {g: sum(1 if covered_by(commands[i][1]) else _cost(words(commands[i][1])) for i in m)
            for g, m in members.items()}
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for g in sorted(members, key=lambda g: -cost[g]):
        k = load.index(min(load))
        bins[k] += members[g]
        load[k] += cost[g]
    return [[commands[i] for i in sorted(b)] for b in bins]


def make_scratch(where: Path) -> Path:
    """A directory that looks like the repository (its files linked) with an empty runs/."""
    require_interpreter("torch")
    require_interpreter("paddle")
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (where / entry.name).symlink_to(entry)
    return where


def run_part(part: int, scratch: Path, capsys) -> list[str]:
    """Run one part's commands in ``scratch``; the failures, each with its output's tail."""
    ran, skipped, failures = [], [], []
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for doc, line in parts(unique_commands(), PARTS)[part]:
        argv = words(line)
        reason = skip_reason(argv) or covered_by(line) or unwritten_input(argv, scratch)
        if reason:
            skipped.append(f"{doc}: {line[:100]} -- {reason}")
            continue
        t0 = time.monotonic()
        done = subprocess.run(runnable(argv), cwd=scratch, capture_output=True, text=True, timeout=600, env=env)
        ran.append(f"{doc}: {line[:100]} -> {done.returncode} in {time.monotonic() - t0:.0f} s")
        if done.returncode != expected_code(argv):
            failures.append(f"{doc}: {line}\n  exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
    with capsys.disabled():
        print(f"\npart {part}: {len(ran)} documented commands ran in {time.monotonic() - started:.0f} s:", *ran,
              f"{len(skipped)} skipped:", *skipped, sep="\n  ")
    assert ran  # the extraction found this part's commands (test_the_parts_... checks every part has one)
    return failures


class Part:
    part = 0

    def test_every_documented_cpu_command_exits_as_documented(self, tmp_path, capsys):
        failures = run_part(self.part, make_scratch(tmp_path), capsys)
        assert not failures, "\n".join(failures)


class TestDocumentedCommandsPart0(Part):
    part = 0


class TestDocumentedCommandsPart1(Part):
    part = 1


class TestDocumentedCommandsPart2(Part):
    part = 2


class TestDocumentedCommandsPart3(Part):
    part = 3


class TestDocumentedCommandsPart4(Part):
    part = 4


class TestDocumentedCommandsPart5(Part):
    part = 5


def test_the_parts_share_no_run_directory_and_keep_every_command():
    commands = unique_commands()
    split = parts(commands, PARTS)
    assert sorted(c for p in split for c in p) == sorted(commands) and all(split)
    assert len([c for c in globals() if c.startswith("TestDocumentedCommandsPart")]) == PARTS
    for p in split:  # each part in document order, with a command to run
        assert [commands.index(c) for c in p] == sorted(commands.index(c) for c in p)
        assert any(not skip_reason(words(line)) and not covered_by(line) for _, line in p)
    assert sum(not skip_reason(words(line)) and not covered_by(line) for _, line in commands) >= 30
    dirs = [{d for _, line in p for d in directories(line)} for p in split]
    assert all(not dirs[a] & dirs[b] for a in range(PARTS) for b in range(a)), dirs
    lora = next(line for _, line in commands if line.startswith("xfw parity recipes/tiny/llava_lora.yaml"))
    assert directories(lora) == {"runs/parity-tiny-llava-lora"}  # goes with the compare --parity that reads it
    assert any("runs/nightly" in line and "--report-only" in line for _, line in commands)
    with_nightly = [p for p in split if any("runs/nightly" in line for _, line in p)]
    assert len(with_nightly) == 1  # the night and the report of it (another document) stay together
    assert unique_commands().count(PRELUDE[0]) == 1
    explains = [line for _, line in commands if line.startswith("xfw compare recipes/tiny/llava_sft.yaml") and "--explain" in line]
    assert len(explains) == 1  # README's and docs/explain.md's differ only by the default --backends
    assert [doc for doc, line in commands if same_command(line) == "xfw env"] == ["README.md"]  # gpu.md's too


def test_what_another_test_runs_is_still_run_there_as_written():
    """Each :data:`COVERED` command is documented, and the test named for it still makes that call."""
    documented = {same_command(line) for _, line in documented_commands()}
    for command, (test, calls) in COVERED.items():
        assert command in documented, command  # a stale entry would hide nothing, but says what is not true
        source = (ROOT / test).read_text(encoding="utf-8")
        for call in [calls] if isinstance(calls, str) else calls:
            assert call in source, (test, call)
    assert runnable(words("xfw compare recipes/tiny/llava_sft.yaml --repeat 3"))[-2:] == ["--repeat", "2"]
    auto = runnable(words("xfw converge r.yaml --seeds auto --max-seeds 8"))
    assert auto[auto.index("--seeds") + 1] == "auto" and auto.count("--seeds") == 1 and auto[-2:] == ["--max-seeds", "3"]
    assert "--repeat" not in runnable(words("xfw compare r.yaml --backends paddle@3.2.2,paddle --ab --repeat 3"))[-4:]


def test_the_extraction_classifies_what_cannot_run_here():
    assert skip_reason(words("xfw compare recipes/llava7b_sft.yaml --set data.path=/data/x.json")).startswith(
        "needs a dataset")
    assert skip_reason(words("xfw compare recipes/llava7b_sft.yaml")) == "llava7b_sft.yaml: a full-size model, for GPUs"
    assert skip_reason(words("xfw run RECIPE --backend torch")) == "a placeholder for the reader's own value"
    assert skip_reason(words("xfw estimate recipes/llava7b_lora.yaml")) is None  # no framework: runs
    assert skip_reason(words("xfw sweep recipes/tiny/llava_sft.yaml --set parallel.nproc_per_node=1,2")) is None
    lines = [line for _, line in documented_commands()]
    assert any(line.startswith("xfw sweep recipes/tiny/llava_sft.yaml") for line in lines)
    assert any("--parallel" not in line and line.startswith("xfw parity") for line in lines)
