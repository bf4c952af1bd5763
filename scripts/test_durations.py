"""Write tests/durations.json from a pytest JUnit XML: seconds per xdist scope (a test file, or a class in it).

    make test JUNIT=/tmp/suite.xml
    .venv/torch/bin/python scripts/test_durations.py /tmp/suite.xml

tests/conftest.py hands the scopes to the workers longest first (a longest-first schedule ends the workers
at about the same time; in collection order a 9-minute file started last kept one worker busy alone). The figures
only order the work: a stale or missing entry changes the order, never a result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def scope_of(classname: str) -> str:
    """``tests.contract.test_x.TestPart0`` -> ``tests/contract/test_x.py::TestPart0`` (xdist's loadscope unit)."""
    parts = classname.split(".")
    i = next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "/".join(parts[:i + 1]) + ".py" + "".join(f"::{c}" for c in parts[i + 1:])


def main(xml_path: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        seconds[scope_of(case.get("classname", ""))] += float(case.get("time", 0) or 0)
    ordered = dict(sorted(((k, round(v, 1)) for k, v in seconds.items()), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(ordered)} scopes, {sum(ordered.values()) / 60:.1f} worker-minutes")


if __name__ == "__main__":
    main(sys.argv[1])
