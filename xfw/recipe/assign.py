"""One ``--set key.path=value`` applied to a recipe's plain data (before it is validated): the value
parsed as YAML (a command's item or variable kept as typed text), a number in the path indexing a
list, an instance's label (``backends.paddle@3.2.1``) keeping its dots. Used by
:func:`xfw.recipe.load_recipe`, which turns a :class:`SetError` into its one-line RecipeError."""

from __future__ import annotations

from xfw.recipe import command
from xfw.recipe.yamlfile import YamlError, load_text


class SetError(ValueError):
    """A ``--set`` that cannot apply; its message names the file and the key."""


def apply_override(data: dict, assignment: str, source: str) -> None:
    """Apply one ``key.path=value`` (value parsed as YAML) to plain recipe data, in place; a number
    in the path indexes a list (``backends.torch.command.3=--max_steps=40``)."""
    if "=" not in assignment:
        raise SetError(f"{source}: --set {assignment!r}: expected key.path=value")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) > 2 and keys[0] == "backends" and "@" in keys[1]:  # an instance: paddle@3.2.0 keeps its dots
        end = 2
        while end < len(keys) and keys[end][:1].isdigit():
            end += 1
        keys = [keys[0], ".".join(keys[1:end]), *keys[end:]]
    if not all(keys):
        raise SetError(f"{source}: --set {assignment!r}: empty key in {path!r}")
    if not path.isprintable():  # a line break in a key would break the one-line error naming it
        raise SetError(f"{source}: --set {path.strip()!r}: a key holds a control character")
    try:  # a command's item or variable is text as typed (``...command.3=40`` is "40", not 40)
        value = raw if command.takes_text(keys) else load_text(raw, f"{source}: --set {path}: value {raw[:80]!r}")
    except YamlError as err:
        raise SetError(str(err)) from None
    node = data
    for i, key in enumerate(keys):
        if isinstance(node, list):  # a list item by its index: backends.torch.command.3=--max_steps=40
            if not key.isdigit() or int(key) >= len(node):
                raise SetError(f"{source}: --set {path}: {'.'.join(keys[:i])} is a list of {len(node)} "
                                  f"items; {key!r} is not one of its indices")
            key = int(key)
        elif not isinstance(node, dict):
            raise SetError(f"{source}: --set {path}: {'.'.join(keys[:i])} is not a mapping")
        if i == len(keys) - 1:
            node[key] = value
            break
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = node[key] = {}
        node = child
