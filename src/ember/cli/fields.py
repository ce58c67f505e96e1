"""Flags declared from the configuration dataclasses: each flag's default and help come from the field it sets
(its default, its attribute docstring), as vLLM derives its argparse from its config classes, so a default or a
description is written once, in ember.config."""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import re
import textwrap
from dataclasses import MISSING, fields
from functools import cache
from typing import Any

__all__ = ["add_field_flag", "field_default", "field_doc"]


@cache
def _docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal after its declaration), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def field_doc(cls: type, name: str) -> str:
    """The docstring of field `name` of dataclass `cls` (empty when it has none), on one line."""
    if name not in {f.name for f in fields(cls)}:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    return _docs(cls).get(name, "")


def field_default(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def add_field_flag(
    p: argparse.ArgumentParser,
    flags: str | tuple[str, ...],
    cls: type,
    name: str,
    *,
    shown: str | None = None,
    default: Any = None,
    **kwargs: Any,
) -> None:
    """Declare a flag that sets `cls.name`: its help is the field's docstring, with the default shown (`shown`
    where the flag spells it in other units, e.g. milliseconds for seconds). The parsed value is None when the flag is
    not given (the field's default applies where the config is built) unless `default` says otherwise."""
    names = (flags,) if isinstance(flags, str) else flags
    value = field_default(cls, name)
    if shown is None:
        shown = "off" if value is None or value is False else str(value)
    doc = re.sub(r";\s*None:[^.;]*", "", field_doc(cls, name)).rstrip(".")  # the flag's default is shown instead
    help_text = f"{doc} (default: {shown})" if doc else f"(default: {shown})"
    p.add_argument(*names, default=default, help=help_text.replace("%", "%%"), **kwargs)
