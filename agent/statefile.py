"""The agent's own files (the journal, the cgroup originals): written whole or not at all, read with
every field checked by type, and set aside when they cannot be trusted.

``write_atomic(path, data)``: every byte to a temporary file in the same directory (``os.write`` may
write less than asked, on a full disk for instance: it is called again for the rest, and an error
leaves the temporary file removed and ``path`` untouched), ``fsync``, then the current ``path`` is
hard-linked to ``<path>.prev`` (the last good copy), the temporary file renamed over ``path`` and
the directory fsynced. A reader sees the old or the new file, never a torn one, even after SIGKILL.

``remove_stale_temps(path)``: removes the temporary files of ``path`` that a writer killed mid-write
left (``.<name>.<pid>.tmp`` and its ``.prev`` link); called when the file is loaded, at start, when the
state directory's lock says no other agent writes there. Before, each such crash left one for good.

``quarantine(path)``: renames a file that failed to load to ``<path>.bad-<UTC time>`` (kept for the
operator, never read again) and returns the new name.

``make_dir(path, mode)``: ``os.makedirs(path, exist_ok=True)`` that returns the directories this call
created itself (outermost first; each ``mkdir`` that found one already there is not counted), and
``remove_made(dirs)`` removes them again, innermost first, each only while it is empty: a refused
start takes away the state directory it made, never one that existed before, nor anything written in it.

``StateFileError``: a file that exists but cannot be used; its message names the file and the field.
"""
from __future__ import annotations

import math
import os
import re
import time
from typing import Any, Optional


class StateFileError(ValueError):
    """A state file that cannot be trusted; the message names the file and what is wrong."""


def _temp_name(path: str, pid: int) -> str:
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{pid}.tmp")


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    d = os.path.dirname(path) or "."
    tmp = _temp_name(path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(f"short write to {tmp}")
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    try:
        if os.path.exists(path):
            prev_tmp = tmp + ".prev"
            try:
                os.unlink(prev_tmp)
            except FileNotFoundError:
                pass
            os.link(path, prev_tmp)
            os.replace(prev_tmp, path + ".prev")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def make_dir(path: str, mode: int = 0o777) -> list[str]:
    """``os.makedirs(path, mode, exist_ok=True)`` (``mode`` for ``path`` itself, the default for the
    levels above it); returns the directories this call made, outermost first."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    made = []
    for p in reversed(missing):
        try:
            os.mkdir(p, mode if p == path else 0o777)
        except FileExistsError:   # made by someone else meanwhile, or a file (refused just below)
            if not os.path.isdir(p):
                raise
            continue
        made.append(p)
    return made


def remove_made(dirs: list[str]) -> None:
    """Remove what ``make_dir`` made, innermost first, stopping at the first one that is not empty
    (or cannot be removed): a file written there is kept, and so is every directory above it."""
    for p in reversed(dirs):
        try:
            os.rmdir(p)
        except OSError:
            return


def remove_stale_temps(path: str) -> list[str]:
    """Remove what ``write_atomic(path, ...)`` of a process killed mid-write left (its temporary file, the
    ``.prev`` link it was making); returns the names removed. Only for a file no other process writes now."""
    d = os.path.dirname(path) or "."
    left = re.compile(rf"\.{re.escape(os.path.basename(path))}\.\d+\.tmp(\.prev)?")
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in filter(left.fullmatch, names):
        try:
            os.unlink(os.path.join(d, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def quarantine(path: str) -> Optional[str]:
    """Set ``path`` aside as ``<path>.bad-<time>``; the new name, or None if it could not be moved."""
    bad = f"{path}.bad-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    try:
        os.replace(path, bad)
        return bad
    except OSError:
        return None


# --- typed reading: each returns the value or raises StateFileError naming the file and field -----

def need(cond: bool, path: str, where: str, what: str, value: Any) -> None:
    if not cond:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise StateFileError(f"{path}: {where} must be {what}, got {shown}")


def is_int(v: Any, lo: int = -(2 ** 63), hi: int = 2 ** 63) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_key(k: str) -> bool:
    return isinstance(k, str) and k.isdigit() and len(k) <= 12
