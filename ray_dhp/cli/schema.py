"""Typed, strict loading of nested dataclasses from plain dicts (YAML) and ``key=value`` overrides.

The rules every section of the run file follows:

* a key that is not a field is an error naming its dotted path, with a suggestion (the same key
  in another section, a close key of the same section, then any close key of the file);
* values are coerced to the field's annotated type (``int``, ``float``, ``str``, ``bool``,
  ``tuple``/``list``, ``dict``, ``Optional[...]``): YAML reads ``1e-3`` as a string, overrides
  arrive as strings, and both become floats here;
* then checked against what the field accepts (`ray_dhp.config.checks.Check` in its metadata: bounds,
  choices; numbers are always finite), naming the dotted key;
* a field whose metadata names a ``section`` is a nested dataclass (loaded recursively); its
  ``shorthand`` lets a scalar stand for one field (``placement: disjoint``); an ``optional``
  section (``audio``) is None unless the file gives it;
* help strings live in field metadata (``help``) or, for borrowed fields, in the ``Args:`` block
  of the owning class's docstring (`doc_args`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import MISSING, field, fields
from typing import Any, Iterable, Optional

from ray_dhp.config.checks import Check, ConfigError, check_of, coerce

__all__ = ["ConfigError", "Check", "doc_args", "field_help", "file_fields", "borrow", "option", "section", "from_dict", "leaf_keys",
           "apply_overrides", "set_dotted", "coerce"]




def doc_args(cls) -> dict:
    """``{name: help}`` from the ``Args:`` block of ``cls.__doc__`` (``a, b: text`` names two)."""
    lines = (cls.__doc__ or "").splitlines()
    out: dict = {}
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Args:")
    except StopIteration:
        return out
    base = len(lines[start]) - len(lines[start].lstrip())
    names, entry_indent = None, None
    for ln in lines[start + 1:]:
        indent = len(ln) - len(ln.lstrip())
        if ln.strip() and indent <= base:
            break
        m = re.match(r"^(\s+)([\w, ]+):\s*(.*)$", ln)
        if m and (entry_indent is None or len(m.group(1)) == entry_indent):
            entry_indent = len(m.group(1))
            names = [n.strip() for n in m.group(2).split(",")]
            for n in names:
                out[n] = m.group(3).strip()
        elif names and ln.strip():
            for n in names:
                out[n] = f"{out[n]} {ln.strip()}"
    return {k: re.sub(r"``?", "", v) for k, v in out.items()}


def field_help(cls, f) -> str:
    """The help string of field ``f`` of ``cls``: its metadata, else the ``Args:`` entry of the
    class that declares it (``cls`` or a base: a run-file section extends a loop section)."""
    if f.metadata.get("help"):
        return f.metadata["help"]
    for owner in getattr(cls, "__mro__", [cls]):
        text = doc_args(owner).get(f.name)
        if text:
            return text
    return ""


def file_fields(cls) -> list:
    """The fields of the dataclass ``cls`` that a run file has (not those the runtime fills in,
    marked ``metadata={"runtime": True}``, such as ``data.dataset_paths``)."""
    return [f for f in fields(cls) if not f.metadata.get("runtime")]


def option(default: Any = None, help: str = "", *, factory=None, **check):
    """A plain field with a help string and what it accepts (`ray_dhp.config.checks.Check` keywords:
    ``gt``, ``ge``, ``lt``, ``le``, ``length``, ``choices``; numbers must be finite anyway)."""
    meta = {"help": help, "check": Check(**check)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str, shorthand: Optional[str] = None, optional: bool = False):
    """A nested section field of type ``cls`` (default: ``cls()``). ``optional``: absent (or
    null) by default, the field then None; any mapping given (``{}`` too) makes it a ``cls``."""
    meta = {"help": help, "section": cls, "shorthand": shorthand, "optional": optional}
    if optional:
        return field(default=None, metadata=meta)
    return field(default_factory=cls, metadata=meta)


def borrow(owner, names: Iterable[str], rename: Optional[dict] = None) -> list:
    """``make_dataclass`` specs copying type, default and help of ``owner``'s fields.

    The run file's sections reuse the library's dataclasses this way instead of repeating their
    fields and defaults; ``rename`` maps a section key to a differently named owner field.
    """
    rename = rename or {}
    docs, by_name = doc_args(owner), {f.name: f for f in fields(owner)}
    specs = []
    for name in names:
        src = by_name[rename.get(name, name)]
        help_ = docs.get(src.name) or src.metadata.get("help", "")
        meta = {"help": help_, "source": f"{owner.__name__}.{src.name}", "check": check_of(src)}
        if src.default is not MISSING:
            spec = field(default=src.default, metadata=meta)
        else:
            spec = field(default_factory=src.default_factory, metadata=meta)
        specs.append((name, src.type, spec))
    return specs


# -- loading ----------------------------------------------------------------------------------

def leaf_keys(cls, prefix: str = "") -> list:
    """Every dotted key of the dataclass ``cls`` (sections expanded)."""
    out = []
    for f in file_fields(cls):
        dotted = f"{prefix}{f.name}"
        sub = f.metadata.get("section")
        out.extend(leaf_keys(sub, dotted + ".") if sub else [dotted])
    return out


def _suggest(dotted: str, key: str, known: list, root) -> str:
    """The 'did you mean' part of an unknown-key error."""
    everywhere = leaf_keys(root) if root is not None else []
    same_leaf = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    if same_leaf:  # the exact key of another section
        return f"; did you mean {same_leaf[0]!r}?"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        parent = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
        return f"; did you mean {parent + close[0]!r}?"
    close = difflib.get_close_matches(dotted, everywhere, n=1, cutoff=0.7)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known keys here: {', '.join(sorted(known))}."


def from_dict(cls, data: Any, path: str = "", root=None):
    """Build the dataclass ``cls`` from ``data``, strictly (see the module docstring)."""
    root = root or cls
    where = path or "the run file"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {data!r}.")
    known = {f.name: f for f in file_fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in known:
            what = "unknown key" if path else "unknown section"
            raise ConfigError(f"{dotted}: {what}{_suggest(dotted, str(key), list(known), root)}")
        kwargs[key] = _field_value(known[key], value, dotted, root)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _field_value(f: dataclasses.Field, value: Any, dotted: str, root):
    sub = f.metadata.get("section")
    if sub is None:
        value = coerce(value, f.type, dotted)
        reason = check_of(f).error(value)
        if reason:
            raise ConfigError(f"{dotted}: {reason}.")
        return value
    if value is None and f.metadata.get("optional"):
        return None
    shorthand = f.metadata.get("shorthand")
    if shorthand and value is not None and not isinstance(value, dict):
        value = {shorthand: value}
    return from_dict(sub, value, dotted, root)


def _parse_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def set_dotted(data: dict, key: str, value: Any, shorthands: Optional[dict] = None) -> dict:
    """A copy of the raw dict ``data`` with ``a.b.c`` set to ``value`` (a dict value set on a
    section is merged into it). Typing and unknown keys are checked later by `from_dict`."""
    shorthands = shorthands or {}
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"malformed key {key!r}.")
    data = dict(data or {})
    node = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        child = node.get(part)
        name = ".".join(parts[:depth + 1])
        if child is not None and not isinstance(child, dict) and (not last or isinstance(value, dict)):
            if name not in shorthands:
                raise ConfigError(f"{key}: {name} is a value, not a section.")
            child = {shorthands[name]: child}
        if last:
            node[part] = {**child, **value} if isinstance(child, dict) and isinstance(value, dict) \
                else value
        else:
            node[part] = dict(child or {})
            node = node[part]
    return data


def apply_overrides(data: dict, overrides: Iterable[str], shorthands: Optional[dict] = None) -> dict:
    """Set ``a.b.c=value`` overrides on (a copy of) the raw dict ``data``; values parse as YAML.

    Typing and unknown-key checks happen afterwards in `from_dict`, so a misspelt override gets the
    same dotted "did you mean" error as a misspelt YAML key. ``shorthands`` maps a section name to
    the field its scalar form stands for (``placement: disjoint`` + ``placement.schedule=...``).
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. optim.lr=3e-4.")
        key, text = item.split("=", 1)
        data = set_dotted(data, key, _parse_value(text), shorthands)
    return data
