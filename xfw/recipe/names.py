"""Plain names: what may name a directory xfw writes (a recipe, a suite, a suite entry, an instance's label).

Given a text; returns whether it is one plain path component (:func:`is_plain_name`), and the rule a refusal quotes
(:data:`PLAIN_NAME_RULE`). Imports nothing of xfw's, so every layer that names a directory can use it.
"""

from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]*(\.[A-Za-z0-9_+-]+)*")
"""A recipe name is one plain path component (it names run directories): letters, digits, ``_ + - .``."""
MAX_NAME_CHARS = 100
RESERVED_SUFFIXES = (".md", ".csv", ".html", ".png", ".json", ".jsonl", ".log", ".lock", ".yaml", ".safetensors")
"""A name may not end like a file xfw writes beside its run directories (report.md, chart.png, ...)."""
PLAIN_NAME_RULE = (f"must be one plain file name of at most {MAX_NAME_CHARS} characters (letters, digits, '_', '+', "
                   "'-', inner '.'), not ending like a report file (.md, .csv, .html, .png, .json, ...)")


def is_plain_name(text: object) -> bool:
    """Whether ``text`` may name a directory xfw writes (a recipe, a suite, a suite entry)."""
    return (isinstance(text, str) and NAME.fullmatch(text) is not None and len(text) <= MAX_NAME_CHARS
            and not text.lower().endswith(RESERVED_SUFFIXES))
