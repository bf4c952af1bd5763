"""YAML as xfw reads it: recipes, suites and ``--set`` values, through one strict loader.

``yaml.safe_load`` builds only plain data, but it still expands aliases (a few hundred bytes can
name billions of nodes), lets a repeated key silently win, and reads any encoding. Here::

    load_file("recipes/x.yaml")        # -> plain data, or YamlError with one line:
    # recipes/x.yaml: line 4: invalid YAML (duplicate key 'batch' (the first is on line 2))
    # recipes/x.yaml: line 7: invalid YAML (anchors and aliases (&name, *name) are not allowed)
    # recipes/x.yaml: not UTF-8 text (byte 0xff at offset 12)

Refused: anchors and aliases, duplicate keys, nesting deeper than :data:`MAX_DEPTH`, files over
:data:`MAX_BYTES`, text that is not UTF-8, and mapping keys that are not strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from xfw.contract.atomic import UnreadableFile, read_bounded
from yaml.events import AliasEvent
from yaml.nodes import MappingNode

MAX_BYTES = 1 << 20
"""Largest recipe or suite file read (1 MiB; the seed recipes are under 1 KiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists (a recipe needs 4)."""


class YamlError(ValueError):
    """The message is one complete line naming the source (and the line, where there is one)."""


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent) or getattr(self.peek_event(), "anchor", None):
            mark = self.peek_event().start_mark
            raise yaml.MarkedYAMLError(problem="anchors and aliases (&name, *name) are not allowed",
                                       problem_mark=mark)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.MarkedYAMLError(problem=f"nested deeper than {MAX_DEPTH} levels",
                                       problem_mark=self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.MarkedYAMLError(problem=f"key {key!r} is not a string", problem_mark=key_node.start_mark)
            if key in seen:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r} (the first is on line {seen[key] + 1})",
                                           problem_mark=key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _describe(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{where}invalid YAML ({problem})"


def load_text(text: str, source: str) -> Any:
    """Parse ``text``; YamlError ``"<source>: line N: <problem>"``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except yaml.YAMLError as err:
        raise YamlError(f"{source}: {_describe(err)}") from None
    except RecursionError:
        raise YamlError(f"{source}: nested too deeply") from None


def load_file(path: str | Path, what: str = "file") -> Any:
    """Read and parse a UTF-8 YAML file of at most :data:`MAX_BYTES`; None for an empty file."""
    source = str(path)
    try:
        # a file named by the user (a recipe, a suite): a link may lead anywhere; never a FIFO or device
        raw = read_bounded(path, MAX_BYTES, within="/")
    except OSError as err:
        raise YamlError(f"{source}: cannot read {what} ({err.strerror})") from None
    except UnreadableFile as err:
        if "larger than" in str(err):
            raise YamlError(f"{source}: larger than {MAX_BYTES // 1024} KiB; not a {what}") from None
        raise YamlError(f"{str(err)} ({what})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlError(f"{source}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    return load_text(text, source)
