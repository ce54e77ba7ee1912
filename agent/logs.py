"""Structured logs: one JSON object per line on stdout (journald keeps it; jq reads it).

Every line has ``ts`` (UNIX seconds), ``level``, ``logger``, ``event`` (a short fixed name such as
``job_arrived``) and the event's fields. ``event(log, name, **fields)`` writes one; ``once(key, ...)``
writes a line only the first time ``key`` is seen (e.g. "no NVIDIA driver").
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

_once_lock = threading.Lock()
_once_seen: set[str] = set()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        elif getattr(record, "event", None) is None:
            pass
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


def setup(level: str = "info", stream=None) -> None:
    """Route the ``agent`` and ``adloader`` loggers to JSON lines on ``stream`` (stdout)."""
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def event(log: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(level, name, extra={"event": name, "fields": fields})


def once(key: str, log: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> bool:
    """Log ``name`` only the first time ``key`` is seen in this process. True if it logged."""
    with _once_lock:
        if key in _once_seen:
            return False
        _once_seen.add(key)
    event(log, name, level, **fields)
    return True


class RateLimitedLog:
    """At most one line per ``key`` per ``period_s`` (floods from one client get one line)."""

    def __init__(self, log: logging.Logger, period_s: float = 10.0, max_keys: int = 4096):
        self.log = log
        self.period_s = period_s
        self.max_keys = max_keys
        self._last: dict[str, float] = {}

    def event(self, key: str, name: str, level: int = logging.WARNING, **fields: Any) -> bool:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            return False
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = now
        event(self.log, name, level, **fields)
        return True
