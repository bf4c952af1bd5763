"""What each CLI command does, as one library call returning an :class:`Outcome`.

The CLI (:mod:`xfw.cli`) parses options, calls one function here, prints the outcome and exits
with its code; every policy (what is checked before launching, where results go, which exit code
a result earns) lives here. Every function validates all its input *before* launching anything
and raises :class:`UsageError` (exit 2) for bad input::

    outcome = compare(["recipes/tiny/llava_sft.yaml"], ["paddle", "torch"], overrides=[], interpreters={})
    outcome.exit_code      # 0 all runs ok, 1 some run failed (every other result still written)
    outcome.text           # the report as markdown
    # runs/20261122-161500-tiny-llava-sft/{tiny-llava-sft/{paddle,torch}/..., report.md/.csv/.html, chart.png}

Runs go one at a time (never side by side: they would share the machine). A failed backend is a
result with a status; it never stops the others.

The package: :mod:`~xfw.workflow.base` (the outcome, input checks, report writing, the guard every
command runs under), :mod:`~xfw.workflow.running` (compare, sweep, maxbatch), :mod:`~xfw.workflow.studies` (parity, converge, nightly), :mod:`~xfw.workflow.builds` (bisect) and
:mod:`~xfw.workflow.reading` (those that read runs or launch nothing).
"""

from xfw.workflow.base import (Outcome, UsageError, data_summary, load_all, prepare_backends, refuse_unknown_overrides,
                               write_page, write_report)
from xfw.workflow.reading import (assemble, clean_envs, describe_backends, estimate, remove_env, report,
                                  selfcheck)
from xfw.workflow.builds import ab_margin, ab_sequential_cli, bisect
from xfw.workflow.running import compare, default_out_dir, launch_commands, maxbatch, sweep
from xfw.workflow.studies import converge, nightly, parity

__all__ = ["Outcome", "UsageError", "ab_margin", "ab_sequential_cli", "assemble", "bisect", "compare", "converge", "data_summary", "default_out_dir", "describe_backends",
           "clean_envs", "estimate", "launch_commands", "load_all", "maxbatch", "nightly", "parity", "prepare_backends", "remove_env", "report",
           "refuse_unknown_overrides",
           "selfcheck", "sweep", "write_page", "write_report"]
