"""The largest micro-batch that fits: an OOM-aware search, each probe its own process.

``xfw maxbatch recipes/llava7b_lora.yaml --backends torch --candidates 64,32,16`` tries the
candidates largest first and stops at the first that runs; without candidates it starts at the
recipe's micro-batch and doubles while runs succeed (halving instead when the first one runs out
of memory). Every probe goes through the launcher as an ordinary run directory, so an OOM in one
probe cannot poison the next, and a probe that settled earlier is kept (the search resumes)::

    OUT/llava7b-lora/micro32/torch/{spec.json,...,summary.json}     variant {"batch.micro": 32, ...}

Each probe keeps the recipe's global batch when its micro-batch divides it (gradient accumulation
makes up the rest: memory depends on the micro-batch); a micro-batch that does not divide it runs
global batch = micro x processes (one micro-batch per step), and the report says which probes did.
The edge is the largest micro-batch that ran with the smallest that ran out of memory
above it; a probe that ends any other way (crashed, timeout, unsupported) stops the search,
because it says nothing about memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from xfw.report.contrast import fmt_memory_pair
from xfw.report.table import Bullets, Page, Paragraph, Strong, Table
from xfw.run.launch import launcher
from xfw.run.launch.jobs import Job, run_jobs
from xfw.recipe import Recipe, load_recipe

DEFAULT_MAX_MICRO = 4096
"""Where a doubling search gives up looking for an OOM."""


def parse_candidates(text: str) -> list[int]:
    """``"64,32,16"`` -> [64, 32, 16]; ValueError naming the option otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--candidates {text!r}: expected positive integers, e.g. 64,32,16") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--candidates {text!r}: expected distinct positive integers, e.g. 64,32,16")
    return sorted(values, reverse=True)


@dataclass(kw_only=True)
class Probe:
    micro: int
    global_batch: int
    status: str
    reason: str
    ips: float | None
    mem_alloc_peak_bytes: int | None
    mem_reserved_peak_bytes: int | None
    mem_source: str | None
    run_dir: str


@dataclass(kw_only=True)
class MaxBatch:
    recipe: str
    backend: str
    probes: list[Probe] = field(default_factory=list)
    """In the order they ran."""
    stopped: str = ""
    """Why the search stopped early (a probe neither fitted nor ran out of memory); "" otherwise."""

    @property
    def edge(self) -> Probe | None:
        """The largest micro-batch that ran."""
        ok = [p for p in self.probes if p.status == "ok"]
        return max(ok, key=lambda p: p.micro) if ok else None

    @property
    def oom_above(self) -> Probe | None:
        """The smallest micro-batch above the edge that ran out of memory."""
        floor = self.edge.micro if self.edge else 0
        ooms = [p for p in self.probes if p.status == "oom" and p.micro > floor]
        return min(ooms, key=lambda p: p.micro) if ooms else None

    def to_dict(self) -> dict:
        edge, oom = self.edge, self.oom_above
        return {"recipe": self.recipe, "backend": self.backend, "edge_micro": edge.micro if edge else None,
                "ips_at_edge": edge.ips if edge else None, "oom_micro": oom.micro if oom else None,
                "stopped": self.stopped, "probes": [vars(p) for p in self.probes]}


def probe_recipe(path: str, micro: int, overrides: list[str]) -> Recipe:
    """The recipe at one micro-batch: its own global batch where ``micro`` x processes divides it,
    else global = micro x processes (module docstring); RecipeError names file and key."""
    base = load_recipe(path, overrides)
    per_step = micro * base.num_processes
    size = base.batch.global_size if base.batch.global_size % per_step == 0 else per_step
    return load_recipe(path, [*overrides, f"batch.micro={micro}", f"batch.global={size}"])


class Search:
    """Runs probes for one (recipe, backend), keeping every result."""

    def __init__(self, path: str, overrides: list[str], backend: launcher.Backend, description: dict, out_dir: Path,
                 progress: launcher.Progress | None = None, log=print, force: bool = False):
        self.path, self.overrides, self.backend, self.description = path, overrides, backend, description
        self.out_dir, self.progress, self.log, self.force = out_dir, progress, log, force
        self.recipe = load_recipe(path, overrides)
        self.result = MaxBatch(recipe=self.recipe.name, backend=backend.name)

    def probe(self, micro: int) -> str:
        recipe = probe_recipe(self.path, micro, self.overrides)
        job = Job(recipe=recipe, backend=self.backend.name,
                  run_dir=self.out_dir / recipe.name / f"micro{micro}" / self.backend.name,
                  variant={"batch.micro": micro, "batch.global": recipe.batch.global_size},
                  label=f"[{self.backend.name}] {recipe.name}: micro-batch {micro}")
        (run,), _ = run_jobs([job], {self.backend.name: (self.backend, self.description)}, resume=True,
                             force=self.force, progress=self.progress, log=self.log)
        m = run.measurement
        self.result.probes.append(Probe(micro=micro, global_batch=recipe.batch.global_size, status=run.status, reason=run.reason, ips=m.ips,
                                        mem_alloc_peak_bytes=m.mem_alloc_peak_bytes,
                                        mem_reserved_peak_bytes=m.mem_reserved_peak_bytes, mem_source=m.mem_source,
                                        run_dir=str(job.run_dir)))
        if run.status not in ("ok", "oom"):
            self.result.stopped = f"micro-batch {micro} ended {run.status}: {run.reason}"
        return run.status

    def largest_first(self, candidates: list[int]) -> MaxBatch:
        for micro in sorted(candidates, reverse=True):
            if self.probe(micro) != "oom":
                break
        return self.result

    def doubling(self, max_micro: int = DEFAULT_MAX_MICRO) -> MaxBatch:
        micro = self.recipe.batch.micro
        status = self.probe(micro)
        if status == "ok":  # grow until it no longer fits
            while True:
                if micro * 2 > max_micro:
                    self.result.stopped = f"no OOM up to --max-micro {max_micro}"
                    break
                if self.probe(micro * 2) != "ok":
                    break
                micro *= 2
        elif status == "oom":  # shrink until it fits
            while micro > 1:
                micro //= 2
                if self.probe(micro) != "oom":
                    break
        return self.result


def search(path: str, backend: launcher.Backend, description: dict, out_dir: Path, *,
           candidates: list[int] | None = None, overrides: list[str] = (), max_micro: int = DEFAULT_MAX_MICRO,
           progress: launcher.Progress | None = None, log=print, force: bool = False) -> MaxBatch:
    """Find the largest micro-batch of one recipe on one backend (see the module docstring)."""
    runner = Search(str(path), list(overrides), backend, description, out_dir, progress, log, force)
    if candidates:
        for micro in candidates:  # validate every probe before launching any
            probe_recipe(str(path), micro, list(overrides))
        return runner.largest_first(candidates)
    return runner.doubling(max_micro)


def to_page(results: list[MaxBatch]) -> Page:
    """Every probe, largest first, then one line per (recipe, backend) naming the edge."""
    cells, records, lines = [], [], []
    for res in results:
        for p in sorted(res.probes, key=lambda p: -p.micro):
            ok = p.status == "ok" and p.ips is not None
            cells.append([res.recipe, res.backend, str(p.micro), str(p.global_batch), "ok" if ok else Strong(p.status),
                          f"{p.ips:,.2f}" if ok else "–",
                          fmt_memory_pair(p.mem_alloc_peak_bytes, p.mem_reserved_peak_bytes, p.mem_source)])
            records.append({"recipe": res.recipe, "backend": res.backend, **vars(p)})
        edge, oom = res.edge, res.oom_above
        text = (f"{res.recipe} on {res.backend}: largest micro-batch that fits: {edge.micro} "
                f"({edge.ips:,.2f} samples/s)" if edge else f"{res.recipe} on {res.backend}: nothing fits")
        if oom:
            text += f"; {oom.micro} runs out of memory"
        if res.stopped:
            text += f" (search stopped: {res.stopped})"
        lines.append(text)
    table = Table(header=["Recipe", "Backend", "Micro-batch", "Global batch", "Status", "ips",
                          "Memory peak (alloc/reserved)"], cells=cells, records=records, numeric=(2, 3, 5))
    notes = [Paragraph("Each probe keeps the recipe's global batch where its micro-batch x processes divides it "
                       "(gradient accumulation makes up the rest); otherwise it runs global = micro-batch x "
                       "processes, as the Global batch column shows.", muted=True)]
    return Page(title="Largest micro-batch that fits", blocks=[table, Bullets(lines), *notes])
