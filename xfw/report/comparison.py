"""Which comparison a row is, and the mechanisms under each side's settings (xfw.run.published).

Every compare report says, in its title and beside its table, whether it shows the
**like-for-like** comparison (one algorithm on both sides: the framework comparison) or the
**published** one (each side as its own benchmark script ran it: someone's table reproduced), and
lists what makes the sides differ with the source of each value:

* in a published report, every setting the published file applied per side (file and commit), what
  the scripts did that xfw does not reproduce, and what this machine could not carry out
  (``applied.not_honoured``: flash attention on a CPU, say), never silently dropped;
* in a like-for-like report, the published differences this comparison deliberately leaves out;
* in both, the throughput each side's own script would have printed from the same records
  (:func:`xfw.report.measure.script_throughput`), beside xfw's window ips.

Mechanisms (``applied.mechanisms``, the adapters' neutral keys) join the settings table as
``mechanism.<key>`` rows; values are compared after :func:`neutral`, so names that mean the same
strategy on both sides (``data_parallel`` for DDP and ``paddle.DataParallel``, "sdpa: flash" and
"flash_attn") are not flagged and only real differences are.
"""

from __future__ import annotations

from xfw.report.measure import THROUGHPUT_NOTES
from xfw.report.table import Bullets, Heading, Paragraph, Table

KINDS = {
    "like-for-like": "Like-for-like comparison: one algorithm on both sides (the framework comparison)",
    "published": "Published comparison: each side as its own benchmark script ran it (reproduces a published "
                 "table; not a framework comparison)",
}
# Mechanisms that say how a side ran rather than what it ran: shown, never flagged.
DESCRIPTIVE = {"sharding_detail", "attention_impl", "master_weights", "master_grads", "device"}


def kind_of(row) -> str:
    """``like-for-like`` | ``published`` | ``mixed`` (sides from different comparisons: warned)."""
    kinds = {s.setup.get("comparison", {}).get("kind", "like-for-like") for s in row.sides.values() if s.setup}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "like-for-like")


def title(rows) -> str:
    kinds = {kind_of(r) for r in rows}
    if len(kinds) == 1 and next(iter(kinds)) in KINDS:
        return KINDS[next(iter(kinds))]
    return "Mixed comparisons: like-for-like and published rows (see each row's Comparison column)"


def neutral(key: str, value) -> str:
    """A mechanism's value in words both sides share, for telling real differences from names."""
    text = str(value).lower()
    if key == "attention_kernel":
        for needle, name in (("flash", "flash"), ("efficient", "memory_efficient"), ("cudnn", "cudnn"),
                             ("math", "math"), ("eager", "eager"), ("matmul", "eager")):
            if needle in text:
                return name
    if key == "checkpointing":
        return "none" if text == "none" else "non-reentrant" if "non" in text else "reentrant"
    if key == "optimizer_impl":
        for needle, name in (("fused", "fused"), ("foreach", "foreach"), ("multi_tensor", "foreach"),
                             ("for_loop", "for_loop"), ("per-parameter", "for_loop"), ("per_parameter", "for_loop")):
            if needle in text:
                return name
    if key == "tf32":
        return "n/a" if text.startswith("n/a") else text
    if key == "sharding_impl":  # each framework's implementation names; the stage is the spec's, the same on both sides
        return text if text in ("none", "zero1", "zero2", "zero3") else \
            "data_parallel" if text in ("ddp", "data_parallel") else "sharded"
    return repr(value)


def add_mechanisms(row) -> None:
    """``mechanism.<key>`` and ``env.<NAME>`` rows in ``row.settings``; real differences in
    ``row.differing``, and warned about in a like-for-like row (a published row differs by design)."""
    sides = {name: s for name, s in row.sides.items() if s.applied}
    keys = sorted({k for s in sides.values() for k in (s.applied.get("mechanisms") or {})})
    published = kind_of(row) == "published"
    for key in keys:
        values = {name: (s.applied.get("mechanisms") or {}).get(key, "–") for name, s in sides.items()}
        row.settings[f"mechanism.{key}"] = values
        if key in DESCRIPTIVE or len(values) < 2:
            continue
        if len({neutral(key, v) for v in values.values()}) > 1:
            row.differing.append(f"mechanism.{key}")
            if not published:
                row.warnings.append(f"mechanism {key} differs: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    names = sorted({n for s in sides.values() for n in (s.applied.get("env") or {})})
    for name in names:
        values = {b: (s.applied.get("env") or {}).get(name, "(not set)") for b, s in sides.items()}
        row.settings[f"env.{name}"] = values
        if len({repr(v) for v in values.values()}) > 1:
            row.differing.append(f"env.{name}")
    if kind_of(row) == "mixed":
        row.warnings.append("the sides come from different comparisons (like-for-like and published): "
                            "this contrast compares neither")


def _fmt(value) -> str:
    return "–" if value is None else f"{value:,.1f}"


def blocks(rows, backends: list[str]) -> list:
    """Per row with a published file: what each side ran differently and where each value comes from."""
    out: list = []
    for row in rows:
        described = {b: row.sides[b].setup.get("comparison", {}) for b in backends
                     if b in row.sides and row.sides[b].setup}
        if not any(d.get("file") for d in described.values()):
            continue
        kind = kind_of(row)
        first = next(d for d in described.values() if d.get("file"))
        out.append(Heading(f"{row.model} {row.stage}: {kind} (seed row {first.get('row')}, {first.get('file')})", 4))
        applied_cells, left_out, unreproduced, honoured = [], [], [], []
        for b, d in described.items():
            applied_cells += [[b, e["key"], str(e["value"]), e["source"]] for e in d.get("set", [])]
            left_out += [f"{b}: {e['key']} = {e['value']} ({e['source']})" for e in d.get("not_applied", [])]
            unreproduced += [f"{b}: {e['what']} ({e['source']})" for e in d.get("not_reproduced", [])]
            side = row.sides[b]
            honoured += [f"{b}: {k}: {why}" for k, why in (side.applied.get("not_honoured") or {}).items()]
        if applied_cells:
            out.append(Table(header=["Side", "Setting", "Value", "Source"], cells=applied_cells,
                             records=[dict(zip(("side", "setting", "value", "source"), c)) for c in applied_cells],
                             name="published_settings", csv=False))
        if honoured:
            out += [Paragraph("Asked for but not carried out on this machine (the default ran instead):"),
                    Bullets(honoured, name="not_honoured")]
        if left_out:
            out += [Paragraph("What the published scripts ran that this like-for-like comparison deliberately does not "
                              "(run with `--as published` to apply them):"), Bullets(left_out, name="not_applied")]
        if unreproduced:
            out += [Paragraph("What the scripts did that xfw does not reproduce in either comparison:"),
                    Bullets(unreproduced, name="not_reproduced")]
        cells = []
        for b, d in described.items():
            definition, side = d.get("throughput"), row.sides[b]
            if not definition or not side.ok:
                continue
            value = side.script_ips
            note = THROUGHPUT_NOTES.get(definition["definition"], "").format(
                skip_steps=definition.get("skip_steps", 0), n=definition.get("n", 1))
            ratio = f"{value / side.ips:.3f}" if value and side.ips else "–"
            cells.append([b, _fmt(side.ips), _fmt(value), ratio, note, definition.get("source", "")])
        if cells:
            out.append(Table(header=["Side", "xfw ips (window)", "ips as its script defined it", "ratio", "definition",
                                     "Source"], cells=cells, name="script_throughput", csv=False))
    return out
