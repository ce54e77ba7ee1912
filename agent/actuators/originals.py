"""The journal of originals: what the agent changed on the system, recorded before the first write.

Kept in memory and, when a path is given, in a small JSON file rewritten atomically (write to a
temporary file, fsync, rename) after every change, so a restarted agent (a new actuator built on
the same file) can put everything back even if the old one died without ``restore()``.

Contents:
- files:    "hierarchy|group|file" -> the value before our first write (only files that existed)
- created:  groups we created, "hierarchy|group", in creation order (removed children first)
- pids:     pid -> {"job": job id, "origins": {hierarchy: the group the process came from}}
- affinity: pid -> {"job": job id, "cpus": the CPU affinity before our first change,
            "start": the process's start time in clock ticks (optional: put back only on that process)}

Loading checks every field by type; a file that fails raises ``StateFileError`` naming the file and
the field (``actuators.build`` then sets it aside and recovers what it can: see there). Saving uses
``statefile.write_atomic`` (whole or nothing, the last good copy kept as ``.prev``); a save that
fails (read-only or full state directory) is not an apply failure: the values stay in memory, so
``restore()`` on stop still works, and ``save_error`` says why the file is stale (status reports it).

Threads: the contents (files, created, pids, affinity) are read and changed only by the actuator that
owns them, on its lane's thread (``agent.controller.ActuatorLane``; before that, while the agent is
built). The one thing another thread reads is how the saves went: ``save_problem()`` (the status
document, on the service loop's thread), possibly while a call that outlived its timeout is still
inside ``save()`` (a state directory whose disk stopped answering). ``_lock`` guards ``save_error`` and
the start of the save in progress, and is never held across file I/O, so ``save_problem()`` returns at
once, never waits for a hung save, and sees both of one moment: the last save that finished, and the
one still running (between ticks, the only time status is built, a save still running is a hung one).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Optional

from agent import logs, statefile
from agent.statefile import StateFileError, is_int, need

VERSION = 1
log = logging.getLogger("agent.originals")


class Originals:
    def __init__(self, path: Optional[str] = None, read_from: Optional[str] = None) -> None:
        """``read_from``: load that file instead of ``path`` (the last good copy, ``path + ".prev"``,
        when ``path`` is unusable: ``actuators._recover_originals``); saves still go to ``path``."""
        self.path = path
        self.files: dict[str, str] = {}
        self.created: list[str] = []
        self.pids: dict[str, dict] = {}
        self.affinity: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._save_error: Optional[str] = None        # why the last save failed (None: it did not)
        self._saving_since: Optional[float] = None    # monotonic start of the save in progress
        if path:
            statefile.remove_stale_temps(path)   # (one Originals per file: built at start, under the state dir's lock)
        source = read_from or path
        if source and os.path.exists(source):
            self._load(source)

    def _load(self, p: str) -> None:
        try:
            with open(p, "rb") as f:
                data = json.loads(f.read())
        except OSError as e:
            raise StateFileError(f"{p}: cannot read: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:
            raise StateFileError(f"{p}: not valid JSON ({e})") from None
        need(isinstance(data, dict), p, "the document", "an object", type(data).__name__)
        need(is_int(data.get("version"), 1), p, "version", "an integer", data.get("version"))
        if data["version"] > VERSION:
            raise StateFileError(f"{p}: version {data['version']} is newer than this agent understands "
                                 f"({VERSION}); upgrade adloader")
        files, created = data.get("files", {}), data.get("created", [])
        pids, affinity = data.get("pids", {}), data.get("affinity", {})
        need(isinstance(files, dict) and all(isinstance(k, str) and k.count("|") == 2 and isinstance(v, str)
                                             for k, v in files.items()), p, "files", "hierarchy|group|file -> value", files)
        need(isinstance(created, list) and all(isinstance(k, str) and k.count("|") == 1 for k in created),
             p, "created", "a list of hierarchy|group", created)
        need(isinstance(pids, dict), p, "pids", "an object", pids)
        for k, v in pids.items():
            need(statefile.int_key(k) and isinstance(v, dict) and isinstance(v.get("job"), str)
                 and isinstance(v.get("origins", {}), dict)
                 and all(isinstance(h, str) and isinstance(g, str) for h, g in v.get("origins", {}).items()),
                 p, f"pids[{k[:16]!r}]", "{job, origins: {hierarchy: group}}", v)
        need(isinstance(affinity, dict), p, "affinity", "an object", affinity)
        for k, v in affinity.items():
            need(statefile.int_key(k) and isinstance(v, dict) and isinstance(v.get("job"), str)
                 and isinstance(v.get("cpus"), list) and all(is_int(c, 0, 1 << 20) for c in v["cpus"])
                 and is_int(v.get("start", 0), 0),
                 p, f"affinity[{k[:16]!r}]", "{job, cpus: [int], start?: int}", v)
        for key in created:
            need(".." not in key.split("|", 1)[1].split("/"), p, "created", "group paths without '..'", key)
        self.files, self.created, self.pids, self.affinity = dict(files), list(created), dict(pids), dict(affinity)

    @staticmethod
    def key(hier: str, rel: str, file: str = "") -> str:
        return f"{hier}|{rel.strip('/')}" + (f"|{file}" if file else "")

    def empty(self) -> bool:
        return not (self.files or self.created or self.pids or self.affinity)

    @property
    def save_error(self) -> Optional[str]:
        """Why the last save that finished failed; None if it did not (or none has)."""
        with self._lock:
            return self._save_error

    def save_problem(self) -> Optional[str]:
        """What status says of the file (any thread, never waits for a save): why the last save failed
        and, while one is running, for how long; None when the file holds what memory holds."""
        with self._lock:
            err, since = self._save_error, self._saving_since
        if since is None:
            return err
        running = f"a save running for {time.monotonic() - since:.1f} s"
        return f"{err}; {running}" if err else f"{self.path}: {running}"

    def save(self) -> None:
        if not self.path:
            return
        with self._lock:
            self._saving_since = time.monotonic()
        err: Optional[str] = None
        failure: Optional[OSError] = None
        try:
            if self.empty():
                for p in (self.path, self.path + ".prev"):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
            else:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                data = json.dumps({"version": VERSION, "files": self.files, "created": self.created,
                                   "pids": self.pids, "affinity": self.affinity}, indent=1, sort_keys=True)
                statefile.write_atomic(self.path, data.encode())
        except OSError as e:
            err = f"{self.path}: {e.strerror or e}"
            failure = e
        except BaseException:        # (not a file error: raised to the caller; nothing is running now)
            with self._lock:
                self._saving_since = None
            raise
        with self._lock:
            before, self._save_error, self._saving_since = self._save_error, err, None
        if err is None and before is not None:
            logs.event(log, "originals_saved_again", path=self.path)
        elif err is not None and before is None:
            logs.event(log, "originals_save_failed", logging.ERROR, path=self.path, error=str(failure),
                       detail="kept in memory: restore on stop still works; a crash now would lose them")
