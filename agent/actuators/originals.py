"""The journal of originals: what the agent changed on the system, recorded before the first write.

Kept in memory and, when a path is given, in a small JSON file rewritten atomically (write to a
temporary file, fsync, rename) after every change, so a restarted agent (a new actuator built on
the same file) can put everything back even if the old one died without ``restore()``.

Contents:
- files:    "hierarchy|group|file" -> the value before our first write (only files that existed)
- created:  groups we created, "hierarchy|group", in creation order (removed children first)
- pids:     pid -> {"job": job id, "origins": {hierarchy: the group the process came from}}
- affinity: pid -> {"job": job id, "cpus": the CPU affinity before our first change}
"""
from __future__ import annotations

import json
import os
from typing import Optional

VERSION = 1


class Originals:
    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self.files: dict[str, str] = {}
        self.created: list[str] = []
        self.pids: dict[str, dict] = {}
        self.affinity: dict[str, dict] = {}
        if path and os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            if int(data.get("version", 0)) > VERSION:
                raise ValueError(f"journal of originals {path} has version {data.get('version')}, newer than "
                                 f"this agent understands ({VERSION}); upgrade adloader")
            self.files = dict(data.get("files", {}))
            self.created = list(data.get("created", []))
            self.pids = dict(data.get("pids", {}))
            self.affinity = dict(data.get("affinity", {}))

    @staticmethod
    def key(hier: str, rel: str, file: str = "") -> str:
        return f"{hier}|{rel.strip('/')}" + (f"|{file}" if file else "")

    def empty(self) -> bool:
        return not (self.files or self.created or self.pids or self.affinity)

    def save(self) -> None:
        if not self.path:
            return
        if self.empty():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"version": VERSION, "files": self.files, "created": self.created, "pids": self.pids,
                       "affinity": self.affinity}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
