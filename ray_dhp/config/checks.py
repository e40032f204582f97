"""What each configuration key accepts, declared next to its default, and one checker for all.

A dataclass field declares its range with `checked` (or `ray_dhp.cli.schema.option(..., ge=1)`
in the run file's own sections)::

    lr: float = checked(1e-3, gt=0)
    betas: tuple = checked((0.9, 0.999), length=2, ge=0, lt=1)
    lr_schedule: str = checked("constant", choices=("constant", "cosine", "linear"))

`check_fields` validates every declared field of an object; the run-file loader applies the same
`Check` to each key as it reads it, so ``ray-dhp plan``, ``config`` and ``train`` and the Python
API (``train_loop_config=``) reject the same values. Numbers must be finite in every case.

Messages name keys through a *namer* (``train_loop_config.lr`` from Python, ``optim.lr`` in a
run file): a `ConfigError` built with `ConfigError.about` keeps its template (keys written as
``{field}``) so that a front end can `ConfigError.renamed` it with its own key names.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

__all__ = ["ConfigError", "Check", "checked", "check_fields", "coerce", "keyed"]


_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][\w.]*)\}")


def render(template: str, name: Callable[[str], str]) -> str:
    """``template`` with each ``{field}`` (or dotted ``{section.field}``) replaced by
    ``name(field)`` (``{{`` is a brace)."""
    return _FIELD.sub(lambda m: m.group(0)[0] if m.group(1) is None else name(m.group(1)),
                      template)


def _rebase(template: str, prefix: str) -> str:
    """``template`` with each ``{field}`` written ``{prefix.field}`` (escapes kept)."""
    return _FIELD.sub(lambda m: m.group(0) if m.group(1) is None
                      else "{" + f"{prefix}.{m.group(1)}" + "}", template)


class ConfigError(ValueError):
    """A configuration error that names the key (its dotted run-file path, or its
    ``train_loop_config`` key from Python) and says how to fix it."""

    def __init__(self, message: str, template: Optional[str] = None):
        super().__init__(message)
        self.template = template

    @classmethod
    def about(cls, template: str, name: Callable[[str], str]) -> "ConfigError":
        """An error whose ``template`` names keys as ``{field}``, rendered with ``name``."""
        return cls(render(template, name), template)

    def renamed(self, name: Callable[[str], str]) -> "ConfigError":
        """The same error with the keys named by ``name`` (unchanged if it has no template)."""
        return ConfigError(render(self.template, name), self.template) if self.template else self

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its keys inside the section ``prefix`` (``{lr}`` ->
        ``{optim.lr}``): a section's own error, as its parent names it."""
        if not self.template:
            return self
        template = _rebase(self.template, prefix)
        return ConfigError(render(template, str), template)


KEY = "\x00"  # stands for the key in messages of checks that take the key's name as text


@contextmanager
def keyed(field: str):
    """Inside, a check told that its key is called `KEY` raises a `ConfigError` whose template
    names ``{field}`` instead (so that the caller's names apply, `ConfigError.renamed`)."""
    try:
        yield KEY
    except ConfigError as e:
        if KEY not in str(e):
            raise
        template = str(e).replace("{", "{{").replace("}", "}}").replace(KEY, "{" + field + "}")
        raise ConfigError.about(template, str) from None


# -- types ---------------------------------------------------------------------------------

_BASE = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple, "list": list,
         "dict": dict}


def _parse_type(type_) -> tuple:
    """(base python type or None for Any, optional?) of an annotation (string or type)."""
    t = type_ if isinstance(type_, str) else getattr(type_, "__name__", str(type_))
    optional = t.startswith("Optional[")
    if optional:
        t = t[len("Optional["):-1]
    return _BASE.get(t.split("[")[0]), optional


def coerce(value: Any, type_, dotted: str) -> Any:
    """``value`` converted to the annotated type, or ConfigError naming ``dotted``."""
    name = type_ if isinstance(type_, str) else getattr(type_, "__name__", str(type_))
    if name.startswith("Union["):  # Union[int, bool]: a bool stays a bool, else the first type
        # that takes the value
        members = [m.strip() for m in name[len("Union["):-1].split(",")]
        if isinstance(value, bool) and "bool" in members:
            return value
        if value is None:
            raise ConfigError(f"{dotted}: null is not allowed here; give a {' or '.join(members)}.")
        first = None
        for m in members:  # the first type that takes the value (Union[str, list]: a grouping)
            try:
                return coerce(value, m, dotted)
            except ConfigError as e:
                first = first or e
        raise first
    base, optional = _parse_type(type_)
    if base is str and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None:
        if optional or base is None:
            return None
        raise ConfigError(f"{dotted}: null is not allowed here; give a {base.__name__}.")
    if base is None:
        return value
    ok = not isinstance(value, bool) or base is bool
    try:
        if base is bool and isinstance(value, bool):
            return value
        if base is int and ok and isinstance(value, (int, str)):
            return int(value)
        if base is int and ok and isinstance(value, float) and value.is_integer():
            return int(value)
        if base is float and ok and isinstance(value, (int, float, str)):
            return float(value)
        if base is str and ok and isinstance(value, (str, int, float)):
            return str(value)
        if base in (tuple, list) and isinstance(value, (list, tuple)):
            return base(value)
        if base is dict and isinstance(value, dict):
            return value
    except ValueError:
        pass
    raise ConfigError(f"{dotted}: expected {'null or ' if optional else ''}{base.__name__}, "
                      f"got {value!r}.")



# -- ranges -----------------------------------------------------------------------------------

def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Check:
    """Accepted values beyond the type: bounds for numbers (always finite; for a tuple or dict,
    bounds apply to each item), a tuple's ``length``, or a set of ``choices``."""

    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    le: Optional[float] = None
    length: Optional[int] = None
    choices: Optional[tuple] = None

    def describe(self) -> str:
        """What is accepted, in words (``> 0``, ``>= 0 and < 1``, ``one of a, b``)."""
        parts = [f"{op} {v:g}" for op, v in ((">", self.gt), (">=", self.ge), ("<", self.lt),
                                             ("<=", self.le)) if v is not None]
        text = " and ".join(parts)
        if self.length is not None:
            text = f"{self.length} numbers" + (f", each {text}" if text else "")
        if self.choices is not None:
            text = "one of " + ", ".join("null" if c is None else str(c) for c in self.choices)
        return text

    def _number(self, x: Any) -> bool:
        if not _num(x) or not math.isfinite(x):
            return False
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    def error(self, value: Any) -> Optional[str]:
        """None if ``value`` is accepted (None always is: the type decides about null), else why not."""
        if value is None:
            return None
        if self.choices is not None:
            return None if value in self.choices else f"must be {self.describe()}, got {value!r}"
        bounded = any(v is not None for v in (self.gt, self.ge, self.lt, self.le))
        if isinstance(value, (list, tuple)):
            if self.length is not None and len(value) != self.length:
                return f"must be {self.describe()}, got {list(value)!r}"
            items = list(value)
        elif isinstance(value, dict):
            items = list(value.values())
        else:
            items = [value]
        bad = [x for x in items if (_num(x) or bounded) and not self._number(x)]
        if bad:
            what = self.describe() or "finite"
            return f"must be {what}, got {value!r}"
        return None


def checked(default: Any = None, *, factory: Optional[Callable] = None, help: str = "",
            **check) -> Any:
    """A dataclass field with a default and the `Check` of what it accepts (plus finiteness)."""
    meta = {"check": Check(**check)}
    if help:
        meta["help"] = help
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_of(f) -> Check:
    """The declared `Check` of a dataclass field (numbers are still required to be finite)."""
    return f.metadata.get("check") or Check()


def check_fields(obj, name: Callable[[str], str]) -> None:
    """ConfigError naming ``name(field)`` for the first field of ``obj`` it does not accept."""
    for f in fields(obj):
        reason = check_of(f).error(getattr(obj, f.name))
        if reason:
            raise ConfigError.about(f"{{{f.name}}}: {reason.replace('{', '{{').replace('}', '}}')}.",
                                    name)
