"""`./run`, the README's first command: what it says with no argument, with an unknown one and with
--help, and that every `./run X` the README and docs tell people to type is one of its commands. None of
these calls sets up the virtualenv (only a known command does)."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.component


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "run"), *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "ADLOADER_VENV": "/nonexistent/adloader-venv"})


def usage_commands(text: str) -> set[str]:
    return set(re.findall(r"^\s+\./run (\w+)", text, re.MULTILINE))


def test_no_argument_and_an_unknown_one_list_the_commands_and_exit_2():
    """(the listing also printed the script's `set -euo pipefail` line, did not name an unknown command,
    and left out `./run setup`)"""
    bare = run_script()
    assert bare.returncode == 2 and bare.stdout == ""
    assert usage_commands(bare.stderr) == {"demo", "tests", "bench", "adloader", "setup"}, bare.stderr
    assert "set -" not in bare.stderr and "#" not in bare.stderr
    unknown = run_script("bogus")
    assert unknown.returncode == 2 and unknown.stderr.startswith("run: unknown command 'bogus'\n")
    assert unknown.stderr.endswith(bare.stderr)
    for flag in ("--help", "-h", "help"):
        helped = run_script(flag)
        assert helped.returncode == 0 and helped.stdout == bare.stderr and helped.stderr == ""


def test_every_run_command_the_docs_name_is_one():
    commands = usage_commands(run_script().stderr)
    named = {}
    for doc in [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]:
        for cmd in re.findall(r"\./run ([a-z]\w*)", doc.read_text()):
            named.setdefault(cmd, doc.name)
    unknown = {cmd: doc for cmd, doc in named.items() if cmd not in commands}
    assert not unknown, f"`./run X` named in the docs but not a command of ./run: {unknown}"
    # the README opens with the two commands it then explains
    head = (REPO / "README.md").read_text().split("```")[1]
    assert head.split() == ["./run", "demo", "./run", "tests"]
