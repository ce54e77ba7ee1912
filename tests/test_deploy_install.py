"""`adloader install-service --root DIR`: the files it lays down, what it keeps, what it never does
(systemctl under --root; anything at all under --dry-run), and the shipped unit and config checked
against the tools and the agent's typed config where those are available."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.actuators.cgroup import V2_AGENT_LEAF
from tests.conftest import REPO, adloader_cmd, repo_env

pytestmark = pytest.mark.component

UNIT = "adloader-agent.service"
SHIPPED_UNIT = REPO / "deploy" / "systemd" / UNIT
# Directives in the unit that a still-supported systemd may not know yet (it warns and ignores them),
# with the first systemd version that has them.
NEWER_THAN_LOCAL_SYSTEMD = {"DelegateSubgroup": 254}


def systemd_version(tool: str) -> int | None:
    """The major version from `systemd-analyze --version` ("systemd 252 (252.38-1~deb12u1)")."""
    p = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    m = re.match(r"systemd (\d+)", p.stdout)
    return int(m.group(1)) if m else None


def install(root: Path, *args: str, path_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = repo_env()
    if path_dir is not None:  # a PATH whose first entry holds a recording fake `systemctl`
        env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(adloader_cmd("install-service", "--root", str(root), "--no-venv", *args),
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def fake_systemctl(tmp_path) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "fakebin", tmp_path / "systemctl-calls"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "systemctl").chmod(0o755)
    return bin_dir, calls


def files_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in sorted(root.rglob("*")) if p.is_file()}


def test_install_lays_down_the_expected_files(tmp_path, fake_systemctl):
    root = tmp_path / "root"
    bin_dir, calls = fake_systemctl
    p = install(root, path_dir=bin_dir)
    assert p.returncode == 0, p.stderr
    assert files_under(root) == {
        "etc/adloader/agent.toml": 0o644,
        f"etc/systemd/system/{UNIT}": 0o644,
        "opt/adloader/slurm/epilog.sh": 0o755,
        "opt/adloader/slurm/prolog.sh": 0o755,
        "opt/adloader/slurm/taskprolog.sh": 0o755,
    }
    assert (root / f"etc/systemd/system/{UNIT}").read_text() == SHIPPED_UNIT.read_text()
    for name in ("prolog.sh", "epilog.sh", "taskprolog.sh"):
        assert (root / "opt/adloader/slurm" / name).read_text() == (REPO / "deploy/slurm" / name).read_text()
    assert "skip systemctl (--root given" in p.stdout
    assert not calls.exists(), "systemctl must never run when --root is given"


def test_non_default_prefix_gets_a_dropin_and_script_paths(tmp_path):
    root = tmp_path / "root"
    assert install(root, "--prefix", "/srv/adl").returncode == 0
    dropin = root / f"etc/systemd/system/{UNIT}.d/10-prefix.conf"
    assert "ExecStart=\nExecStart=/srv/adl/venv/bin/adloader agent --config /etc/adloader/agent.toml\n" in dropin.read_text()
    for name in ("prolog.sh", "epilog.sh"):
        text = (root / "srv/adl/slurm" / name).read_text()
        assert "\nADLOADER=/srv/adl/venv/bin/adloader\n" in text and "/opt/adloader/venv" not in text
    # back to the default prefix: the stale drop-in goes away
    assert install(root).returncode == 0
    assert not dropin.exists()


def test_an_edited_config_is_kept(tmp_path):
    root = tmp_path / "root"
    assert install(root).returncode == 0
    config = root / "etc/adloader/agent.toml"
    original = config.read_text()
    config.write_text(original + "policy = \"even\"\n")
    p = install(root)
    assert p.returncode == 0 and "keep " in p.stdout
    assert config.read_text().endswith('policy = "even"\n')
    assert (root / "etc/adloader/agent.toml.new").read_text() == original


def test_an_existing_config_that_is_not_text_is_kept_and_one_that_cannot_be_read_is_named(tmp_path):
    """(both were tracebacks: an agent.toml saved in Latin-1, or a directory at its path)"""
    root = tmp_path / "root"
    config = root / "etc/adloader/agent.toml"
    config.parent.mkdir(parents=True)
    config.write_bytes(b"# caf\xe9\npolicy = 'even'\n")
    p = install(root)
    assert p.returncode == 0 and "keep " in p.stdout, p.stderr
    assert config.read_bytes() == b"# caf\xe9\npolicy = 'even'\n" and (config.parent / "agent.toml.new").is_file()
    config.unlink()
    config.mkdir()
    p = install(root, "--dry-run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"cannot read the existing {config}: Is a directory" in p.stderr, p.stderr


def test_a_restrictive_umask_still_lets_job_users_run_the_taskprolog():
    """root's umask 0077 (hardened hosts): the directories install-service creates are 0755 all the
    same, so the job's user reaches PREFIX/slurm/taskprolog.sh (slurmstepd runs it as that user; one
    it cannot run fails every task, "TaskProlog failed status=1") and /etc/adloader/agent.toml. Before,
    they were made 0700 and the installed TaskProlog could not be opened by anyone but root."""
    import shutil
    import tempfile

    from tests.slurm_support import ENV_BIN, NO_PATH

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1) to run the installed TaskProlog as another user")
    root = Path(tempfile.mkdtemp(prefix="adl-install-"))
    try:
        root.chmod(0o755)                       # the user must reach --root itself (pytest's tmp_path is 0700)
        p = subprocess.run(adloader_cmd("install-service", "--root", str(root), "--no-venv"), env=repo_env(),
                           capture_output=True, text=True, timeout=60, umask=0o077)
        assert p.returncode == 0, p.stderr
        for d in ("etc", "etc/adloader", "opt", "opt/adloader", "opt/adloader/slurm", "var/log/adloader"):
            assert (root / d).stat().st_mode & 0o777 == 0o755, d
        script = root / "opt/adloader/slurm/taskprolog.sh"
        run = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", ENV_BIN, "-i",
                              f"PATH={NO_PATH}", "SLURM_JOB_ID=4242", str(script)],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert run.returncode == 0 and run.stdout.splitlines()[-1] == "export ADLOADER_JOB_ID=4242", (run.stdout, run.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_dry_run_changes_nothing(tmp_path, fake_systemctl):
    root = tmp_path / "root"
    bin_dir, calls = fake_systemctl
    p = install(root, "--dry-run", "--prefix", "/srv/adl", path_dir=bin_dir)
    assert p.returncode == 0, p.stderr
    assert not root.exists() and not calls.exists()
    lines = p.stdout.splitlines()
    assert lines and all(line.startswith("would ") for line in lines)
    assert any(f"etc/systemd/system/{UNIT}.d/10-prefix.conf" in line for line in lines)


def test_dry_run_plans_the_venv_without_torch(tmp_path):
    p = subprocess.run(adloader_cmd("install-service", "--root", str(tmp_path / "r"), "--dry-run"),
                       env=repo_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    venv_lines = [line for line in p.stdout.splitlines() if "venv" in line and line.startswith("would run")]
    assert any(" -m venv " in line for line in venv_lines)
    pip = [line for line in venv_lines if " -m pip install " in line]
    assert len(pip) == 1 and pip[0].endswith(str(REPO)) and "torch" not in pip[0]


def test_relative_prefix_is_refused(tmp_path):
    p = install(tmp_path / "root", "--prefix", "opt/x")
    assert p.returncode == 2 and "--prefix" in p.stderr and "absolute" in p.stderr


@pytest.mark.parametrize("flag", ["--prefix", "--root"])
def test_an_empty_prefix_or_root_is_refused_naming_it(flag):
    """Before: ``--root ""`` (``--root "$DESTDIR"`` with the variable unset) planned every file under the
    live / and skipped systemctl as if staging; ``--prefix ""`` became "/", the Slurm scripts /slurm/*.sh.
    Now one line names the flag and exit 2 (checked under --dry-run: the old code touched nothing)."""
    args = ["install-service", "--dry-run", "--no-venv", flag, ""]
    if flag == "--prefix":
        args += ["--root", "/nonexistent-staging-root"]
    p = subprocess.run(adloader_cmd(*args), env=repo_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    assert p.stderr == f"adloader install-service: {flag} is empty: give a directory" + (
        " (leave --root out to install into /)\n" if flag == "--root" else " (default /opt/adloader)\n"), p.stderr


def test_installed_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed: cannot verify the unit here")
    root = tmp_path / "root"
    assert install(root).returncode == 0
    # verify checks that ExecStart's program exists: point it at a stand-in for the (not built) venv
    exe = tmp_path / "adloader"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = tmp_path / UNIT
    text = (root / f"etc/systemd/system/{UNIT}").read_text()
    assert text.count("ExecStart=/opt/adloader/venv/bin/adloader ") == 1
    unit.write_text(text.replace("ExecStart=/opt/adloader/venv/bin/adloader ", f"ExecStart={exe} "))
    p = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # A systemd older than a directive the unit uses logs that key as unknown and ignores it; that, and
    # only that (and only when this systemd really is older), is tolerated with a note.
    version = systemd_version(tool)
    newer = [key for key, since in NEWER_THAN_LOCAL_SYSTEMD.items() if version is not None and version < since]
    lines = p.stderr.splitlines()
    older = [line for line in lines for key in newer
             if re.fullmatch(rf"{re.escape(str(unit))}:\d+: Unknown key '{key}' in section \[Service\], ignoring\.", line)]
    for line in older:
        print(f"note: this systemd predates a directive the unit uses (ignored here): {line}")
    rest = [line for line in lines if line not in older]
    assert p.returncode == 0 and rest == [], p.stderr  # no unknown key, no bad value, no warning


def test_unit_sandbox_exposure_stays_low(tmp_path):
    """systemd's own rating of the sandbox (0 = locked down, 10 = none); 3.3 when written. A change that
    weakens it past 4.0 must justify itself in the unit and here."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed: cannot rate the unit's sandbox here")
    unit = tmp_path / UNIT
    unit.write_text(SHIPPED_UNIT.read_text().replace("ExecStart=/opt/adloader/venv/bin/adloader ", "ExecStart=/bin/true "))
    p = subprocess.run([tool, "security", "--offline=yes", "--threshold=40", str(unit)],
                       capture_output=True, text=True, timeout=60)
    if "--offline" in p.stderr and "unrecognized" in p.stderr:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline: {p.stderr.strip()}")
    assert p.returncode == 0, p.stdout[-400:] + p.stderr


def test_unit_has_the_required_settings():
    settings: dict[str, list[str]] = {}
    for line in SHIPPED_UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    want = {
        "Type": "notify", "Restart": "on-failure", "RuntimeDirectory": "adloader", "StateDirectory": "adloader",
        "ConfigurationDirectory": "adloader", "Delegate": "yes", "ProtectSystem": "strict",
        "ReadWritePaths": "/sys/fs/cgroup", "ProtectHome": "read-only", "NoNewPrivileges": "yes",
        "ExecReload": "/bin/kill -HUP $MAINPID", "KillMode": "process",
        "DelegateSubgroup": V2_AGENT_LEAF,  # the leaf the agent moves itself into on cgroup v2
    }
    for key, value in want.items():
        assert settings.get(key) == [value], key
    assert "WatchdogSec" in settings
    for absent in ("ProtectControlGroups", "PrivateDevices", "ProtectClock", "DeviceAllow", "ProtectProc"):
        assert absent not in settings, f"{absent} would break the agent (see the unit's comments)"


def test_config_template_matches_the_agent_config(tmp_path):
    config = pytest.importorskip("agent.config", reason="agent/config.py (agentd) is not in this build yet")
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from agent.commands.install_service import config_key_help, config_template

    shipped = (REPO / "deploy" / "agent.toml").read_text()
    assert shipped == config_template(), "deploy/agent.toml is stale: regenerate it from agent/config.py"
    uncommented = "\n".join(l[2:] for l in shipped.splitlines()
                             if re.match(r"^# (\w+) = ", l) and l[2:].split(" = ")[0] in config.KEYS)
    values = tomllib.loads(uncommented)
    assert set(values) == set(config.KEYS)
    assert set(config_key_help(config.__doc__, config.KEYS)) == set(config.KEYS), "every key needs its help line"
    # the uncommented file is a valid config that the agent reads back value for value
    path = tmp_path / "agent.toml"
    path.write_text(uncommented)
    loaded = config.load(str(path), environ={})
    assert {k: getattr(loaded, k) for k in config.KEYS} == values


@pytest.mark.slow
def test_full_install_builds_a_working_venv(tmp_path):
    """The venv step for real (pip needs the project's build backend and dependencies reachable)."""
    root = tmp_path / "root"
    p = subprocess.run(adloader_cmd("install-service", "--root", str(root), "--pip-arg=--no-deps"),
                       env=repo_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    adloader = root / "opt/adloader/venv/bin/adloader"
    out = subprocess.run([str(adloader), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("adloader ")
    assert not list((root / "opt/adloader/venv").glob("lib/python*/site-packages/torch"))
