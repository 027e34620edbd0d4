"""What every spec object shares: the line that built it (`Origin`), one-line errors that name it (`SpecError`),
type checks of its fields against their annotations, and the `validate` hook its class fills in."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

# The frames of this package are axgen's, not the user's: the origin of an object is the first frame outside it.
_SPEC_PACKAGE = str(Path(__file__).resolve().parent)
_AXGEN_PACKAGE = Path(__file__).resolve().parent.parent


class SpecError(ValueError):
    """A one-line error that names the field, the value, and the spec file:line of the offending object."""


@dataclass(frozen=True)
class Origin:
    """Where a spec object was constructed. Errors name the line (`str(origin)`); what an emitted program prints
    names the field instead (`provenance`), so moving a line in a spec changes no program."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def provenance(self, path: str) -> str:
        """`specs/x.py: decoder.attention`: the file and the path of what was set there, without the line."""
        return f"{self.file}: {path}"


def display_path(filename: str) -> str:
    """A stable, short name for a spec file: `specs/x.py` for files in a `specs/` folder, and `backends/x.py`
    for a backend's own defaults, wherever the command runs."""
    path = Path(filename).resolve()
    if path.parent.name == "specs":
        return f"specs/{path.name}"
    if path.is_relative_to(_AXGEN_PACKAGE):
        return str(path.relative_to(_AXGEN_PACKAGE))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _caller_origin() -> Origin:
    """The first frame outside this package and the dataclasses machinery: the spec line that built the object."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = (
            os.path.dirname(filename) == _SPEC_PACKAGE
            or filename.startswith("<")
            or filename == dataclasses.__file__
        )
        if not internal:
            return Origin(display_path(filename), frame.f_lineno)
        frame = frame.f_back
    return Origin("<unknown>", 0)


def suggest(name: str, known: typing.Iterable[str]) -> str:
    """`; did you mean 'x'?` when `name` is close to one of `known`, else an empty string."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True, kw_only=True)
class SpecNode:
    """Base of every spec object: records its origin, normalises lists to tuples, checks types, validates."""

    origin: Origin | None = field(default=None, compare=False, repr=False)
    # The Hugging Face config key that supplies each field whose value changes a model's numbers: such a field has
    # no default, and the error for a missing one names the key.
    HF_KEYS: typing.ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if self.origin is None:
            object.__setattr__(self, "origin", _caller_origin())
        elif not isinstance(self.origin, Origin):
            raise SpecError(
                f"{_caller_origin()}: {type(self).__name__}.origin={self.origin!r} is where axgen records "
                "the line that built the object; a spec does not set it"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        self._check_types()
        self.validate()

    def validate(self) -> None:
        """Checks of this object's own fields; subclasses extend it."""

    def replace(self, **changes) -> typing.Self:
        """A copy with `changes` applied; the copy's origin is the line that called `replace`."""
        known = {f.name for f in dataclasses.fields(self)} - {"origin"}
        for name in changes:
            if name not in known:
                raise SpecError(
                    f"{_caller_origin()}: {type(self).__name__} has no field {name!r}{suggest(name, known)}"
                )
        return dataclasses.replace(self, origin=_caller_origin(), **changes)

    def fail(self, field_name: str, message: str) -> typing.NoReturn:
        value = getattr(self, field_name)
        raise SpecError(f"{self.origin}: {type(self).__name__}.{field_name}={value!r} {message}")

    def require_positive(self, *field_names: str) -> None:
        for name in field_names:
            if getattr(self, name) <= 0:
                self.fail(name, "must be > 0")

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.name == "origin":
                continue
            expected = hints[f.name]
            value = getattr(self, f.name)
            if not _matches(value, expected):
                self.fail(f.name, f"must be {_type_name(expected)}")
            if isinstance(value, float) and not math.isfinite(value):
                self.fail(f.name, "must be a finite number")


def _matches(value, expected) -> bool:
    origin = typing.get_origin(expected)
    if expected is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(expected))
    if origin is tuple:
        item_type = typing.get_args(expected)[0]
        return isinstance(value, tuple) and all(_matches(v, item_type) for v in value)
    if origin is dict:
        key_type, value_type = typing.get_args(expected)
        return isinstance(value, dict) and all(
            _matches(k, key_type) and _matches(v, value_type) for k, v in value.items()
        )
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(expected))
    if origin is tuple:
        return f"a list of {_plural_name(typing.get_args(expected)[0])}"
    if origin is dict:
        key_type, value_type = typing.get_args(expected)
        return f"a dict of {_plural_name(key_type)} to {_plural_name(value_type)}"
    if expected is type(None):
        return "None"
    article = "an" if expected.__name__[0] in "aeiou" else "a"
    return f"{article} {expected.__name__}"


def _plural_name(expected) -> str:
    """What a list or dict holds: `str`, `Feature`, `int or None`, without the article of a single value."""
    return re.sub(r"\ban? ", "", _type_name(expected))
