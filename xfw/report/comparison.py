"""Which comparison a row is, and the mechanisms under each side's settings (xfw.recipe.published).

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

from xfw.contract import envvars
from xfw.report.measure import THROUGHPUT_NOTES
from xfw.report.table import Bullets, Heading, Paragraph, Table

KINDS = {
    "like-for-like": "Like-for-like comparison: one algorithm on both sides (the framework comparison)",
    "published": "Published comparison: each side as its own benchmark script ran it (reproduces a published "
                 "table; not a framework comparison)",
}
# Mechanisms that say how a side ran rather than what it ran: shown, never flagged.
DESCRIPTIVE = {"sharding_detail", "attention_impl", "master_weights", "master_grads", "device"}


def one_framework(backends) -> str:
    """``paddle`` when the first two backends are builds of one framework (``paddle@3.2.0``, ``paddle``): the
    contrast is between builds, not frameworks, and every page and chart of it says so; "" otherwise."""
    names = list(backends)[:2]
    if len(names) < 2 or names[0].partition("@")[0] != names[1].partition("@")[0]:
        return ""
    return names[0].partition("@")[0]


def compared(backends) -> str:
    """What a page or chart compares, in a few words: ``two builds of paddle`` or ``two frameworks``
    (``paddle against torch``); one backend compares nothing."""
    names = list(backends)
    if len(names) < 2:
        return f"one backend ({names[0]})" if names else "no backend"
    framework = one_framework(names)
    return f"two builds of {framework}" if framework else "two frameworks"


def both(backends) -> str:
    """The word for every side at once: ``both builds``, ``both sides`` or ``all 3 sides``."""
    names = list(backends)
    if len(names) > 2:
        return f"all {len(names)} sides"
    return "both builds" if one_framework(names) else "both sides"


def kind_of(row) -> str:
    """``like-for-like`` | ``published`` | ``mixed`` (sides from different comparisons: warned)."""
    kinds = {s.setup.get("comparison", {}).get("kind", "like-for-like") for s in row.sides.values() if s.setup}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "like-for-like")


SINGLE = {"like-for-like": "Like-for-like settings, one backend ({backend}): the recipe as it says, nothing "
                            "compared against another side",
          "published": "Published settings, one backend ({backend}): as its own benchmark script ran it, nothing "
                       "compared against another side"}
_NOT_NAMED = ("override.",)
"""Differences the heading leaves to its own line (deliberate overrides are named beside it)."""


def _sides_compared(rows) -> list[str]:
    return list(dict.fromkeys(name for r in rows for name in r.sides))


def differences(rows) -> list[str]:
    """``mechanism.attention_kernel (paddle sdpa_math, torch sdpa: flash)``: each setting that differs
    between the sides of a like-for-like row (what the warnings list), for the heading to name."""
    out: dict[str, str] = {}
    for row in rows:
        if kind_of(row) != "like-for-like":
            continue
        for key in row.differing:
            if key.startswith(_NOT_NAMED) or key in out:
                continue
            values = row.settings.get(key) or {}
            if key == "adapter_notes":  # what one build's adapter did that the other's did not, not every note
                values = {f"{b} only:": "; ".join(parts) for b, parts in one_side_notes(row).items()}
            out[key] = f"{key} ({', '.join(f'{b} {v}' for b, v in values.items())})" if values else key
    return list(out.values())


def applied_count(rows) -> tuple[int, int]:
    """(published settings carried out here, published settings this comparison asked for), over every
    published side: an entry a side's adapter could not carry out (``not_honoured``, by its knob) or that
    the run's own ``--set`` replaced is not applied here."""
    applied = total = 0
    for row in rows:
        for side in row.sides.values():
            block = (side.setup or {}).get("comparison") or {}
            if block.get("kind") != "published":
                continue
            refused = set((side.applied or {}).get("not_honoured") or {})
            entries = block.get("set") or []
            total += len(entries) + len(block.get("replaced") or [])
            applied += sum(1 for e in entries if str(e.get("key", "")).split(".")[0] not in refused)
    return applied, total


def short_name(rows) -> str:
    """The comparison in a few words, for a chart's title, a layout's subtitle, a CSV column:
    ``like-for-like comparison``, ``like-for-like comparison, except mechanism.attention_kernel``,
    ``published comparison (2 of 9 published settings applied here)``, ``one backend (torch), like-for-like``."""
    kinds = {kind_of(r) for r in rows} or {"like-for-like"}
    if len(kinds) > 1 or "mixed" in kinds:
        return "mixed comparisons (like-for-like and published rows)"
    kind, sides = next(iter(kinds)), _sides_compared(rows)
    if len(sides) == 1:
        return f"one backend ({sides[0]}), {kind} settings"
    if kind == "published":
        applied, total = applied_count(rows)
        return "published comparison" + (f" ({applied} of {total} published settings applied here)" if total else "")
    different = [d.split(" (")[0] for d in differences(rows)]
    return "like-for-like comparison" + (f", except {', '.join(different)}" if different else "")


def title(rows) -> str:
    """Which comparison, and in the heading itself what is the same and what is not: a like-for-like
    row whose sides ran some mechanism differently does not claim one algorithm on both sides; a
    published one says how many of its settings this machine carried out; one backend says so."""
    kinds = {kind_of(r) for r in rows}
    if len(kinds) != 1 or next(iter(kinds)) not in KINDS:
        return "Mixed comparisons: like-for-like and published rows (see each row's Comparison column)"
    kind, sides = next(iter(kinds)), _sides_compared(rows)
    if len(sides) == 1:
        return SINGLE[kind].format(backend=sides[0])
    if kind == "published":
        applied, total = applied_count(rows)
        return KINDS[kind] + (f"; published settings: {applied} of {total} applied here" if total else "")
    different = differences(rows)
    which = "" if one_framework(sides) else " (the framework comparison)"  # two builds: their heading says so first
    if not different:
        return f"Like-for-like comparison: one algorithm on {both(sides)}{which}"
    return (f"Like-for-like comparison{which}: the same recipe, data and settings on {both(sides)}, "
            f"except {'; '.join(different)} (see the warnings)")


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
    if key in ("tf32", "tf32_conv"):
        return "n/a" if text.startswith("n/a") else text
    if key == "comm_overlap":  # "overlapped: how", "none: why", "n/a (one process)"
        return text.split(":")[0].split(" (")[0].strip()
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
    for line in result_variables(row):
        row.warnings.append(f"{line}: a variable that can change the program or what is measured")
    if kind_of(row) == "mixed":
        row.warnings.append("the sides come from different comparisons (like-for-like and published): "
                            "this contrast compares neither")


def one_side_notes(row) -> dict[str, list[str]]:
    """Each side's adapter notes (``applied.notes``, ``; ``-separated) that another side lacks: backend -> parts."""
    parts = {name: [p.strip() for p in str(s.applied.get("notes") or "").split(";") if p.strip()]
             for name, s in row.sides.items() if s.applied}
    out = {name: [p for p in mine if any(p not in theirs for other, theirs in parts.items() if other != name)]
           for name, mine in parts.items()}
    return {name: found for name, found in out.items() if found} if len(parts) > 1 else {}


def add_notes(row, backends: list[str]) -> None:
    """Each side's adapter notes (``applied.notes``) as the ``adapter_notes`` setting. Between two builds of one
    framework a note one build has and the other lacks (Paddle 3.0's CPU backport of causal attention) is a difference in what ran: flagged and
    warned about, so the page says it (two frameworks' adapters note different things by nature)."""
    notes = {name: str(s.applied["notes"]) for name, s in row.sides.items() if s.applied and s.applied.get("notes")}
    if not notes:
        return
    row.settings["adapter_notes"] = notes
    only = one_side_notes(row) if one_framework(backends) else {}
    if only:
        row.differing.append("adapter_notes")
        row.warnings.append("the builds did not run the same code here: " + "; ".join(
            f"{name} only: {'; '.join(parts)}" for name, parts in only.items()) + " (each adapter's own note)")


def result_variables(row) -> list[str]:
    """``side NAME=value (what it changes)`` for each variable a side's processes got that can change the
    result (:mod:`xfw.contract.envvars`): named in the warnings and beside the headline."""
    out = []
    for name, side in row.sides.items():
        env = (side.setup or {}).get("env") or {}
        out += [f"{name} {assignment} ({what})" for assignment, what in envvars.named(env).items()]
    return out


_ENTRY_TEXT = {"set": ("key", "source"), "not_applied": ("key", "source"), "replaced": ("key", "source"),
               "not_reproduced": ("what", "source"), "recorded": ("key", "source", "text")}
_THROUGHPUT_DEFINITIONS = tuple(THROUGHPUT_NOTES)


def _whole(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1_000_000


def block_problem(block) -> str | None:
    """Why a spec.json's ``comparison`` block (:func:`xfw.recipe.published.described`) cannot be read:
    ``"comparison.<key>: why"``, or None. Checked when a run directory loads, so an edited block makes
    the run unreadable in one line instead of failing a report."""
    if not isinstance(block, dict):
        return f"comparison: a {type(block).__name__}, not a mapping"
    if not isinstance(block.get("kind", "like-for-like"), str) or block.get("kind", "like-for-like") not in KINDS:
        return f"comparison.kind: {str(block.get('kind'))[:80]!r} is not one of {', '.join(KINDS)}"
    for key in ("row", "file"):
        if key in block and not isinstance(block[key], str):
            return f"comparison.{key}: a {type(block[key]).__name__}, not text"
    for key, fields in _ENTRY_TEXT.items():
        entries = block.get(key, [])
        if not isinstance(entries, list):
            return f"comparison.{key}: a {type(entries).__name__}, not a list"
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                return f"comparison.{key}.{i}: a {type(entry).__name__}, not a mapping"
            bad = next((f for f in fields if not isinstance(entry.get(f), str)), None)
            if bad:
                return f"comparison.{key}.{i}.{bad}: missing or not text"
            if key != "not_reproduced" and "value" not in entry:
                return f"comparison.{key}.{i}.value: missing"
    if "throughput" in block:
        definition = block["throughput"]
        if not isinstance(definition, dict):
            return f"comparison.throughput: a {type(definition).__name__}, not a mapping"
        if definition.get("definition") not in _THROUGHPUT_DEFINITIONS:
            return (f"comparison.throughput.definition: {str(definition.get('definition'))[:80]!r} is not one of "
                    f"{', '.join(_THROUGHPUT_DEFINITIONS)}")
        if "skip_steps" in definition and not _whole(definition["skip_steps"], 0):
            return f"comparison.throughput.skip_steps: {str(definition['skip_steps'])[:80]!r} is not a whole number >= 0"
        if "n" in definition and not _whole(definition["n"], 1):
            return f"comparison.throughput.n: {str(definition['n'])[:80]!r} is not a whole number >= 1"
        if "source" in definition and not isinstance(definition["source"], str):
            return "comparison.throughput.source: not text"
    return None


def _fmt(value) -> str:
    return "–" if value is None else f"{value:,.1f}"


def once(per_side: dict[str, list[str]], everyone: str) -> list[tuple[str, str]]:
    """Each entry once, with the sides that have it: ``everyone`` (``both builds``) where every side does,
    else their names; first-seen order. Two builds given one published file list its settings once, not per build."""
    sides = list(per_side)
    out: dict[str, list[str]] = {}
    for b in sides:
        for text in per_side[b]:
            out.setdefault(text, [])
            if b not in out[text]:
                out[text].append(b)
    return [(everyone if len(sides) > 1 and len(who) == len(sides) else ", ".join(who), text)
            for text, who in out.items()]


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
        lists: dict[str, dict[str, list[str]]] = {k: {} for k in ("set", "replaced", "left_out", "unreproduced",
                                                                   "recorded", "honoured")}
        for b, d in described.items():
            lists["set"][b] = ["\t".join((e["key"], str(e["value"]), e["source"])) for e in d.get("set", [])]
            lists["replaced"][b] = [f"{e['key']} ran as {'(not set)' if e.get('ran') is None else e['ran']}, not the "
                                    f"published {e['value']} ({e['source']}): this run's own --set"
                                    for e in d.get("replaced", [])]
            lists["left_out"][b] = [f"{e['key']} = {e['value']} ({e['source']})" for e in d.get("not_applied", [])]
            lists["unreproduced"][b] = [f"{e['what']} ({e['source']})" for e in d.get("not_reproduced", [])]
            lists["recorded"][b] = [f"{e['key']} = {e['value']}: {e['text']}" for e in d.get("recorded", [])]
            lists["honoured"][b] = [f"{k}: {why}" for k, why in (row.sides[b].applied.get("not_honoured") or {}).items()]
        everyone = both(described)
        applied_cells = [[who, *text.split("\t")] for who, text in once(lists["set"], everyone)]
        replaced, left_out, unreproduced, recorded, honoured = (
            [f"{who}: {text}" for who, text in once(lists[k], everyone)]
            for k in ("replaced", "left_out", "unreproduced", "recorded", "honoured"))
        if applied_cells:
            out.append(Table(header=["Side", "Setting", "Value", "Source"], cells=applied_cells,
                             records=[dict(zip(("side", "setting", "value", "source"), c)) for c in applied_cells],
                             name="published_settings", csv=False))
        if replaced:
            out += [Paragraph("Published settings this run replaced with its own (what ran is listed, not the "
                              "published value):"), Bullets(replaced, name="replaced")]
        if honoured:
            out += [Paragraph("Asked for but not carried out on this machine (the default ran instead):"),
                    Bullets(honoured, name="not_honoured")]
        if left_out:
            out += [Paragraph("What the published scripts ran that this like-for-like comparison deliberately does not "
                              "(run with `--as published` to apply them):"), Bullets(left_out, name="not_applied")]
        if recorded:
            out += [Paragraph("Mechanisms recorded for a side but not set by xfw (each side's, so both sides of the row "
                              "carry the same mechanisms):"), Bullets(recorded, name="recorded")]
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
