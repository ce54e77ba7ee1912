"""The real Slurm scripts in deploy/slurm/, run the way slurmd runs them: ``env -i`` (no inherited
environment), a PATH that finds nothing (so any program not named by absolute path fails), only the
SLURM_* variables slurmd sets, and ADLOADER_BIN pointing at this checkout's command.

Each call must exit 0, finish within a few seconds whatever the agent does, and log one line.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.slurm_support import BASH, EPILOG, PROLOG, SLURM_ENV, TASKPROLOG, log_line, run_script

pytestmark = pytest.mark.component

BOUND_S = 10.0


def test_scripts_are_valid_bash_and_executable():
    for script in (PROLOG, EPILOG, TASKPROLOG):
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        subprocess.run([BASH, "-n", str(script)], check=True)


def test_install_time_variable_is_at_the_top():
    for script in (PROLOG, EPILOG):
        lines = script.read_text().splitlines()
        assigns = [i for i, l in enumerate(lines) if l.startswith("ADLOADER=")]
        assert assigns and assigns[0] < 20 and lines[assigns[0]] == "ADLOADER=/opt/adloader/venv/bin/adloader"


def test_prolog_and_epilog_are_one_program_with_two_settings():
    """The epilog is the prolog with VERB=release and TAG=adloader-epilog, and its own header. They stay
    two self-contained files on purpose: the documented glob form runs them through links in another
    directory (a helper sourced from "beside" the script would be looked for there), and a prolog that
    must always exit 0 and log its line should not depend on a second file being installed. This keeps
    the two copies from drifting apart."""
    def program(script):
        return [l for l in script.read_text().splitlines() if not l.startswith(("#", "VERB=", "TAG="))]

    assert program(PROLOG) == program(EPILOG)
    for script, verb, tag in ((PROLOG, "register", "adloader-prolog"), (EPILOG, "release", "adloader-epilog")):
        lines = script.read_text().splitlines()
        assert f"VERB={verb}" in lines and f"TAG={tag}" in lines


def test_prolog_with_agent_down(tmp_path, adloader_bin):
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": f"ipc://{tmp_path}/none.sock"}
    rc, out, err, wall_s = run_script(PROLOG, env)
    assert rc == 0 and wall_s < BOUND_S
    line = log_line(err, "adloader-prolog")
    assert "job 4242" in line and "agent down" in line and "timeout" not in line


def test_prolog_with_agent_hung(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent("hang")
    rc, out, err, wall_s = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint})
    assert rc == 0 and wall_s < BOUND_S
    line = log_line(err, "adloader-prolog")
    assert "timeout" in line and "agent down" not in line
    assert agent.messages[0]["type"] == "register"


def test_prolog_then_epilog_with_an_answering_agent(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent()
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    for script, tag in ((PROLOG, "adloader-prolog"), (PROLOG, "adloader-prolog"), (EPILOG, "adloader-epilog"), (EPILOG, "adloader-epilog")):
        rc, out, err, wall_s = run_script(script, env)
        assert rc == 0 and wall_s < BOUND_S
        assert ": ok" in log_line(err, tag)
    assert [m["type"] for m in agent.messages] == ["register", "register", "release", "release"]
    assert agent.messages[0]["cpus"] == 6 and agent.messages[0]["gpus"] == ["0", "1"]
    assert "already released" in err  # the second epilog: idempotent


def test_prolog_with_bad_variables(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent()
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "root?", "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    rc, out, err, wall_s = run_script(PROLOG, env)
    assert rc == 0 and wall_s < BOUND_S
    assert "bad variable" in log_line(err, "adloader-prolog")
    assert agent.messages == []


def test_prolog_without_adloader_installed(tmp_path):
    rc, out, err, wall_s = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": str(tmp_path / "missing")})
    assert rc == 0 and wall_s < BOUND_S
    assert "not an executable" in log_line(err, "adloader-prolog")


def test_prolog_kills_a_hung_command(tmp_path):
    """The second bound: a command that hangs itself (not just the agent) is killed by `timeout`."""
    hung = tmp_path / "hung-adloader"
    hung.write_text("#!/bin/sh\nexec /bin/sleep 60\n")
    hung.chmod(0o755)
    rc, out, err, wall_s = run_script(EPILOG, {**SLURM_ENV, "ADLOADER_BIN": str(hung)})
    assert rc == 0 and wall_s < BOUND_S
    line = log_line(err, "adloader-epilog")
    assert "timed out" in line and "killed after 5s" in line


def test_prolog_survives_a_crashing_command(tmp_path):
    crash = tmp_path / "crash-adloader"
    crash.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'ImportError: no zmq' >&2\nexit 1\n")
    crash.chmod(0o755)
    rc, out, err, _ = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": str(crash)})
    assert rc == 0
    line = log_line(err, "adloader-prolog")
    assert "exited 1" in line and "ImportError: no zmq" in line  # multi-line output folded into one line


def test_taskprolog_exports_endpoint_and_job_id():
    rc, out, err, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "4242"})
    assert rc == 0 and err == ""
    assert out.splitlines() == ["export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock", "export ADLOADER_JOB_ID=4242"]


def test_taskprolog_keeps_the_jobs_own_endpoint_and_respects_opt_out():
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7", "ADLOADER_ENDPOINT": "ipc:///tmp/mine.sock"})
    assert rc == 0 and out.splitlines() == ["export ADLOADER_JOB_ID=7"]
    for opt_out in ("1", "TRUE", " Yes "):     # any case, as the client reads it (adloader.env.disabled)
        rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7", "ADLOADER_DISABLE": opt_out})
        assert rc == 0 and out == "", opt_out
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7", "ADLOADER_DISABLE": "0"})
    assert rc == 0 and out.splitlines()[-1] == "export ADLOADER_JOB_ID=7"
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7; rm -rf /"})
    assert rc == 0 and "ADLOADER_JOB_ID" not in out


def test_taskprolog_prints_only_its_own_lines_whatever_the_jobs_shell_environment(tmp_path):
    """slurmstepd execs the TaskProlog (its #! line decides the shell) with the job's environment, and
    parses every `export` line on its stdout into the task's. A BASH_ENV file (module systems export
    one) and exported functions are the job's; bash used to source and import them before the script
    ran, so their output, or an exported `echo`, became the TaskProlog's export lines."""
    from tests.slurm_support import ENV_BIN, NO_PATH

    bash_env = tmp_path / "bash_env"
    bash_env.write_text('echo "Welcome to the cluster"\necho "export PATH=/from/bash_env"\n')
    p = subprocess.run([ENV_BIN, "-i", f"PATH={NO_PATH}", "SLURM_JOB_ID=7", f"BASH_ENV={bash_env}",
                        'BASH_FUNC_echo%%=() { builtin echo "export EVIL=1"; }', "SHELLOPTS=errexit:nounset",
                        str(TASKPROLOG)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock",
                                     "export ADLOADER_JOB_ID=7"], p.stdout


# --- installed copies: the endpoint from the agent's config, the log line's destinations (issue 13) -----
@pytest.fixture
def installed(tmp_path):
    """The scripts as `install-service` writes them, with their AGENT_CONFIG and LOG_FILE lines pointed
    into ``tmp_path`` (``agent.toml``, ``slurm.log``); returns (dir, config path, log path)."""
    from agent.commands.install_service import SLURM_SCRIPTS, slurm_script

    config, log = tmp_path / "agent.toml", tmp_path / "slurm.log"
    d = tmp_path / "slurm"
    d.mkdir()
    for name in SLURM_SCRIPTS:
        (d / name).write_text(slurm_script(name, "/opt/adloader", config=str(config), log_file=str(log)))
        (d / name).chmod(0o755)
    return d, config, log


def test_prolog_and_epilog_follow_the_agents_configured_endpoint(installed, fake_agent, adloader_bin):  # noqa: F811
    """slurmd gives the scripts an empty environment: the endpoint comes from the agent's config file."""
    d, config, _ = installed
    agent = fake_agent()
    config.write_text(f'policy = "even"\nendpoint = "{agent.endpoint}"   # moved\n')
    for script, tag in (("prolog.sh", "adloader-prolog"), ("epilog.sh", "adloader-epilog")):
        rc, _, err, wall_s = run_script(d / script, {**SLURM_ENV, "ADLOADER_BIN": adloader_bin})
        assert rc == 0 and wall_s < BOUND_S and ": ok" in log_line(err, tag), err
    assert [m["type"] for m in agent.messages] == ["register", "release"]


def test_a_bad_config_is_named_and_the_default_endpoint_used(installed, adloader_bin):
    d, config, _ = installed
    config.write_text('endpoint = "http://nope"\n')
    rc, _, err, _ = run_script(d / "prolog.sh", {**SLURM_ENV, "ADLOADER_BIN": adloader_bin})
    line = log_line(err, "adloader-prolog")
    assert rc == 0 and "must start with ipc:// or tcp://" in line and str(config) in line and "default endpoint" in line


def test_a_valid_endpoint_beside_an_unknown_key_is_used_and_the_key_named(installed, fake_agent, adloader_bin):  # noqa: F811
    """`adloader job --config` takes the file's valid endpoint although another key is unknown, and its
    log line names that key (before, the whole file was refused and the default endpoint used)."""
    d, config, _ = installed
    agent = fake_agent()
    config.write_text(f'endpoint = "{agent.endpoint}"\npolcy = "even"\n')
    rc, _, err, _ = run_script(d / "prolog.sh", {**SLURM_ENV, "ADLOADER_BIN": adloader_bin})
    line = log_line(err, "adloader-prolog")
    assert rc == 0 and ": ok" in line and "'polcy' (did you mean 'policy'?)" in line and str(config) in line
    assert [m["type"] for m in agent.messages] == ["register"]


@pytest.mark.parametrize("text, want", [
    ('endpoint = "ipc:///srv/adl/agent.sock"\n', "ipc:///srv/adl/agent.sock"),
    ('  endpoint="ipc:///srv/adl/a.sock"   # a comment\n', "ipc:///srv/adl/a.sock"),
    ("endpoint = 'ipc:///srv/adl/lit.sock'\n", "ipc:///srv/adl/lit.sock"),
    ('policy = "even"\ntick_s = 0.5\nendpoint = "tcp://127.0.0.1:5555"', "tcp://127.0.0.1:5555"),   # no final newline
    ('# endpoint = "ipc:///commented/out.sock"\npolicy = "even"\n', None),                          # the default
    ("", None),
])
def test_taskprolog_reads_the_endpoint_as_the_agent_does(installed, text, want):
    """The bash reader and the agent's TOML reader agree on every form the reader takes."""
    from agent import config as configmod

    d, config, _ = installed
    config.write_text(text)
    rc, out, err, _ = run_script(d / "taskprolog.sh", {"SLURM_JOB_ID": "4242"})
    expect = want or "ipc:///run/adloader/agent.sock"
    assert rc == 0 and err == "" and out.splitlines() == [f"export ADLOADER_ENDPOINT={expect}", "export ADLOADER_JOB_ID=4242"]
    agent_view = configmod.read_toml(str(config)).get("endpoint")
    assert agent_view == want
    assert configmod.client_endpoint(None, str(config), environ={})[0] == expect or want is None


def test_taskprolog_takes_no_endpoint_from_a_table(installed):
    """An ``endpoint`` key after a ``[table]`` header is that table's, not the agent's top-level key
    (TOML): the agent's own reader finds no endpoint there, and the TaskProlog exports the default, as
    it does with no key at all. Before, its line reader took the table's key."""
    from agent import config as configmod

    d, config, _ = installed
    config.write_text('policy = "even"\n[extra]\nendpoint = "ipc:///srv/adl/table.sock"\n')
    rc, out, err, _ = run_script(d / "taskprolog.sh", {"SLURM_JOB_ID": "4242"})
    assert rc == 0 and err == ""
    assert out.splitlines() == ["export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock", "export ADLOADER_JOB_ID=4242"]
    assert configmod.file_endpoint(str(config)).endpoint is None


def test_taskprolog_says_so_when_it_cannot_read_the_endpoint(installed):
    d, config, _ = installed
    config.write_text('endpoint = "ipc:///srv/odd\\u0041.sock"\n')        # a TOML escape: not taken
    rc, out, err, _ = run_script(d / "taskprolog.sh", {"SLURM_JOB_ID": "4242"})
    assert rc == 0 and out.splitlines() == ["export ADLOADER_JOB_ID=4242"]
    assert "adloader-taskprolog: cannot read the endpoint" in err and str(config) in err


@pytest.fixture
def reachable_dir():
    """A directory that uid 65534 can reach (pytest's ``tmp_path`` lies under a 0700 parent), removed
    afterwards; skips where the test cannot run a script as another user (needs root and setpriv(1))."""
    import os
    import shutil
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run the script as another user")
    d = tempfile.mkdtemp(prefix="adl-taskprolog-")
    os.chmod(d, 0o755)                    # the user must reach the script, not necessarily the config
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _write_config(config: Path, mode: int) -> None:
    config.write_text('endpoint = "ipc:///srv/adl/agent.sock"\n')
    config.chmod(mode)


def _taskprolog_as_nobody(script: Path, config: Path) -> subprocess.CompletedProcess:
    """Install the TaskProlog at ``script`` reading ``config``, and run it as slurmstepd does for a job
    of uid 65534: that user, an empty environment, no usable PATH, SLURM_JOB_ID=4242."""
    import shutil

    from agent.commands.install_service import slurm_script
    from tests.slurm_support import ENV_BIN, NO_PATH

    script.write_text(slurm_script("taskprolog.sh", "/opt/adloader", config=str(config)))
    script.chmod(0o755)
    return subprocess.run([shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", ENV_BIN,
                           "-i", f"PATH={NO_PATH}", "SLURM_JOB_ID=4242", BASH, str(script)],
                          capture_output=True, text=True, timeout=60)


def test_taskprolog_run_as_a_user_who_cannot_read_the_config_guesses_no_endpoint(reachable_dir):
    """slurmstepd runs the TaskProlog as the job's user: a config only root can read (mode 0600) may
    name another endpoint than the default, so the script says so and exports none."""
    config = reachable_dir / "agent.toml"
    _write_config(config, 0o600)
    p = _taskprolog_as_nobody(reachable_dir / "taskprolog.sh", config)
    assert p.returncode == 0 and p.stdout.splitlines() == ["export ADLOADER_JOB_ID=4242"], (p.stdout, p.stderr)
    assert f"cannot read {config} as uid 65534" in p.stderr


def test_taskprolog_run_as_a_user_who_cannot_search_the_config_directory_guesses_no_endpoint(reachable_dir):
    """/etc/adloader mode 0700: to the job's user the config looks absent (stat fails), yet it may be
    there with another endpoint. The script says so and exports none. Before, it took the file for
    missing and exported the default endpoint, a guess the config may contradict."""
    closed = reachable_dir / "etc-adloader"
    closed.mkdir()
    closed.chmod(0o700)
    config, script = closed / "agent.toml", reachable_dir / "taskprolog.sh"
    _write_config(config, 0o644)
    p = _taskprolog_as_nobody(script, config)
    assert p.returncode == 0 and p.stdout.splitlines() == ["export ADLOADER_JOB_ID=4242"], (p.stdout, p.stderr)
    assert f"cannot look into {closed} as uid 65534" in p.stderr
    # a config directory that does not exist at all still means the default
    closed.rename(f"{closed}.gone")
    p = _taskprolog_as_nobody(script, config)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.splitlines() == ["export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock", "export ADLOADER_JOB_ID=4242"]


def test_taskprolog_without_a_config_file_exports_the_default(installed):
    d, _, _ = installed
    rc, out, err, _ = run_script(d / "taskprolog.sh", {"SLURM_JOB_ID": "4242"})
    assert rc == 0 and err == "" and out.splitlines()[0] == "export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock"


def test_the_log_line_reaches_stderr_and_syslog_or_the_log_file(installed, tmp_path, adloader_bin):
    """Always on stderr (slurmd shows it at debug2); to syslog where /dev/log is a socket, else to
    LOG_FILE, so a node without syslog still keeps it."""
    import os
    import stat

    d, _, log = installed
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": f"ipc://{tmp_path}/none.sock"}
    for script in ("prolog.sh", "epilog.sh"):
        rc, _, err, _ = run_script(d / script, env)
        assert rc == 0 and "agent down" in log_line(err, "adloader-" + script[:-3])
    syslog = os.path.exists("/dev/log") and stat.S_ISSOCK(os.stat("/dev/log").st_mode)
    if syslog:
        assert not log.exists()
    else:
        lines = log.read_text().splitlines()
        assert len(lines) == 2 and "adloader-prolog[" in lines[0] and "adloader-epilog[" in lines[1]
        assert all("job 4242" in l and "agent down" in l for l in lines)


def test_a_log_file_that_cannot_be_written_adds_nothing_to_stderr(tmp_path, adloader_bin):
    """A node without syslog whose LOG_FILE's directory is missing (scripts copied by hand, not by
    install-service): stderr holds the one log line and no bash error about the file (the redirect of
    stderr came after the file's, so bash reported the failed open on the script's stderr)."""
    from agent.commands.install_service import slurm_script

    d = tmp_path / "slurm"
    d.mkdir()
    for name in ("prolog.sh", "epilog.sh"):
        (d / name).write_text(slurm_script(name, "/opt/adloader", config=str(tmp_path / "agent.toml"),
                                           log_file=str(tmp_path / "missing" / "slurm.log")))
        (d / name).chmod(0o755)
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": f"ipc://{tmp_path}/none.sock"}
    for script in ("prolog.sh", "epilog.sh"):
        rc, _, err, _ = run_script(d / script, env)
        assert rc == 0 and "agent down" in log_line(err, "adloader-" + script[:-3])
        assert err.strip().splitlines() == [log_line(err, "adloader-" + script[:-3])], err


def test_install_time_lines_are_set_once_each():
    from agent.commands.install_service import slurm_script

    for name in ("prolog.sh", "epilog.sh"):
        text = slurm_script(name, "/srv/adl", config="/srv/adl/agent.toml", log_file="/srv/adl/slurm.log")
        for line in ("ADLOADER=/srv/adl/venv/bin/adloader", "AGENT_CONFIG=/srv/adl/agent.toml", "LOG_FILE=/srv/adl/slurm.log"):
            assert text.count("\n" + line + "\n") == 1, (name, line)
    text = slurm_script("taskprolog.sh", "/srv/adl", config="/srv/adl/agent.toml")
    assert "\nAGENT_CONFIG=/srv/adl/agent.toml\n" in text and "ADLOADER=" not in text


def test_a_syslog_that_stopped_reading_does_not_hang_the_scripts(tmp_path):
    """journald or rsyslog hung or stopped: /dev/log is a socket whose queue is full, and logger(1)
    blocks in its send. The scripts bound it as they bound the command, and the line goes to
    LOG_FILE instead. Before, logger ran without a bound and the prolog hung until the test's own
    60 s limit (slurmd: until PrologEpilogTimeout, then the node drains). Runs the real script in a
    private mount namespace whose /dev holds /dev/null and that socket (the host's /dev is untouched)."""
    import os
    import shlex
    import shutil
    import socket

    from agent.commands.install_service import slurm_script
    from tests.slurm_support import ENV_BIN, NO_PATH

    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None or not os.path.exists("/usr/bin/logger") and not os.path.exists("/bin/logger"):
        pytest.skip("needs root, unshare(1) and logger(1) to give the script a /dev/log of its own")
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:       # a container without CAP_SYS_ADMIN, seccomp refusing unshare(2)
        pytest.skip(f"cannot make a private mount namespace here: {probe.stderr.strip()[:200]}")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "null").touch()
    syslog = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)     # bound, never read
    syslog.bind(str(dev / "log"))
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.connect(str(dev / "log"))
    sender.setblocking(False)
    try:
        while True:                                                 # fill its queue, as a stuck daemon's fills
            sender.send(b"<13>filler")
    except BlockingIOError:
        pass
    ok = tmp_path / "adloader"                                      # answers at once: only logger can block
    ok.write_text("#!/bin/sh\necho 'adloader job register: job 4242 uid 1000: ok' >&2\n")
    ok.chmod(0o755)
    log = tmp_path / "slurm.log"
    try:
        for name in ("prolog.sh", "epilog.sh"):
            script = tmp_path / name
            script.write_text(slurm_script(name, "/opt/adloader", config=str(tmp_path / "agent.toml"), log_file=str(log)))
            script.chmod(0o755)
            inner = (f"mount --bind /dev/null {dev}/null && mount --rbind {dev} /dev && [ -S /dev/log ] && "
                     f"exec {ENV_BIN} -i PATH={NO_PATH} {' '.join(shlex.quote(f'{k}={v}') for k, v in SLURM_ENV.items())} "
                     f"ADLOADER_BIN={ok} {BASH} {script}")
            try:
                p = subprocess.run([unshare, "--mount", "--propagation", "private", BASH, "-c", inner],
                                   capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} hung on a syslog socket that is not read")
            assert p.returncode == 0, (name, p.stderr)
            assert ": ok" in log_line(p.stderr, "adloader-" + name[:-3])
        lines = log.read_text().splitlines()
        assert len(lines) == 2 and "adloader-prolog[" in lines[0] and "adloader-epilog[" in lines[1], lines
    finally:
        sender.close()
        syslog.close()


def test_a_fifo_as_log_file_or_agent_config_never_hangs_the_scripts(installed, fake_agent, adloader_bin):  # noqa: F811
    """LOG_FILE or AGENT_CONFIG a FIFO (or any file that is not a regular one) that nobody writes or
    reads: every script still exits 0 at once. Before, the prolog and epilog hung for ever in the
    append to a FIFO LOG_FILE (a redirection of bash's own, which `timeout` does not bound; slurmd:
    until PrologEpilogTimeout, then the node drains), and the TaskProlog in its read of a FIFO
    AGENT_CONFIG (the task never started)."""
    import os

    d, config, log = installed
    os.mkfifo(config)
    os.mkfifo(log)
    agent = fake_agent()
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    for script, tag in (("prolog.sh", "adloader-prolog"), ("epilog.sh", "adloader-epilog")):
        try:
            rc, _, err, wall_s = run_script(d / script, env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{script} hung on a FIFO")
        assert rc == 0 and ": ok" in log_line(err, tag), err
    assert [m["type"] for m in agent.messages] == ["register", "release"]
    # without ADLOADER_ENDPOINT the command reads AGENT_CONFIG: a FIFO is named, the default used
    rc, _, err, _ = run_script(d / "prolog.sh", {**SLURM_ENV, "ADLOADER_BIN": adloader_bin})
    assert rc == 0 and "is not a regular file (a FIFO)" in log_line(err, "adloader-prolog")
    try:
        rc, out, err, _ = run_script(d / "taskprolog.sh", {"SLURM_JOB_ID": "4242"})
    except subprocess.TimeoutExpired:
        pytest.fail("taskprolog.sh hung on a FIFO")
    assert rc == 0 and out.splitlines() == ["export ADLOADER_JOB_ID=4242"]
    assert f"{config} is not a regular file: no endpoint exported" in err


def test_a_malformed_cpu_count_still_registers_the_job(fake_agent, adloader_bin):  # noqa: F811
    """SLURM_JOB_CPUS_PER_NODE set but malformed or empty: the job is registered without its CPU count
    and the log line says why (before, the prolog sent nothing: "not sent: bad variable")."""
    agent = fake_agent()
    for value in ("2(x3),bad", ""):
        env = {**SLURM_ENV, "SLURM_JOB_CPUS_PER_NODE": value, "ADLOADER_BIN": adloader_bin,
               "ADLOADER_ENDPOINT": agent.endpoint}
        rc, _, err, wall_s = run_script(PROLOG, env)
        line = log_line(err, "adloader-prolog")
        assert rc == 0 and wall_s < BOUND_S and ": ok" in line and "cpus ?" in line, line
        assert "cpus left to the agent: SLURM_JOB_CPUS_PER_NODE" in line, line
    assert [(m["type"], m["job"], m["cpus"], m["gpus"]) for m in agent.messages] == [
        ("register", "4242", None, ["0", "1"])] * 2


def test_a_heterogeneous_job_component_is_registered_and_released_under_one_id(fake_agent, adloader_bin):  # noqa: F811
    """Component 1 of het job 4242 (its own id 4243) on this node: slurmd gives its prolog and epilog
    SLURM_JOB_ID=4243 and the leader's id in SLURM_HET_JOB_ID and SLURM_PACK_JOB_ID (Slurm 22.05,
    prep/script's environment; docs/operations.md, "Heterogeneous jobs"). Both scripts must key the job
    by the same id, or the release misses the registration and it lingers until unseen_job_timeout_s."""
    agent = fake_agent()
    env = {"SLURM_JOB_ID": "4243", "SLURM_JOBID": "4243", "SLURM_HET_JOB_ID": "4242", "SLURM_PACK_JOB_ID": "4242",
           "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "1", "SLURM_JOB_CPUS_PER_NODE": "2",
           "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    rc, _, err, _ = run_script(PROLOG, env)
    line = log_line(err, "adloader-prolog")
    assert rc == 0 and ": ok" in line and "leader 4242" in line, line
    rc, _, err, _ = run_script(EPILOG, {**env, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    line = log_line(err, "adloader-epilog")
    assert rc == 0 and ": ok" in line and "already released" not in line, line
    assert [(m["type"], m["job"]) for m in agent.messages] == [("register", "4243"), ("release", "4243")]
    assert agent.messages[0]["cpus"] == 2 and agent.messages[0]["gpus"] == ["1"]
    # the leader's own component (offset 0): SLURM_HET_JOB_ID is its own id; no note
    env0 = {**env, "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242"}
    rc, _, err, _ = run_script(PROLOG, env0)
    assert rc == 0 and "leader" not in log_line(err, "adloader-prolog")
    rc, _, err, _ = run_script(EPILOG, env0)
    assert rc == 0 and "already released" not in log_line(err, "adloader-epilog")
    assert [(m["type"], m["job"]) for m in agent.messages[2:]] == [("register", "4242"), ("release", "4242")]
