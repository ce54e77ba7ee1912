"""The ``adloader`` subcommands (one module each, ``register(sub)`` and a ``run``), and the argparse
types they share for numbers: ``plain_int`` and ``plain_float`` read what ``int`` and ``float`` read,
except text that is not ASCII or holds '_', and (``plain_float``) a number that is not finite (Python reads '1_0' as 10 and '١٠' as 10, a number no one
wrote: ``agent.config`` refuses the same text from the environment and the agent's flags); and ``path_arg`` for a file or directory,
which refuses an empty one, and ``names_arg`` for a name or a comma-separated list of names, which
refuses one that names none."""
from __future__ import annotations

import argparse
import math


def _plain(text: str, kind: str) -> str:
    if not isinstance(text, str) or not text.isascii() or "_" in text:
        raise argparse.ArgumentTypeError(f"{kind} in ASCII digits without '_' expected, got {text!r}")
    return text


def plain_int(text: str) -> int:
    """argparse ``type``: an integer written in ASCII digits, without '_'."""
    try:
        return int(_plain(text, "an integer"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def plain_number(text: str) -> float:
    """argparse ``type``: a number written in ASCII, without '_', 'inf' and 'nan' included: for a
    command that refuses those itself, in its own words (``adloader job``: one line, and exit 0 under
    Slurm, where a usage error would fail the prolog)."""
    try:
        return float(_plain(text, "a number"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def plain_float(text: str) -> float:
    """argparse ``type``: a finite number written in ASCII, without '_'. float() also reads 'nan',
    'inf' and '1e999', which no flag here means: a duration, a share of cores or a period ('--warmup-s
    inf' never ends, 'nan' passes every range check written as ``if x < 0: error``)."""
    v = plain_number(text)
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"a finite number expected, got {text!r}")
    return v


def path_arg(text: str) -> str:
    """argparse ``type``: a file or directory path, not empty. ``--trace "$TRACE"`` with the variable unset
    gave '', which each command read as the flag not given: simulate ran its default generated trace
    (1000 nodes), bench wrote its runs into the working directory (``--out ''``), ``--catalog ''`` took
    the packaged catalogue, ``profile --json ''`` wrote nothing, all without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (a variable left unset?)")
    return text


def names_arg(text: str) -> str:
    """argparse ``type``: a name, or a comma-separated list of names, naming at least one. '' or ','
    was read as no list (``bench --scenarios ''``: the default ones) or as an empty one (``simulate
    --policies ''`` printed an empty table and exited 0; ``bench --policies ''`` calibrated for no run)."""
    if not any(part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"no name given in {text!r} (a variable left unset?)")
    return text
