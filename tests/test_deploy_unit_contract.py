"""The systemd unit's contract with the agent, checked without systemd: the unit's own ExecStart
arguments, with the generated agent.toml, start an agent that sends READY=1 on $NOTIFY_SOCKET
(Type=notify), pings WATCHDOG=1 well within WatchdogSec, reloads on SIGHUP (ExecReload) and stops
cleanly on SIGTERM (systemctl stop). Component tier: a real agent process and a real datagram socket."""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time

import pytest

from agent.commands.install_service import config_template
from tests.conftest import REPO, adloader_cmd, repo_env, wait_for

pytestmark = pytest.mark.component

UNIT = REPO / "deploy" / "systemd" / "adloader-agent.service"


def unit_setting(key: str) -> str:
    m = re.search(rf"^{key}=(.*)$", UNIT.read_text(), re.MULTILINE)
    assert m, f"{key}= missing from the unit"
    return m.group(1)


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|min)?", value)
    assert m, f"unexpected time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_agent_keeps_the_units_notify_watchdog_reload_and_stop_contract(base):
    argv = shlex.split(unit_setting("ExecStart"))
    assert argv[0].endswith("/bin/adloader") and argv[1] == "agent"
    config_flag = argv.index("--config")
    config = os.path.join(base, "agent.toml")
    with open(config, "w") as f:
        f.write(config_template())  # what install-service writes to /etc/adloader/agent.toml
    args = argv[1:config_flag + 1] + [config] + argv[config_flag + 2:]
    watchdog_s = seconds(unit_setting("WatchdogSec"))
    # A short watchdog keeps the test short: the agent pings every half of it (about 2 s here); systemd
    # kills a service whose pings are further apart than the whole of it, which is what is asserted.
    test_watchdog_s = 4.0

    notify_path = os.path.join(base, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(0.2)
    env = repo_env(NOTIFY_SOCKET=notify_path, WATCHDOG_USEC=str(int(test_watchdog_s * 1e6)),
                   ADLOADER_ENDPOINT=f"ipc://{base}/agent.sock", ADLOADER_STATE_DIR=f"{base}/state",
                   ADLOADER_CGROUP_MODE="off")
    env.pop("WATCHDOG_PID", None)
    log = open(os.path.join(base, "agent.log"), "w")
    proc = subprocess.Popen(adloader_cmd(*args), env=env, stdout=log, stderr=subprocess.STDOUT)
    got: list[tuple[float, str]] = []

    def count(state: str, running: bool = True) -> int:
        """Read what the agent sent so far; how many messages carried ``state``."""
        try:
            while True:
                got.append((time.monotonic(), sock.recv(4096).decode()))
        except socket.timeout:
            pass
        if running:
            assert proc.poll() is None, open(log.name).read()
        return sum(state in msg for _, msg in got)

    try:
        wait_for(lambda: count("READY=1"), 30, what="READY=1 from the agent")
        wait_for(lambda: count("WATCHDOG=1") >= 2, 20, what="two WATCHDOG=1 pings")
        pings = [t for t, m in got if "WATCHDOG=1" in m]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < test_watchdog_s, f"watchdog pings {gaps} s apart: systemd would kill the agent"
        assert watchdog_s >= 10, "WatchdogSec must leave room for a slow tick on a busy node"

        assert unit_setting("ExecReload") == "/bin/kill -HUP $MAINPID"
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config_reloaded" in open(log.name).read(), 10, what="reload on SIGHUP")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(seconds(unit_setting("TimeoutStopSec"))) == 0
        assert count("STOPPING=1", running=False) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        sock.close()


def test_unit_bounds_what_a_client_could_exhaust():
    """Issue 16: the unit raises the open-files limit well above what the agent's connection
    accounting lets clients hold, bounds the agent's own memory per process (not with MemoryMax=,
    which on cgroup v2 would also cap the loader workers in the delegated subtree), and shields the
    agent from the OOM killer only partly, with its reason written next to it."""
    from agent.config import AgentConfig
    from agent.server import RESERVED_FDS

    nofile = int(unit_setting("LimitNOFILE"))
    assert nofile >= AgentConfig().max_connections + 2 * RESERVED_FDS + 1024, nofile
    m = re.fullmatch(r"(\d+)([KMG])", unit_setting("LimitDATA"))
    assert m, "LimitDATA= must be a size"
    data_bytes = int(m.group(1)) << {"K": 10, "M": 20, "G": 30}[m.group(2)]
    assert 1 << 30 <= data_bytes <= 16 << 30
    text = UNIT.read_text()
    assert not re.search(r"^Memory(Max|High)=", text, re.MULTILINE), "a unit memory limit caps loader workers on v2"
    assert "MemoryMax=, MemoryHigh=" in text          # listed among the deliberate omissions, with the reason
    adj = int(unit_setting("OOMScoreAdjust"))
    assert -1000 < adj < 0
    comment = text[:text.index("OOMScoreAdjust=")].rsplit("\n\n", 1)[-1]
    assert "OOM" in comment and "bounded" in comment


def test_agent_raises_its_soft_open_files_limit_to_the_hard_one(base):
    import resource
    import shutil

    from tests.agentd_support import AgentProc

    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit (util-linux) to start the agent with a low soft limit")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if hard < 1024:
        pytest.skip(f"the hard open-files limit here is {hard}: too low to show the raise")
    agent = AgentProc(base, "--tick-s", "0.2", wrap=("prlimit", f"--nofile=512:{hard}", "--")).start()
    try:
        doc = agent.status()["agent"]
        assert doc["open_files_limit"] == hard
        assert doc["connections"]["max_connections"] == min(1024, hard - 2 * 256)
    finally:
        assert agent.stop() == 0
    low = AgentProc(base, "--tick-s", "0.2", wrap=("prlimit", "--nofile=700:700", "--")).start()
    try:
        doc = low.status()["agent"]
        assert doc["open_files_limit"] == 700 and doc["connections"]["max_connections"] == 700 - 2 * 256
        assert low.events("connections_bounded_by_fd_limit")
    finally:
        assert low.stop() == 0
