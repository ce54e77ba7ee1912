"""`adloader job` — placeholder until its issue lands (see COMMANDS in agent.cli)."""
from __future__ import annotations

NAME = "job"


def register(sub) -> None:
    p = sub.add_parser(NAME, help="not available yet")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    print(f"adloader {NAME}: not available in this build yet", file=sys.stderr)
    return 2
