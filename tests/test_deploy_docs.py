"""docs/ stays true to the code: every agent config key is in the operations guide with the agent's
default, the files the docs name exist, and every `adloader` command, and every `python -m
evaluation.<module>` that the README, BENCHMARKS.md or docs/ tell people to run, has its own part of
docs/*.md (``command_sections``) that names each of its options, lists no option it does not have (an
option table's first column, a usage synopsis), and gives no default (an option table's 'default'
column) other than its parser's; and every `key = value` the docs show for a config key is accepted."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import re
from pathlib import Path
from unittest import mock

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


# --- each command's own part of the docs ------------------------------------------------------------

_CMD = r"adloader (?:" + "|".join(map(re.escape, COMMANDS)) + r")|python -m evaluation\.\w+"
# a line that opens a command's part: "- `adloader demo`: ...", "`adloader job` by hand", "`adloader
# install-service` options:", "- `python -m evaluation.phase_scan PATH [PATH ...]`: ...", "- `sudo python -m
# evaluation.security_bench`: ..."; a heading naming one; or a code block whose first line is its synopsis
_OPENS = re.compile(r"^(?:- )?`(?:sudo )?(" + _CMD + r")(?: [^`]*)?`(?::| options| \(| by hand)")
_SYNOPSIS = re.compile(r"^(?:sudo )?(" + _CMD + r")(?: |$)")


def _key(command: str) -> str:
    return command.split()[-1].removeprefix("evaluation.") if command.startswith("python") else command.split()[1]


def command_sections() -> dict[str, list[str]]:
    """'demo' / 'validate_sim' -> the lines of docs/*.md that document it: from a line that opens its part
    (``_OPENS``, a heading naming it, a synopsis code block) to the next heading or the next part. Lines
    inside code blocks are marked with a leading ```."""
    out: dict[str, list[str]] = {}
    for doc in sorted(DOCS.glob("*.md")):
        current, fence, first = None, False, False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                fence = first = not fence
                continue
            if not fence and line.startswith("#"):
                m = re.search(r"`(" + _CMD + r")[^`]*`", line)
                current = _key(m.group(1)) if m else None
                continue
            m = (_SYNOPSIS if first else None if fence else _OPENS)
            m = m.match(line) if m else None
            first = False
            if m:
                current = _key(m.group(1))
            if current is not None:
                out.setdefault(current, []).append(("```" if fence else "") + line)
    return out


def _own_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """'--out' -> its action, for every long option shown in --help, subcommands' included."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_own_options(sub))
        elif action.help != argparse.SUPPRESS:
            out.update({s: action for s in action.option_strings if s.startswith("--") and s != "--help"})
    return out


class _Parsed(Exception):
    pass


def module_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``python -m evaluation.<name>`` builds, taken from its ``main`` before it parses
    anything (so nothing runs)."""
    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    module = importlib.import_module(f"evaluation.{name}")
    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            module.main([])
        except _Parsed as e:
            return e.args[0]
    raise AssertionError(f"evaluation.{name}.main parsed no arguments")


def commands_told_to_run() -> list[str]:
    """Every evaluation module the README, BENCHMARKS.md or docs/ say to run as `python -m evaluation.X`."""
    texts = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]
    return sorted({m for p in texts for m in re.findall(r"python3? -m evaluation\.(\w+)", p.read_text())})


def all_command_options() -> dict[str, dict[str, argparse.Action]]:
    out = {name: _own_options(parser) for name, parser in _subparsers(build_parser()).items()}
    out.update({name: _own_options(module_parser(name)) for name in commands_told_to_run()})
    return out


@pytest.fixture(scope="module")
def parsers():
    return all_command_options()


@pytest.fixture(scope="module")
def sections():
    return command_sections()


def _listed(lines: list[str]) -> list[tuple[str, list[str], str | None]]:
    """(line, options, default cell) for each option a part lists: an option table's row (its first
    cell's options, and its 'default' column if the table has one) or a synopsis line's [--options]."""
    out, default_col = [], None
    for line in lines:
        if line.startswith("```"):                                    # a synopsis (code block)
            out.append((line, re.findall(r"[\[|]\s*(--[a-z][\w-]*)", line), None))
        elif line.lstrip().startswith("|"):                          # (tables in a list item are indented)
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if cells and cells[0] in ("option", "key"):
                default_col = cells.index("default") if "default" in cells else None
            elif cells and not set(cells[0]) <= set("-: "):
                opts = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", cells[0])
                if opts:
                    out.append((line, opts, cells[default_col] if default_col is not None else None))
        else:
            default_col = None
    return out


def test_every_command_told_to_run_has_its_own_part_in_the_docs(parsers, sections):
    missing = sorted(set(parsers) - set(sections))
    assert not missing, f"commands with no part of docs/*.md of their own (a bullet '- `python -m evaluation.X`: ...', " \
                        f"a heading, or a synopsis): {missing}"


def test_each_commands_part_names_every_option_it_has(parsers, sections):
    missing = [f"{name} {opt}" for name, options in parsers.items() for opt in sorted(options)
               if not re.search(re.escape(opt) + r"(?![\w-])", "\n".join(sections.get(name, [])))]
    assert not missing, "options missing from their command's part of docs/*.md: " + ", ".join(missing)


def test_every_option_a_commands_part_lists_exists(sections, parsers):
    stale = [f"{name} {opt}: {line.strip()[:80]}" for name, lines in sections.items() if name in parsers
             for line, opts, _ in _listed(lines) for opt in opts if opt not in parsers[name]]
    assert not stale, "docs/*.md list options their command does not have:\n" + "\n".join(stale)


def _documents_default(default, cell: str) -> bool:
    """Whether a table's default cell states the parser's ``default`` (nothing to compare for None,
    booleans and empty values: the cell may say 'generated', 'off', 'the CPUs', ...)."""
    if default is None or isinstance(default, bool) or default in ("", []):
        return True
    if isinstance(default, (int, float)):
        numbers = [float(x) for x in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])", cell)]
        return any(math.isclose(float(default), x) for x in numbers) or (default == 0 and "off" in cell)
    if isinstance(default, list):
        return all(_documents_default(d, cell) for d in default)
    text = str(default)
    if text == str(REPO):                  # the checkout itself, wherever it is
        return "this checkout" in cell
    if text.startswith(str(REPO) + "/"):   # a path in the checkout, documented relative to it
        text = str(Path(text).relative_to(REPO))
    return text in cell.replace("\\|", "|")


# defaults that depend on the machine the command runs on, so the docs describe them in words
MACHINE_DEFAULTS = {("security_bench", "--nofile")}


def test_the_defaults_the_option_tables_give_are_the_parsers(sections, parsers):
    wrong = []
    for name, lines in sections.items():
        for line, opts, cell in _listed(lines):
            if cell is None or name not in parsers:
                continue
            parts = [c.strip() for c in cell.split(",")]
            for i, opt in enumerate(opts):
                action = parsers[name].get(opt)
                if action is None or (name, opt) in MACHINE_DEFAULTS:
                    continue
                part = parts[i] if len(opts) > 1 and len(parts) == len(opts) else cell
                if not _documents_default(action.default, part):
                    wrong.append(f"{name} {opt}: docs say {part!r}, the parser {action.default!r}")
    assert not wrong, "option tables in docs/*.md with a default that is not the parser's:\n" + "\n".join(wrong)


def test_the_config_keys_defaults_in_the_operations_guide_are_the_agents():
    config = pytest.importorskip("agent.config", reason="agent/config.py (agentd) is not in this build yet")
    rows, table = {}, False
    for line in (DOCS / "operations.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] if line.startswith("|") else []
        if cells[:2] == ["key", "default"]:
            table = True
        elif not cells:
            table = False
        elif table and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    fields = dataclasses.fields(config.AgentConfig)
    assert not [f.name for f in fields if f.name not in rows], "config keys with no row in the key | default table"
    wrong = []
    for f in fields:
        default = f.default
        if default in ("", None):   # computed at start (endpoint, state_dir): the docs say how
            continue
        shown = "true" if default is True else "false" if default is False else str(default)
        cell = rows[f.name].strip("`").strip('"')
        if not (cell == shown or (isinstance(default, float) and re.fullmatch(r"[\d.]+", cell)
                                  and math.isclose(float(cell), default))):
            wrong.append(f"{f.name}: docs say {rows[f.name]!r}, the agent {default!r}")
    assert not wrong, "config keys whose default in docs/operations.md is not the agent's: " + "; ".join(wrong)


def test_every_config_setting_the_docs_show_is_one_the_agent_takes(tmp_path):
    """A `key = value` the README or docs show for an agent config key (`floor_allotment = "whole"`,
    `cgroup_mode = "cooperative"`) is TOML the agent's config accepts as written ("..." stands for a
    value of the reader's and is left out)."""
    config = pytest.importorskip("agent.config", reason="agent/config.py (agentd) is not in this build yet")
    shown = {m for p in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
             for m in re.findall(r"`(([a-z_]+) = [^`]+)`", p.read_text())}
    settings = sorted(line for line, key in shown if key in config.KEYS and "..." not in line)
    assert len(settings) >= 5, f"the docs' config settings were not found: {settings}"
    refused = []
    for i, line in enumerate(settings):
        path = tmp_path / f"{i}.toml"
        path.write_text(line + "\n")
        try:
            config.load(str(path), {}, environ={})
        except config.ConfigError as e:
            refused.append(f"{line}: {e}")
    assert not refused, "config settings the docs show that the agent refuses:\n" + "\n".join(refused)
