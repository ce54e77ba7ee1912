"""The docs name only log events the agent writes and environment variables something reads, and
docs/operations.md lists every one of both: its table of log events is the set of event names the
code passes to ``agent.logs`` (read from the source, so nothing runs), and its table of environment
variables names every ``ADLOADER_*`` the project's code, scripts and test harness mention."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from adloader import env
from agent.config import KEYS
from tests.conftest import REPO

pytestmark = pytest.mark.unit

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OPERATIONS = REPO / "docs" / "operations.md"


def _python_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((REPO / pkg).rglob("*.py"))]


def emitted_events() -> dict[str, str]:
    """event name -> the file that writes it: every ``event(log, NAME, ...)``, ``logs.once(key, log,
    NAME, ...)`` and ``RateLimitedLog.event(key, NAME, ...)`` in the agent, the client and the predictor."""
    out, dynamic = {}, []
    for path in _python_files("agent", "adloader", "predictor"):
        if path == REPO / "agent" / "logs.py":          # the helpers themselves pass ``name`` on
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            at = {"event": 1, "once": 2}.get(name)
            if at is None or len(node.args) <= at:
                continue
            arg = node.args[at]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.setdefault(arg.value, str(path.relative_to(REPO)))
            else:
                dynamic.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not dynamic, f"log events whose name is not a literal (this test cannot read them): {dynamic}"
    return out


def _flat(text: str) -> str:
    """Prose only (code blocks dropped), one line."""
    return re.sub(r"\s+", " ", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def _without_parentheses(text: str) -> str:
    while True:
        shorter = re.sub(r"\([^()]*\)", "", text)
        if shorter == text:
            return text
        text = shorter


_TOKEN = r"`([a-z]+(?:_[a-z]+)*)`"
# "`x` warning in the log", "`x` in the log", "a `x` log event", "an `observation` event", "(events `a`, `b`)",
# "the warning `x`", "`journal_adopted` lists it"
_ONE = [re.compile(_TOKEN + r" (?:warning in the log|in the log|log event|events?\b|lists it)"),
        re.compile(r"\b(?:the warning|the log has an?) " + _TOKEN)]
# lists: "events `a`, `b`)", "The log says `a` (...), `b` (...) and `c`;", the paragraph "At `info`: `a` / ... every line has"
_LISTS = [re.compile(r"\(events? ([^)]*)\)"), re.compile(r"[Tt]he log says (.*?)[;.]"),
          re.compile(r"At `info`: (.*?)every line has")]


def events_the_docs_mention() -> dict[str, str]:
    """event name -> the doc that mentions it as a log event (the phrasings above)."""
    out = {}
    for doc in DOCS:
        text = _flat(doc.read_text())
        names = [m.group(1) for pattern in _ONE for m in pattern.finditer(text)]
        for pattern in _LISTS:
            for m in pattern.finditer(text):
                listed = re.sub(r"\b[Aa]t `\w+`", "", _without_parentheses(m.group(1)))   # "at `warning`:"
                names += re.findall(_TOKEN, listed)
        for name in names:
            out.setdefault(name, doc.name)
    return out


def events_table() -> set[str]:
    """The event names in docs/operations.md's ``| event | level | when |`` table."""
    names, table = set(), False
    for line in OPERATIONS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().split("|")[1:-1]] if line.startswith("|") else []
        if cells[:2] == ["event", "level"]:
            table = True
        elif not cells:
            table = False
        elif table and not set(cells[0]) <= set("-: "):
            names |= set(re.findall(r"`(\w+)`", cells[0]))
    return names


def test_the_operations_guides_table_of_log_events_is_the_codes():
    code, table = emitted_events(), events_table()
    assert table, "docs/operations.md has no '| event | level | when |' table"
    assert not set(code) - table, "log events the agent writes that docs/operations.md's table leaves out: " + \
        ", ".join(f"{n} ({code[n]})" for n in sorted(set(code) - table))
    assert not table - set(code), f"docs/operations.md's table lists log events nothing writes: {sorted(table - set(code))}"


def test_every_log_event_the_docs_quote_is_one_the_code_writes():
    mentioned, code = events_the_docs_mention(), emitted_events()
    assert {"agent_started", "memory_pressure_easing", "group_lost"} <= set(mentioned), \
        "the phrasings this test reads no longer find the events the docs name"
    stale = sorted(f"{n} ({doc})" for n, doc in mentioned.items() if n not in code)
    assert not stale, f"the docs quote log events that the code does not write (renamed or gone): {stale}"


# --- environment variables ----------------------------------------------------------------------------

_NAME = re.compile(r"\bADLOADER_[A-Z0-9_]*[A-Z0-9]\b")


def names_in_code() -> dict[str, str]:
    """ADLOADER_* name -> a file of the project's code, deploy scripts, ./run or the test harness
    (conftest, datasets) that mentions it; not the tests themselves, which make up names on purpose."""
    files = _python_files("adloader", "agent", "predictor", "evaluation")
    files += [p for p in sorted((REPO / "deploy").rglob("*")) if p.is_file()]
    files += [REPO / "run", REPO / "tests" / "conftest.py", REPO / "tests" / "loader_datasets.py"]
    out = {}
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in _NAME.findall(text):
            out.setdefault(name, str(path.relative_to(REPO)))
    return out


def _a_config_keys(name: str) -> bool:
    return name.removeprefix(env.PREFIX).lower() in KEYS


def _a_misspelling(name: str) -> bool:
    """A name shown being refused as a config key's misspelt variable (``ADLOADER_TIK_S``)."""
    return name not in env.OTHER_NAMES and bool(env.misspelt_agent_names(KEYS, {name: ""}))


def _environment_section() -> str:
    text = OPERATIONS.read_text()
    start = text.index("## Environment variables")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_adloader_variable_the_code_reads_is_in_the_operations_guides_table():
    section = _environment_section()
    missing = sorted(f"{n} ({where})" for n, where in names_in_code().items()
                     if not (_a_config_keys(n) or _a_misspelling(n)) and f"`{n}" not in section)
    assert not missing, f"ADLOADER_ variables with no row in docs/operations.md's 'Environment variables': {missing}"
    assert "`ADLOADER_<KEY>`" in section, "the row for the agent's config keys' variables is gone"


def test_every_adloader_variable_the_docs_name_is_read():
    known = names_in_code()
    stale = []
    for doc in DOCS:
        for name in sorted(set(_NAME.findall(doc.read_text()))):
            if name in known or _a_config_keys(name) or _a_misspelling(name):
                continue
            stale.append(f"{name} ({doc.name})")
    assert not stale, f"the docs name ADLOADER_ variables that nothing reads: {stale}"
