"""argparse types for the number flags of the evaluation commands (``python -m evaluation.<name>``).

They read text as the ``adloader`` command's flags and the agent's config do
(``agent.commands.plain_int``/``plain_float``: Python's int() and float() read '1_0' and '١٠' as 10,
a number no one wrote), and a float flag must be finite as well: float() reads 'nan', 'inf' and
'1e999', which measure nothing ('--seconds inf' never ends, '--target-ms nan' makes every tick
"miss") and pass any range check written as ``if x < 0: error``. A bad value is argparse's usage error
(exit 2) naming the flag: "argument --seconds: a finite number expected, got 'nan'"."""
from __future__ import annotations

from agent.commands import plain_float, plain_int

__all__ = ["finite_float", "plain_int"]


# agent.commands.plain_float refuses what is not finite itself; the name says what a flag gets
finite_float = plain_float
