"""What every file gpipe-plan writes has in common: a kind, a format version, atomic writes,
byte-for-byte stable JSON, a digest, and loading that fails with one clear line.

Torch-free on purpose: `plan`, `check` and `show` load these without importing torch.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import select
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationError,
    model_serializer,
)


class InputError(Exception):
    """Bad input from the user: the CLI prints the message as one line and exits with status 2."""


A = TypeVar("A", bound="Artifact")


class LaterFields(BaseModel):
    """A part of a file (a cluster's link, a plan's stage) that gained fields later: each is
    left out of its JSON where unset, so a file that does not use it keeps its bytes, its
    digest and its readability by an older gpipe-plan of the same format version."""

    LATER_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_unset_later(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name in self.LATER_FIELDS:
            if getattr(self, name) is None:
                data.pop(name, None)
        return data


class Artifact(BaseModel):
    """A pydantic model that lives on disk as JSON. Subclasses set `kind` and `FORMAT_VERSION`."""

    model_config = ConfigDict(extra="forbid")

    FORMAT_VERSION: ClassVar[int] = 1
    # fields added later, left out where unset: such a file stays readable by an older
    # gpipe-plan of the same format version, and its digest does not move with the field
    LATER_FIELDS: ClassVar[tuple[str, ...]] = ()
    # a key written twice in one object refused (the JSON parsers keep the last): for the kinds
    # people write by hand (a cluster's duplicated "devices" went unsaid: found by a red team);
    # the tool's own files, up to tens of MB, are not parsed a second time for it
    HAND_WRITTEN: ClassVar[bool] = False
    kind: str
    format_version: StrictInt = 1  # (lax, "9" or true would read as a number)

    def _unset_later(self) -> set[str]:
        """The later fields left out because unset."""
        return {name for name in self.LATER_FIELDS if getattr(self, name, None) is None}

    def _data(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude=self._unset_later())

    def canonical_json(self, *, with_meta: bool = True) -> str:
        """Sorted keys, fixed indentation: the same artifact always gives the same bytes."""
        data = self._data()
        if not with_meta:
            data.pop("meta", None)
        return json.dumps(data, sort_keys=True, indent=1) + "\n"

    def digest(self) -> str:
        """sha256 of the content, `meta` excluded, so re-running on the same input keeps it.
        Compact sorted JSON: the same content always, and json's C encoder (indented output
        takes its pure-Python path, seconds on a 10 000-layer profile)."""
        data = self._data()
        data.pop("meta", None)
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        from .files import write_output

        write_output(path, self.canonical_json())

    @classmethod
    def load(cls: type[A], path: str | os.PathLike[str]) -> A:
        return cls.from_json_text(_read(Path(path)), source=str(path))

    @classmethod
    def from_json_text(cls: type[A], text: str, *, source: str = "<input>") -> A:
        # pydantic parses and validates in one pass (1.5x faster on a 10 000-layer profile);
        # anything it refuses, or a kind or version not ours, takes the checked path below
        # for its message. Strict: in a file, true is no number and "8" no count (Python
        # callers still pass numpy's integers to the constructors)
        if cls.HAND_WRITTEN:
            _no_key_twice(text, source)
        try:
            with _no_collection():
                fast = cls.model_validate_json(text, strict=True)
        except (ValidationError, ValueError):
            pass
        else:
            if (
                "kind" in fast.model_fields_set  # (the field has a default: a file must name it)
                and fast.kind == cls.model_fields["kind"].default
                and fast.format_version == cls.FORMAT_VERSION
            ):
                return fast
        return cls._checked(text, source)

    @classmethod
    def _checked(cls: type[A], text: str, source: str) -> A:
        expected = cls.model_fields["kind"].default
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{source}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
            ) from None
        except RecursionError:
            raise InputError(
                f"{source}: not a gpipe-plan {expected} file (nested too deeply)"
            ) from None
        except ValueError as e:  # a number past what Python reads (4300 digits)
            raise InputError(f"{source}: not valid JSON ({str(e).split(':')[0]})") from None
        if not isinstance(data, dict) or "kind" not in data:
            raise InputError(f"{source}: not a gpipe-plan {expected} file (no 'kind' field)")
        if data["kind"] != expected:
            kind = data["kind"]
            if not isinstance(kind, str):  # (found by a red team: "is a True", "is a None")
                raise InputError(
                    f"{source}: its kind is {_clipped(json.dumps(kind))}, not a name; a "
                    f"{expected} is expected here"
                )
            shown = _clipped(kind if kind.isprintable() else ascii(kind))  # one short line
            raise InputError(f"{source} is a {shown}, but a {expected} is expected here")
        version = data.get("format_version")
        if "format_version" in data and (isinstance(version, bool) or not isinstance(version, int)):
            raise InputError(  # ("9" would be read as 9 past the checks below, True as 1)
                f"{source}: format_version {_clipped(json.dumps(version))} is not a whole "
                f"number; this gpipe-plan writes {cls.FORMAT_VERSION}"
            )
        if isinstance(version, int) and version > cls.FORMAT_VERSION:
            raise InputError(
                f"{source}: {expected} format version {version} is newer than this gpipe-plan "
                f"understands ({cls.FORMAT_VERSION}); upgrade gpipe-plan"
            )
        if isinstance(version, int) and version < cls.FORMAT_VERSION:
            raise InputError(
                f"{source}: {expected} format version {version} was written by an older "
                f"gpipe-plan (this one reads {cls.FORMAT_VERSION}); make the {expected} again"
            )
        # The Python reading first, for its messages (a lone surrogate, a deep nesting: the
        # JSON parser words them worse; a cold review's), then the strict one, whose own
        # refusals (true, "8" or 8.0 as a count) come first where both refuse
        try:
            cls.model_validate(data)
        except ValidationError as lax:
            try:
                cls.model_validate_json(text, strict=True)
            except ValidationError as strict:
                if strict.errors()[0]["type"] in _STRICT_ONLY:
                    raise _invalid(strict, source, expected) from None
            raise _invalid(lax, source, expected) from None
        try:
            return cls.model_validate_json(text, strict=True)
        except ValidationError as e:
            raise _invalid(e, source, expected) from None


_STRICT_ONLY = {"int_type", "float_type", "bool_type", "string_type"}  # (lax reads these)


def _no_key_twice(text: str, source: str) -> None:
    """InputError where an object of `text` names a key twice. Text that is not JSON passes:
    the reading after words that."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                shown = _clipped(key if key.isprintable() else ascii(key))
                raise InputError(
                    f"{source}: the key {shown!r} is written twice in one object (only the "
                    "last would count); write it once"
                )
            seen.add(key)
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # (not JSON: said by the reading that follows)
        pass


def _invalid(e: ValidationError, source: str, expected: str) -> InputError:
    """A validation error as one line that names the field."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "unexpected_keyword_argument":  # (a dataclass's: a file's key)
        msg = "Extra inputs are not permitted"
    if first["type"] == "dataclass_type":  # (a Timing given as a list or a string)
        msg = "should be an object of median, min and max (ms)"
    if first["type"] == "string_pattern_mismatch" and "\\x00" in str(first.get("ctx")):
        msg = "holds a control, direction or invisible character"
    return InputError(f"{source}: invalid {expected}: {where + ': ' if where else ''}{msg}")


def _clipped(text: object, most: int = 60) -> str:
    """A value from a file, shown in one short line."""
    text = str(text)
    return text if len(text) <= most else text[: most - 3] + "..."


MAX_FILE_BYTES = 2**30  # far past a 100 000-layer profile; /dev/zero is not a profile
FIFO_FIRST_S = 5.0  # how long a pipe may keep us waiting for its first bytes
FIFO_WAIT_S = 30.0  # ... and for each next ones
FIFO_TOTAL_S = 120.0  # ... and for the whole of it


def _read_fifo(path: Path) -> bytes:
    """A named pipe (or `<(...)`): read without blocking on the open, so a pipe that nobody
    writes to is refused after FIFO_FIRST_S instead of hanging; once bytes flow, a writer may
    pause up to FIFO_WAIT_S."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        chunks: list[bytes] = []
        total = 0
        until = time.monotonic() + FIFO_TOTAL_S  # (a writer that trickles never pauses long)
        while total <= MAX_FILE_BYTES:
            wait = FIFO_WAIT_S if chunks else FIFO_FIRST_S
            if time.monotonic() > until:
                raise InputError(f"{path}: a pipe still sending after {FIFO_TOTAL_S:g} s")
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                raise InputError(f"{path}: a pipe that sent nothing for {wait:g} s")
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if not data:
        raise InputError(f"{path}: a pipe with nothing in it (nobody writes to it)")
    return data


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection while a file becomes objects: a 10 000-layer profile makes
    about a million, which are no cycles, and the collector otherwise rescans the growing heap
    again and again (2x the whole load)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _read(path: Path) -> str:
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISCHR(mode):  # a terminal (/dev/stdin at a prompt), /dev/zero: no file ends
            raise InputError(f"{path}: is a character device (a terminal?); give a file or a pipe")
        data = _read_fifo(path) if stat.S_ISFIFO(mode) else None
        if data is None:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise InputError(f"{path}: larger than 1 GiB; not a gpipe-plan file")
        return data.decode()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a JSON file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
