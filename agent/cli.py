"""``adloader``: the command line, and the composition root.

Each subcommand lives in its own module under ``agent.commands`` with ``register(subparsers)``,
which adds its parser and sets ``func(args) -> int``. Modules are imported lazily per command so
``adloader status`` never pays for torch or scikit-learn. A command's one-line help is written once,
in ``COMMANDS`` (``adloader --help`` lists every command without importing them).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("agent.commands.agent", "run the node agent in the foreground (systemd runs this)"),
    "status": ("agent.commands.status", "show each job's allocation, data wait and GPU idle"),
    "job": ("agent.commands.job", "register or release a job with the agent (Slurm prolog/epilog)"),
    "profile": ("agent.commands.profile", "run a training command with the hook and show where time goes"),
    "bench": ("agent.commands.bench", "co-located jobs under each policy, side by side"),
    "demo": ("agent.commands.demo", "three co-located jobs under none, even-static and adaptive"),
    "simulate": ("agent.commands.simulate", "trace-driven simulation of policies over many nodes"),
    "install-service": ("agent.commands.install_service", "install the systemd unit, config and venv"),
}


class _Subparsers:
    """What ``register`` sees: argparse's subparsers, adding the command's one-line help from ``COMMANDS``."""

    def __init__(self, sub, help_: str):
        self._sub, self._help = sub, help_

    def add_parser(self, name: str, **kw):
        kw.setdefault("help", self._help)
        return self._sub.add_parser(name, **kw)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adloader",
        description="A-Dloader: data-loading resource manager for shared GPU nodes.",
    )
    from adloader import __version__

    parser.add_argument("--version", action="version", version=f"adloader {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_, add_help=False)
            continue
        importlib.import_module(module).register(_Subparsers(sub, help_))
    return parser


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed for: ``adloader job register`` -> its own."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


# what a shell reports for a command killed by SIGPIPE (128 + 13), as `cat` piped into `head` gives
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command. Its output piped into a reader that stops early (``adloader status --json |
    head``) ends the command quietly with ``EXIT_BROKEN_PIPE``, not with a BrokenPipeError traceback
    (Python ignores SIGPIPE; the recipe is the one in the ``signal`` module's documentation)."""
    try:
        try:
            return _main(argv)
        finally:    # also after argparse's SystemExit (--help): a flush at interpreter exit would print the error
            sys.stdout.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())   # so that the exit's own flush finds nothing to say
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    only = first if first in COMMANDS else None
    if only is None and first is not None and not any(a in ("-h", "--help") for a in argv):
        print(f"adloader: unknown command {first!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    parser = build_parser(only)
    args, extra = parser.parse_known_args(argv)
    if extra:   # said by the (sub)command's own parser, with its usage (not the top level's "adloader: error");
        # a command may set_defaults(unrecognized_hint=...) for what such arguments usually mean
        hint = getattr(args, "unrecognized_hint", None)
        _leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({hint})" if hint else ""))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
