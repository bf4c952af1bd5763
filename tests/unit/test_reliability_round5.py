"""Hostile and unlucky input, round five (issue 41): documents read back (converge.json, ab.json, the
nightly verdicts), per-backend overrides of forced keys or unknown backends, instance labels and
wheels, subprocesses of checks and builds, count options, builds files. Each case is refused in one
line naming the file or option and key (exit 2, nothing launched) or survived with nothing lost; the
numbers in the names follow docs/reliability.md (29 onwards).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xfw.contract.atomic import UnreadableFile
from xfw.report import readback
from xfw.report.readback import Maybe, OneOf, Pair, ShapeError, check, read_checked

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --- 29: every document read back goes through one typed loader ------------------------------------

def test_29_the_shape_checker_names_the_key_path_of_the_first_problem():
    shape = {"schema": int, "decisions": [{"name": str, "ratio?": Maybe(float), "kind": OneOf("a", "b")}],
             "curve": Pair(int, int, Maybe(float)), "by": {str: bool}}
    good = {"schema": 1, "decisions": [{"name": "x", "kind": "a"}, {"name": "y", "ratio": 1, "kind": "b"}],
            "curve": [1, 2, None], "by": {"t": True}}
    assert check(good, shape) is None
    cases = {
        "decisions[1].ratio: expected a number or null, found text": {"ratio": "1"},
        "decisions[1].kind: expected one of 'a', 'b', found 'c'": {"kind": "c"},
        "decisions[1].extra: not a key this file has": {"extra": 1},
        "decisions[1].name: missing": {"name": None},
    }
    for want, change in cases.items():
        bad = json.loads(json.dumps(good))
        bad["decisions"][1].update(change)
        if change.get("name", 0) is None:
            del bad["decisions"][1]["name"]
        assert check(bad, shape) == want
    assert check({**good, "decisions": "abc"}, shape) == "decisions: expected a list, found text"
    assert check({**good, "schema": True}, shape) == "schema: expected an integer, found a bool"
    assert check({**good, "curve": [1, 2]}, shape) == "curve: expected a list of 3, found a list of 2"
    assert check({**good, "by": {"t": 1}}, shape) == "by.t: expected true or false, found an integer"
    assert check({**good, "curve": [1, 2, float("inf")]}, shape).startswith("curve[2]: expected a number or null")


def test_29_read_checked_is_one_line_naming_the_file_and_key(tmp_path):
    path = tmp_path / "bisect.json"
    assert read_checked(path, {"x": int}) == {}  # no file
    path.write_text('{"x": 1e400}')  # JSON that reads as infinity
    with pytest.raises(ShapeError) as err:
        read_checked(path, {"x": int}, hint="give --force")
    assert str(err.value) == f"{path}: x: expected an integer, found a number out of range; give --force"
    assert isinstance(err.value, UnreadableFile)  # every reader already catches it
    path.write_text("[1]")
    with pytest.raises(UnreadableFile, match="expected a JSON object"):
        read_checked(path, {"x": int})


def test_29_the_declared_shapes_follow_their_dataclasses():
    """A field added to a dataclass that is written back must be in its shape (or the file is refused)."""
    from xfw.report.ab import ABResult
    from xfw.report.converge import ConvergeReport, PointStats, SeedRun, SeedTarget, SideTarget, Speed
    from xfw.report.verdicts import Verdict

    def keys(shape):
        return {k.removesuffix("?") for k in shape if isinstance(k, str)}

    for cls, shape in [(Verdict, readback.VERDICT), (ConvergeReport, readback.CONVERGE), (ABResult, readback.AB_VERDICT),
                       (SeedRun, readback._SEED_RUN), (Speed, readback._SPEED), (PointStats, readback._POINT_STATS),
                       (SeedTarget, readback._SEED_TARGET), (SideTarget, readback._SIDE_TARGET)]:
        assert {f.name for f in fields(cls)} <= keys(shape), cls.__name__


def converge_report():
    from test_nightly_converge import report

    return report()


@pytest.mark.parametrize("edit", [
    {"curves": []}, {"targets": []}, {"speed": None}, {"headline": "a string headline"}, {"points": [{"step": 1}]},
    {"backends": ["torch"]}, {"curves": {"torch": {"0": {"status": "ok", "eval": [[0, 0]]}}}}])
def test_29_a_hand_edited_converge_json_is_one_line_in_the_nightly_report(tmp_path, edit):
    from xfw.report.nightly_report import converge_blocks
    from xfw.report.table import Bullets

    entry = tmp_path / "nights" / "n1" / "llava-converge"
    path = converge_report().save(entry)
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    blocks = converge_blocks(tmp_path, entry.parent, [])
    shown = [getattr(b, "text", "") for b in blocks]
    assert any(str(path) in s and "\n" not in s and next(iter(edit)) in s for s in shown), shown
    assert not any(isinstance(b, Bullets) and len(b.items) > 3 for b in blocks)  # no character per bullet


def test_29_a_damaged_nightly_verdicts_file_is_one_line(tmp_path):
    from xfw.report.verdicts import load_verdicts

    for doc, key in [({"verdicts": "abc"}, "verdicts"), ({"verdicts": [{"entry": "e"}]}, "verdicts[0].backend"),
                     ({"verdicts": [], "policy": []}, "policy"),
                     ({"verdicts": [{"entry": "e", "backend": "b", "metric": "ips", "verdict": "ok", "value": "x"}]},
                      "verdicts[0].value")]:
        (tmp_path / "nightly.json").write_text(json.dumps(doc))
        with pytest.raises(UnreadableFile) as err:
            load_verdicts(tmp_path)
        assert f"nightly.json: {key}:" in str(err.value) and "\n" not in str(err.value)


def test_29_a_damaged_ab_json_is_skipped_by_report_never_a_crash(tmp_path):
    from xfw.workflow.reading import _ab_pair

    good = {"schema": 1, "verdicts": [{"recipe": "r", "first": "a", "second": "b", "verdict": "slower", "pairs": 3}]}
    (tmp_path / "ab.json").write_text(json.dumps(good))
    assert _ab_pair([str(tmp_path)]) == ("a", "b")
    for bad in ({"schema": 1, "verdicts": "x"}, {"schema": 1, "verdicts": [{"first": 1}]}, {"verdicts": [[]]}):
        (tmp_path / "ab.json").write_text(json.dumps(bad))
        assert _ab_pair([str(tmp_path)]) is None


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=5), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)


@FUZZ
@given(data=st.data())
def test_fuzz_29_any_edit_of_converge_json_renders_or_is_one_line(tmp_path_factory, data):
    from xfw.report.converge import ConvergeReport
    from xfw.report.nightly_report import converge_blocks
    from xfw.report.table import to_html, to_markdown, Page

    doc = converge_report().to_dict()
    for _ in range(data.draw(st.integers(1, 3))):  # replace a key at some depth with any JSON value
        node, key = doc, data.draw(st.sampled_from(sorted(doc)))
        while isinstance(node.get(key), dict) and node[key] and data.draw(st.booleans()):
            node, key = node[key], data.draw(st.sampled_from(sorted(node[key])))
        node[key] = data.draw(json_values)
    entry = tmp_path_factory.mktemp("h") / "nights" / "n1" / "c"
    entry.mkdir(parents=True)
    (entry / "converge.json").write_text(json.dumps(doc))
    blocks = converge_blocks(entry.parent.parent.parent, entry.parent, [])
    page = Page(title="t", level=1, blocks=blocks)
    to_html(page), to_markdown(page)
    try:
        ConvergeReport.from_dict(read_checked(entry / "converge.json", readback.CONVERGE))
    except ShapeError as err:
        assert "\n" not in str(err) and "converge.json: " in str(err)
    except (TypeError, KeyError, ValueError):
        pass  # a fitting shape whose values from_dict still refuses: named in the report as above
