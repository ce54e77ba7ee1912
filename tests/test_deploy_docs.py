"""docs/ stays true to the code: every `adloader` command and every one of its options is documented,
every agent config key is in the operations guide, and the files the docs name exist."""
from __future__ import annotations

import argparse
import re

import pytest

from agent.cli import COMMANDS, build_parser
from tests.conftest import REPO

pytestmark = pytest.mark.unit

DOCS = REPO / "docs"


def docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_options() -> dict[str, set[str]]:
    """'job register' -> {'--slurm', ...}: every long option of every (sub)command."""
    out: dict[str, set[str]] = {}

    def walk(name: str, parser: argparse.ArgumentParser):
        opts = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        out[name] = opts
        for sub_name, sub in _subparsers(parser).items():
            walk(f"{name} {sub_name}", sub)

    for name, parser in _subparsers(build_parser()).items():
        walk(name, parser)
    return out


def test_every_command_is_documented():
    text = docs_text()
    for name in COMMANDS:
        assert f"adloader {name}" in text, f"docs/*.md never mention `adloader {name}`"


def test_every_option_is_documented():
    text = docs_text()
    missing = [f"adloader {cmd} {opt}" for cmd, opts in command_options().items() for opt in sorted(opts)
               if not re.search(re.escape(opt) + r"(?![\w-])", text)]
    assert not missing, "options missing from docs/*.md (document them in users.md or operations.md): " + ", ".join(missing)


def test_every_config_key_is_in_the_operations_guide():
    config = pytest.importorskip("agent.config", reason="agent/config.py (agentd) is not in this build yet")
    text = (DOCS / "operations.md").read_text()
    missing = [k for k in config.KEYS if f"`{k}`" not in text]
    assert not missing, f"config keys missing from docs/operations.md: {missing}"


def test_paths_named_in_the_docs_exist():
    text = docs_text()
    for rel in sorted(set(re.findall(r"`(deploy/[\w./-]+)`", text))):
        assert (REPO / rel).exists(), f"docs name {rel}, which does not exist"
    for script in re.findall(r"^(?:Prolog|Epilog|TaskProlog)=/opt/adloader/slurm/(\w+\.sh)", text, re.MULTILINE):
        assert (REPO / "deploy" / "slurm" / script).is_file()
