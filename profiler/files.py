"""Writing outputs without destroying anything: every file gpipe-plan writes goes through here.

An output is checked before any long work starts (`check_output`) and written all or nothing
(`write_output`): into a temporary file beside the target, renamed over it only when it is a
regular file or does not exist yet. A symlink is followed (the link stays, its target gets the
new content). A device, FIFO, socket or directory is refused, and so is a path that names one of
the command's own inputs, one of gpipe-plan's own source files, a module the command has
loaded, or anything in the Python installation (its libraries and scripts); so is a path that
reaches an open file descriptor (/dev/stdout, /proc/self/fd/1), whose file a shell's redirect
holds. A new file gets the mode the umask allows, an existing file keeps its mode (and, where
the process may, its owner).

Torch-free, like artifact.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from .artifact import InputError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def check_output(
    path: str | os.PathLike[str], *, flag: str = "-o", inputs: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """The file `path` resolves to, once it is known that writing there destroys nothing and
    can succeed. `flag` names the output in messages; `inputs` are the files the command reads."""
    shown = f"{flag} {path}" if flag else str(path)
    if not os.fspath(path):  # os.stat("") fails as if missing, realpath("") is the directory
        raise InputError(f"{flag or 'the output'}: an empty path; name a file to write")
    target = Path(os.path.realpath(path))
    named = os.fspath(path)
    if (named.endswith(("/", os.sep)) or os.path.basename(named) in (".", "..")) and not (
        os.path.isdir(path)
    ):
        # (found by a red team: realpath drops the slash, and a file took the folder's name)
        raise InputError(f"{shown}: ends as a folder's path does; name a file to write")
    folder = os.path.dirname(named) or "."
    if not os.path.isdir(folder):
        # (found by a red team: `nosuch/../in.json` cannot be looked up, so the checks below
        # saw no file, while its real path, made by dropping `nosuch/..`, was the input)
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise InputError(f"{shown}: {folder} {what}")
    try:
        st = os.stat(path)  # what the path names, through any links (/dev/stdout: a pipe)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise InputError(f"{shown}: cannot use it as an output ({e.strerror})") from None
    if st is not None:
        for test, kind in _KINDS:
            if test(st.st_mode):
                raise InputError(f"{shown}: is {kind}, not a regular file; name a file to write")
        if (fd := _through_descriptor(path)) is not None:
            raise InputError(
                f"{shown}: names an open file descriptor ({fd}), whose file ({target}) a new "
                "one would replace, losing what a redirect wrote there: name a file to write; "
                "an output cannot go to a stream"
            )
        for source in inputs:
            if _same(path, source):
                raise InputError(
                    f"{shown}: is also this command's input {source}; write to another file"
                )
        if not os.access(path, os.W_OK):
            raise InputError(f"{shown}: the file is not writable")
    if (what := _code(target)) is not None:
        raise InputError(f"{shown}: is {what}; write to another file")
    directory = target.parent
    if not directory.is_dir():
        raise InputError(f"{shown}: directory {directory} does not exist")
    try:  # the only sure test that the directory takes a new file (permissions, read-only fs)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise InputError(f"{shown}: cannot write in {directory} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return target


_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("planner", "profiler", "schedules", "codegen")


_DESCRIPTOR = re.compile(r"/(?:proc/[^/]+|dev)/fd/\d+|/dev/std(?:in|out|err)")


def _through_descriptor(path: str | os.PathLike[str]) -> str | None:
    """The /dev/fd/N, /proc/PID/fd/N or /dev/stdout-like path that `path` reaches through its
    links, if any: what it names is an open descriptor's file (a redirect's), which write_output
    would replace by a new file rather than write through."""
    at = os.path.abspath(path)
    for _ in range(40):  # (the kernel's own limit on links followed)
        if _DESCRIPTOR.fullmatch(at):
            return at
        parent, name = os.path.split(at)
        real = os.path.join(os.path.realpath(parent), name)
        if _DESCRIPTOR.fullmatch(real):
            return real
        if not os.path.islink(real):
            return None
        at = os.path.normpath(os.path.join(os.path.dirname(real), os.readlink(real)))
    return None


def _installed() -> list[Path]:
    """Where Python and its packages are installed: no output belongs there."""
    import site
    import sysconfig

    # (not the prefix itself: /usr, or a project that is its own virtual environment, holds
    # the user's own folders too)
    kinds = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    places = {sysconfig.get_paths().get(k, "") for k in kinds}
    with contextlib.suppress(Exception):  # (a site module without them: an embedded Python)
        places.update(site.getsitepackages())
        places.add(site.getusersitepackages())
    found = {Path(os.path.realpath(p)) for p in places if p and os.path.isdir(p)}
    return sorted(found, key=lambda p: len(p.parts), reverse=True)  # the most specific first


def _code(target: Path) -> str | None:
    """What `target` is, if it is code this tool runs: one of its own source files (the ranks of
    a torchrun launch import them afresh), a module this process has loaded, or anything inside
    the Python installation or its packages (torch's own modules, which a command that does not
    load them would not see)."""
    if target.suffix == ".py" and (
        target == _ROOT / "cli.py" or any(target.is_relative_to(_ROOT / p) for p in _PACKAGES)
    ):
        return "one of gpipe-plan's own source files"
    for module in list(sys.modules.values()):
        where = getattr(module, "__file__", None)  # (by name first: realpath costs a stat)
        if (
            where
            and os.path.basename(where) == target.name
            and os.path.realpath(where) == str(target)
        ):
            return f"the source of module {module.__name__}, which this command runs"
    for place in _installed():
        if target.is_relative_to(place) and place != Path(place.anchor):
            return f"inside the Python installation ({place})"
    return None


def check_distinct(outputs: dict[str, str | None]) -> None:
    """Two outputs of one command must not be the same file (flag -> path, None when unused)."""
    given = [(flag, path) for flag, path in outputs.items() if path]
    for k, (flag, path) in enumerate(given):
        for other, path2 in given[:k]:
            if os.path.realpath(path) == os.path.realpath(path2):
                raise InputError(f"{flag} {path}: is also the output of {other}; name two files")


def write_output(
    path: str | os.PathLike[str], content: str | bytes | Callable[[str], None]
) -> None:
    """Write `content` (text, bytes, or a function that writes a file at the path it is given)
    to `path`, all or nothing. Call `check_output` first for the refusals it makes (this
    refuses again, as it writes, gpipe-plan's code and what this process has loaded since)."""
    target = Path(os.path.realpath(path))
    # (found by a red team: a module a model's forward imported as it ran, after check_output)
    if (what := _code(target)) is not None:
        raise InputError(f"{path}: is {what}; write to another file")
    if sys.stdout is not None:  # what the command printed first reaches the terminal first:
        try:  # where it cannot (`> /dev/full`), no file is written
            sys.stdout.flush()
        except BrokenPipeError:  # (a reader that left, `| head`: the file is still wanted)
            pass
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: is not a regular file; name a file to write")
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=target.parent
    )
    try:
        if callable(content):
            os.close(fd)
            content(tmp)
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        _take_mode(tmp, st)
        os.replace(tmp, target)
    except OSError as e:  # a full disk, a file size limit: nothing written, one line
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _take_mode(tmp: str, existing: os.stat_result | None) -> None:
    """mkstemp makes 0600: give the file the mode (and owner) a plain open() would have left."""
    if existing is None:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        return
    os.chmod(tmp, stat.S_IMODE(existing.st_mode))
    if hasattr(os, "chown"):
        try:
            os.chown(tmp, existing.st_uid, existing.st_gid)
        except OSError:
            pass  # not ours to give away: the new file keeps our ownership, as an editor would


def _same(target: str | os.PathLike[str], source: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(target, source)
    except OSError:
        return False
