"""argparse types for the number flags of the evaluation commands (``python -m evaluation.<name>``).

They read text as the ``adloader`` command's flags and the agent's config do
(``agent.commands.plain_int``/``plain_float``: Python's int() and float() read '1_0' and '١٠' as 10,
a number no one wrote), and a float flag must be finite as well: float() reads 'nan', 'inf' and
'1e999', which measure nothing ('--seconds inf' never ends, '--target-ms nan' makes every tick
"miss") and pass any range check written as ``if x < 0: error``. A bad value is argparse's usage error
(exit 2) naming the flag: "argument --seconds: a finite number expected, got 'nan'".

``at_least(item, lo)`` and ``above(item, lo)`` add a range to a type, for a value with a natural one (a
worker count at least 1, cores above 0): "argument --cores: a number above 0 expected, got '-1'", and
inside ``comma_list`` the list it was in as well.

A path flag or positional (``--out``, ``--against``, bench.json files) takes ``path_arg`` and a name or
name-list flag (``--policies``, ``--scenarios``) ``names_arg``, as the ``adloader`` command's do: an empty
value ('' from a variable left unset) is a usage error naming the flag. It was read as the flag not
given (``multirank_check --against ''`` compared nothing; ``--out ''`` wrote nothing), as the working
directory (``workload_audit --out ''`` wrote there; ``supply_check --against ''`` ran this checkout
against itself), or as an empty list. Two flags keep '' as a documented value: ``predictor_accuracy
--validation ''`` (skip) and ``security_bench --nofile ''`` (inherit)."""
from __future__ import annotations

import argparse
from typing import Callable, TypeVar

from agent.commands import names_arg, path_arg, plain_float, plain_int

__all__ = ["above", "at_least", "comma_list", "finite_float", "names_arg", "path_arg", "plain_int"]

T = TypeVar("T")

# agent.commands.plain_float refuses what is not finite itself; the name says what a flag gets
finite_float = plain_float


def at_least(item: Callable[[str], T], lo) -> Callable[[str], T]:
    """argparse ``type``: what ``item`` reads, refused below ``lo``: ``at_least(plain_int, 1)``."""
    return _ranged(item, lambda v: v >= lo, f"at least {lo}")


def above(item: Callable[[str], T], lo) -> Callable[[str], T]:
    """argparse ``type``: what ``item`` reads, refused at or below ``lo``: ``above(finite_float, 0)``."""
    return _ranged(item, lambda v: v > lo, f"above {lo}")


def _ranged(item: Callable[[str], T], ok: Callable[[T], bool], what: str) -> Callable[[str], T]:
    kind = "an integer" if item is plain_int else "a number"

    def parse(text: str) -> T:
        v = item(text)
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{kind} {what} expected, got {text!r}")
        return v

    return parse


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """argparse ``type`` for a comma-separated list whose items ``item`` reads (``plain_int``,
    ``finite_float``, or a type of the command's own such as ``validate_sim._shape``): ``type=
    comma_list(plain_int)`` reads '0,1, 2' as [0, 1, 2]. Spaces around an item are allowed; an empty
    item ('1,,2', '1,', an empty list) is refused, as is an item ``item`` refuses: "argument
    --neighbours: not an integer: '1e3' (in '0,1e3')". A range goes on the item: ``comma_list(at_least(
    plain_int, 1))``."""
    def parse(text: str) -> list[T]:
        items = [part.strip() for part in text.split(",")]
        if "" in items:
            raise argparse.ArgumentTypeError(f"a comma-separated list without empty items expected, got {text!r}")
        try:
            return [item(x) for x in items]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})" if len(items) > 1 else str(e)) from None

    return parse
