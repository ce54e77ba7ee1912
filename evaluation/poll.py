"""Waiting for a condition against a deadline (tests and evaluation harnesses never sleep blindly)."""
from __future__ import annotations

import time


def wait_for(cond, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``cond()`` until it returns a truthy value; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
