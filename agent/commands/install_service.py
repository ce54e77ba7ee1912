"""``adloader install-service``: install the node agent as a systemd service.

Lays down, under ``--root`` (default ``/``):

    /etc/systemd/system/adloader-agent.service       the unit, as shipped in deploy/systemd/
    /etc/systemd/system/adloader-agent.service.d/10-prefix.conf
                                                     only for a non-default --prefix: its ExecStart=
    /etc/adloader/agent.toml                         every option, commented, at its default (generated
                                                     from ``agent.config``); an edited file is kept and
                                                     the new one written beside it as agent.toml.new
    PREFIX/slurm/{prolog,epilog,taskprolog}.sh       the Slurm scripts, their ADLOADER= line set to
                                                     PREFIX/venv/bin/adloader (they read the endpoint
                                                     from /etc/adloader/agent.toml at every run)
    /var/log/adloader/                               the Slurm scripts' log file where no syslog runs
    PREFIX/venv                                      a virtualenv with the project installed (no torch:
                                                     the agent never imports it)

then, only on the real root and unless told not to: ``systemctl daemon-reload``, ``enable`` and
``restart`` (start, or pick up an upgrade; jobs keep training while the agent restarts).

Invariants: ``--root`` never runs systemctl; ``--dry-run`` prints every action and changes nothing;
files are replaced atomically (write + rename), so slurmd never runs a half-written prolog; an
operator's edited agent.toml is never overwritten.

Run it from a checkout of the project (it needs deploy/ and pyproject.toml beside the packages); it
needs nothing but Python >= 3.10 itself: ``sudo python3 -m agent install-service``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from agent.commands import path_arg

NAME = "install-service"
UNIT = "adloader-agent.service"
DEFAULT_PREFIX = "/opt/adloader"
UNIT_DIR = "etc/systemd/system"
CONFIG_DIR = "etc/adloader"
CONFIG_FILE = "agent.toml"
SLURM_SCRIPTS = ("prolog.sh", "epilog.sh", "taskprolog.sh")
LOG_DIR = "var/log/adloader"
SLURM_LOG_FILE = f"/{LOG_DIR}/slurm.log"
# The install-time lines of each Slurm script (one each, at the top): the taskprolog has only AGENT_CONFIG.
_SCRIPT_LINES = {"prolog.sh": ("ADLOADER", "AGENT_CONFIG", "LOG_FILE"),
                 "epilog.sh": ("ADLOADER", "AGENT_CONFIG", "LOG_FILE"),
                 "taskprolog.sh": ("AGENT_CONFIG",)}

SOURCE_TREE = Path(__file__).resolve().parents[2]  # the checkout: agent/commands/ -> repo root
DEPLOY = SOURCE_TREE / "deploy"


class InstallError(RuntimeError):
    """Something the operator must fix before installing; the message says what."""


# --- the files ------------------------------------------------------------------------------------


def unit_text() -> str:
    return _deploy_file("systemd", UNIT).read_text()


def prefix_dropin(prefix: str) -> str:
    """The drop-in that points ExecStart= at PREFIX/venv (systemd: an empty ExecStart= clears it)."""
    return (
        f"# Written by `adloader install-service --prefix {prefix}`.\n"
        "[Service]\n"
        "ExecStart=\n"
        f"ExecStart={prefix}/venv/bin/adloader agent --config /{CONFIG_DIR}/{CONFIG_FILE}\n"
    )


def slurm_script(name: str, prefix: str, *, config: Optional[str] = None, log_file: str = SLURM_LOG_FILE) -> str:
    """deploy/slurm/<name> with its install-time lines set: ``ADLOADER=PREFIX/venv/bin/adloader``,
    ``AGENT_CONFIG=`` the agent's config file (default /etc/adloader/agent.toml: the file the unit's
    agent reads, so the scripts follow its ``endpoint``), ``LOG_FILE=`` where a line goes without syslog."""
    text = _deploy_file("slurm", name).read_text()
    values = {"ADLOADER": f"{prefix}/venv/bin/adloader", "AGENT_CONFIG": config or f"/{CONFIG_DIR}/{CONFIG_FILE}",
              "LOG_FILE": log_file}
    for var in _SCRIPT_LINES[name]:
        line = re.compile(rf"^{var}=.*$", re.MULTILINE)
        found = line.findall(text)
        if len(found) != 1:
            raise InstallError(f"deploy/slurm/{name}: expected one {var}= line, found {len(found)}")
        text = line.sub(lambda _m: f"{var}={values[var]}", text, count=1)
    return text


def config_template() -> str:
    """The commented agent.toml: every key of ``agent.config.AgentConfig``, its help from that module's
    docstring, and its default as the service (root) resolves it. Every line is a comment: the agent
    runs on its defaults until the operator uncomments one."""
    from adloader import env
    from agent import config

    helps = config_key_help(config.__doc__ or "", config.KEYS)
    defaults = config.AgentConfig()
    computed = {"endpoint": env.default_endpoint(0), "state_dir": env.default_state_dir(0)}
    out = [
        "# A-Dloader node agent configuration (TOML, flat keys).",
        "# Precedence: defaults <- this file <- ADLOADER_<KEY> environment variables <- command line.",
        "# Every key is listed at its default, commented out. Uncomment to change one; then",
        "# `systemctl reload adloader-agent` (SIGHUP) or restart. Unknown keys are refused by name.",
        "# Generated by `adloader install-service` from agent/config.py; see docs/operations.md.",
    ]
    for key in config.KEYS:
        value = computed.get(key) or getattr(defaults, key)
        out.append("")
        out.extend(f"# {line}".rstrip() for line in helps.get(key, "").splitlines())
        out.append(f"# {key} = {_toml_value(value)}")
    return "\n".join(out) + "\n"


def config_key_help(doc: str, keys: Sequence[str]) -> dict[str, str]:
    """Per-key help from the ``Keys`` table of ``agent.config``'s docstring: a line
    ``    name   type   text`` and its deeper-indented continuation lines; ``type: text`` per key."""
    helps: dict[str, list[str]] = {}
    current: Optional[str] = None
    for line in doc.splitlines():
        m = re.match(r"^    (\w+)\s{2,}(\S.*?)\s{2,}(\S.*)$", line)
        if m and m.group(1) in keys:
            current = m.group(1)
            helps[current] = [f"{m.group(2)}: {m.group(3)}"]
        elif current and line.startswith(" " * 12) and line.strip():
            helps[current].append(line.strip())
        else:
            current = None
    return {k: "\n".join(v) for k, v in helps.items()}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _deploy_file(*parts: str) -> Path:
    path = DEPLOY.joinpath(*parts)
    if not path.is_file():
        raise InstallError(
            f"{path} not found: run install-service from a checkout of the project "
            "(git clone ...; sudo python3 -m agent install-service)"
        )
    return path


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One step: ``describe`` is printed (prefixed "would " under --dry-run); ``apply`` does it."""

    describe: str
    apply: Callable[[], None]


def make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each mode 0755 whatever the umask: the job's user must
    reach PREFIX/slurm/taskprolog.sh (slurmstepd runs it as that user, and a TaskProlog it cannot run
    fails every task: "TaskProlog failed status=1") and /etc/adloader/agent.toml (the TaskProlog reads
    its endpoint). Under root's umask 0077 mkdir alone made them 0700. Existing directories are left
    as they are."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        d.chmod(0o755)


def write_file(path: Path, text: str, mode: int) -> Action:
    def apply():
        make_dirs(path.parent)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(mode)
        os.replace(tmp, path)

    return Action(f"write {path} (mode {mode:o})", apply)


def remove_file(path: Path, why: str) -> Action:
    return Action(f"remove {path} ({why})", lambda: path.unlink(missing_ok=True))


def run_command(argv: list[str]) -> Action:
    def apply():
        print("  $ " + " ".join(argv), flush=True)
        subprocess.run(argv, check=True)

    return Action("run " + " ".join(argv), apply)


def _existing_text(path: Path) -> Optional[str]:
    """The text of the operator's file at ``path`` (None if it is not UTF-8 text: it is theirs, kept, and
    differs from the template); ``InstallError`` naming it if it cannot be read at all (a directory, no
    permission). Both were tracebacks."""
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return None
    except OSError as e:
        raise InstallError(f"cannot read the existing {path}: {e.strerror or e}: move it away or fix it") from None


def plan(args: argparse.Namespace) -> list[Action]:
    """Every action, in order, for these arguments (nothing is touched here)."""
    # an empty value (``--root "$DESTDIR"`` with the variable unset) is refused, not read as "/": an
    # empty --root installed into the live / while skipping systemctl as if staging, and an empty
    # --prefix put the Slurm scripts in /slurm and the venv in /venv
    for flag, value in (("--prefix", args.prefix), ("--root", args.root)):
        if value is not None and not value.strip():
            raise InstallError(f"{flag} is empty: give a directory" + (
                " (leave --root out to install into /)" if flag == "--root" else f" (default {DEFAULT_PREFIX})"))
    prefix = args.prefix.rstrip("/") or "/"
    if not os.path.isabs(prefix):
        raise InstallError(f"--prefix {args.prefix!r} must be an absolute path")
    root = Path(args.root or "/")
    under = lambda p: root / p.lstrip("/")  # noqa: E731
    actions: list[Action] = []

    unit_dir = under(UNIT_DIR)
    actions.append(write_file(unit_dir / UNIT, unit_text(), 0o644))
    dropin = unit_dir / f"{UNIT}.d" / "10-prefix.conf"
    if prefix != DEFAULT_PREFIX:
        actions.append(write_file(dropin, prefix_dropin(prefix), 0o644))
    elif dropin.exists():
        actions.append(remove_file(dropin, "back to the default prefix"))

    config_path = under(CONFIG_DIR) / CONFIG_FILE
    template = config_template()
    if not config_path.exists():
        actions.append(write_file(config_path, template, 0o644))
    elif _existing_text(config_path) != template:
        new = config_path.with_name(CONFIG_FILE + ".new")
        actions.append(write_file(new, template, 0o644))
        actions.append(Action(f"keep {config_path} (it differs from this version's template: compare with {new.name})",
                              lambda: None))

    for name in SLURM_SCRIPTS:
        actions.append(write_file(under(prefix) / "slurm" / name, slurm_script(name, prefix), 0o755))
    log_dir = under(LOG_DIR)
    actions.append(Action(f"create {log_dir} (mode 755: the Slurm scripts' log without syslog)",
                          lambda: make_dirs(log_dir)))

    if args.venv:
        venv = under(prefix) / "venv"
        source = Path(args.source) if args.source else SOURCE_TREE
        if not (source / "pyproject.toml").is_file():
            raise InstallError(f"--source {source} has no pyproject.toml: give the project's checkout")
        if not (venv / "bin" / "python").exists():
            actions.append(run_command([sys.executable, "-m", "venv", str(venv)]))
        # the base install: pyzmq, psutil, numpy, scikit-learn, nvidia-ml-py, ... and no torch extra
        actions.append(run_command([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                                    "--upgrade", *args.pip_arg, str(source)]))

    if args.root is not None:
        actions.append(Action("skip systemctl (--root given: files staged only)", lambda: None))
    elif not Path("/run/systemd/system").is_dir():
        actions.append(Action("skip systemctl (systemd is not running on this machine)", lambda: None))
    else:
        actions.append(run_command(["systemctl", "daemon-reload"]))
        if args.enable:
            actions.append(run_command(["systemctl", "enable", UNIT]))
            actions.append(run_command(["systemctl", "restart", UNIT]))
        else:
            actions.append(Action(f"leave {UNIT} disabled (--no-enable): systemctl enable --now {UNIT}", lambda: None))
    return actions


# --- the command ----------------------------------------------------------------------------------


def register(sub) -> None:
    p = sub.add_parser(
        NAME,
        description="Install the node agent as a systemd service: unit, /etc/adloader/agent.toml, "
        "Slurm scripts and a virtualenv with the project (without torch).",
    )
    p.add_argument("--prefix", default=DEFAULT_PREFIX, metavar="DIR",
                   help=f"install prefix: DIR/venv and DIR/slurm (default {DEFAULT_PREFIX})")
    p.add_argument("--root", metavar="DIR",
                   help="stage every file under DIR instead of / (packaging, tests); never runs systemctl. "
                        "A venv made there keeps DIR in its paths: make the real one on the node")
    p.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    p.add_argument("--no-enable", dest="enable", action="store_false",
                   help="install but do not enable or (re)start the service")
    p.add_argument("--no-venv", dest="venv", action="store_false",
                   help="do not create or update PREFIX/venv (it is managed elsewhere)")
    p.add_argument("--source", metavar="DIR", type=path_arg, help="project checkout to pip-install (default: this one)")
    p.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for pip install, repeatable (e.g. --pip-arg=--no-index "
                        "--pip-arg=--find-links=/srv/wheels on an offline node)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.root is None and not args.dry_run and os.geteuid() != 0:
            raise InstallError("installing into / needs root (sudo); --root DIR stages files, --dry-run previews")
        actions = plan(args)
    except InstallError as e:
        print(f"adloader install-service: {e}", file=sys.stderr)
        return 2
    for action in actions:
        if args.dry_run:
            print(f"would {action.describe}")
            continue
        print(action.describe, flush=True)
        try:
            action.apply()
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"adloader install-service: failed to {action.describe}: {e}", file=sys.stderr)
            return 1
    if not args.dry_run and args.root is None:
        print(f"done. Slurm: see docs/operations.md (Prolog={args.prefix.rstrip('/')}/slurm/prolog.sh ...); "
              "check with `adloader status`.")
    return 0
