"""agent/config.py: precedence defaults <- file <- environment <- command line, errors that name the key."""
from __future__ import annotations

import pytest

from agent import config as configmod

pytestmark = pytest.mark.unit


def test_config_precedence_defaults_file_env_cli(tmp_path):
    f = tmp_path / "agent.toml"
    f.write_text('policy = "even"\ntick_s = 2\nmetrics_port = 9100\nloader_cpus = 3.5\nfairness_floor = false\n')
    env = {"ADLOADER_TICK_S": "0.5", "ADLOADER_MAX_JOBS": "4", "ADLOADER_JOB_ID": "not-a-key"}
    cfg = configmod.load(str(f), {"metrics_port": 0, "policy": None}, environ=env)
    assert cfg.policy == "even"                 # file (cli None = not given)
    assert cfg.tick_s == 0.5                    # env over file
    assert cfg.max_jobs == 4
    assert cfg.metrics_port == 0                # cli over file
    assert cfg.loader_cpus == 3.5 and cfg.fairness_floor is False
    assert configmod.load(None, {}, environ={"ADLOADER_FLOOR_FRACTION": "1"}).floor_fraction == 1.0
    assert configmod.load(None, {}, environ={"ADLOADER_OBSERVED_CORES": "received"}).observed_cores == "received"
    assert cfg.hysteresis == 0.03 and cfg.cgroup_mode == "auto"    # defaults
    assert configmod.load(None, {}, environ={}).loader_cpus == "auto"


@pytest.mark.parametrize("text,key", [
    ('tick_s = 1\npolcy = "even"\n', "'polcy'"),
    ('tick_s = -1\n', "'tick_s'"),
    ('policy = "fastest"\n', "'policy'"),
    ('cgroup_mode = "v3"\n', "'cgroup_mode'"),
    ('max_jobs = 1.5\n', "'max_jobs'"),
    ('floor_fraction = 0\n', "'floor_fraction'"),
    ('floor_fraction = 1.5\n', "'floor_fraction'"),
    ('floor_reference = "gpus"\n', "'floor_reference'"),
    ('floor_allotment = "node"\n', "'floor_allotment'"),
    ('delivery_correction = 0.5\n', "'delivery_correction'"),
    ('observed_cores = "delivered"\n', "'observed_cores'"),
    ('cpu_bound_min_workers = 0\n', "'cpu_bound_min_workers'"),
    ('io_weights = "maybe"\n', "'io_weights'"),
    ('endpoint = "http://x"\n', "'endpoint'"),
    ('endpoint = "ipc://"\n', "needs the socket's path"),          # (before: [Errno 2] ... '' at start)
    ('endpoint = "ipc://run/agent.sock"\n', "must be absolute"),
    # (before: these passed and the agent failed only at its bind, "Invalid argument"; ZeroMQ took the
    # port 70000 as 4464)
    ('endpoint = "tcp://agent.example"\n', "needs a host and a port"),
    ('endpoint = "tcp://:5555"\n', "needs a host and a port"),
    ('endpoint = "tcp://127.0.0.1:notaport"\n', "port must be a number"),
    ('endpoint = "tcp://127.0.0.1:70000"\n', "port must be a number"),
    ('endpoint = "tcp://127.0.0.1:5555/x"\n', "port must be a number"),
    ('tick_s = \n', "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, text, key):
    f = tmp_path / "agent.toml"
    f.write_text(text)
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(str(f), {}, environ={})
    assert key in str(e.value) and str(f) in str(e.value)


@pytest.mark.parametrize("endpoint", ["tcp://agent.example", "tcp://127.0.0.1:notaport", "tcp://[::1]",
                                      "tcp://*:", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:\u0665\u0665"])
def test_a_tcp_endpoint_without_a_port_is_refused_at_load_naming_the_key(endpoint):
    # (before: it passed, and `adloader agent` failed only at its bind)
    with pytest.raises(configmod.ConfigError, match=r"config key 'endpoint' \(the command line\): a tcp:// "):
        configmod.load(None, {"endpoint": endpoint}, environ={})


@pytest.mark.parametrize("endpoint", ["tcp://*:5555", "tcp://127.0.0.1:5555", "tcp://[::1]:5555",
                                      "tcp://agent.example:5555", "tcp://eth0:5555", "tcp://127.0.0.1:*",
                                      "tcp://eth0;agent.example:5555", "ipc:///run/adloader/agent.sock"])
def test_the_endpoint_forms_that_bind_or_connect_are_kept(endpoint):
    assert configmod.load(None, {"endpoint": endpoint}, environ={}).endpoint == endpoint


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    # (before: UnicodeDecodeError out of tomllib: a traceback from `adloader agent`, "internal error"
    # from `adloader job`)
    f = tmp_path / "agent.toml"
    f.write_bytes(b'tick_s = 1.0\npolicy = "\xff"\n')
    with pytest.raises(configmod.ConfigError, match="not valid TOML: not UTF-8") as e:
        configmod.load(str(f), {}, environ={})
    assert str(f) in str(e.value)
    ep, note = configmod.client_endpoint(None, str(f), environ={})
    assert ep.startswith("ipc://") and "not UTF-8" in note


def test_config_env_errors_and_missing_explicit_file(tmp_path):
    with pytest.raises(configmod.ConfigError, match="ADLOADER_TICK_S"):
        configmod.load(None, {}, environ={"ADLOADER_TICK_S": "fast"})
    with pytest.raises(configmod.ConfigError, match="cannot read config file"):
        configmod.load(str(tmp_path / "missing.toml"), {}, environ={})


def test_a_misspelt_key_gets_a_suggestion_and_a_misspelt_variable_is_not_ignored(tmp_path):
    f = tmp_path / "agent.toml"
    f.write_text("tik_s = 2\n")
    with pytest.raises(configmod.ConfigError, match=r"'tik_s' \(did you mean 'tick_s'\?\)"):
        configmod.load(str(f), {}, environ={})
    with pytest.raises(configmod.ConfigError, match=r"'polcy' \(did you mean 'policy'\?\) on the command line"):
        configmod.load(None, {"polcy": "even"}, environ={})
    # ADLOADER_TIK_S=5 in a unit's Environment= was read by nobody: now an error naming the variable it means
    with pytest.raises(configmod.ConfigError, match="ADLOADER_TIK_S is not a config key's variable "
                                                    r"\(did you mean ADLOADER_TICK_S\?\)"):
        configmod.load(None, {}, environ={"ADLOADER_TIK_S": "5"})
    # the client's and the scripts' own variables, and a name near no key, are not the agent's to judge
    others = {"ADLOADER_JOB_ID": "7", "ADLOADER_DISABLE": "0", "ADLOADER_BIN": "/usr/bin/adloader",
              "ADLOADER_SOMETHING_ELSE": "x", "ADLOADER_TICK_S": "2"}
    assert configmod.load(None, {}, environ=others).tick_s == 2.0


def test_every_adloader_variable_the_project_uses_is_a_key_or_a_known_other():
    """The agent stops on an ADLOADER_ name close to a key's (a typo). A variable some other part of the
    project reads (a script, the client, the tests) must be in ``env.OTHER_NAMES``, or an agent that
    inherits it would refuse to start: every such name in the tracked files is checked."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from adloader import env as envmod

    repo = Path(__file__).resolve().parent.parent
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True)
    if listing.returncode != 0 or not listing.stdout:
        why = f"not a git checkout (git ls-files: {listing.stderr.decode().strip()[:200]})"
        print(f"skipping: {why}", file=sys.stderr)
        pytest.skip(why)
    files = listing.stdout
    names = set()
    for rel in filter(None, files.decode().split("\0")):
        try:
            with open(os.path.join(repo, rel), encoding="utf-8", errors="ignore") as f:
                names |= set(re.findall(r"ADLOADER_[A-Z][A-Z0-9_]*", f.read()))
        except (IsADirectoryError, FileNotFoundError):
            continue
    keys = {"ADLOADER_" + k.upper() for k in configmod.KEYS}
    deliberate = {"ADLOADER_TIK_S", "ADLOADER_SOMETHING_ELSE"}       # this file's own typo cases
    assert len(names) > 10, names
    assert names - keys - set(envmod.OTHER_NAMES) - deliberate == set()
    assert envmod.misspelt_agent_names(configmod.KEYS, {n: "1" for n in names - deliberate}) == {}


def test_user_defaults_live_under_the_runtime_dir(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    from adloader import env as envmod

    assert envmod.default_endpoint(1000, env) == f"ipc://{tmp_path}/adloader/agent.sock"
    assert envmod.default_state_dir(1000, env) == f"{tmp_path}/adloader/state"
    assert envmod.default_state_dir(0, env) == "/var/lib/adloader"


def test_auto_loader_cpus_keeps_a_reserve():
    n = len(configmod.agent_cpu_ids())
    assert configmod.auto_loader_cpus() == pytest.approx(max(0.5, round(n * 0.9, 2)))



@pytest.mark.parametrize("key,value,why", [
    ("loader_cpus", "1e9", "at most 4096"),
    ("tick_s", "1e-9", "between 0.05 and 60"),
    ("heartbeat_s", "1e9", "between 0.1 and 300"),
    ("max_jobs", "9" * 4000, "at most 20 digits"),
    ("connections_per_uid", "0", "between 1 and 60000"),
    ("uid_cpu_share", "5", "between 0.001 and 1"),
    ("cgroup_subtree", "../etc", "one name"),
    ("cgroup_subtree", "a/b", "one name"),
    ("metrics_port", "70000", "between 0 and 65535"),
    ("min_confidence", "1.5", "between 0 and 1"),
])
def test_every_number_and_name_is_bounded_and_the_error_names_the_key(key, value, why):
    """Issue 16.10: loader_cpus = 1e9 and tick_s = 1e-9 were accepted (the agent spun at a quarter core)."""
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(None, {}, environ={f"ADLOADER_{key.upper()}": value})
    msg = str(e.value)
    assert f"'{key}'" in msg and why in msg and f"ADLOADER_{key.upper()}" in msg, msg
    assert len(msg) < 400, msg


def test_the_cgroup_subtree_is_a_config_key():
    assert configmod.load(None, {}, environ={"ADLOADER_CGROUP_SUBTREE": "adl-b_2"}).cgroup_subtree == "adl-b_2"
    assert configmod.AgentConfig().cgroup_subtree == "adloader"


def test_policy_knobs_reach_the_policy():
    """The agent's policy keys become the PolicyConfig its controller decides with."""
    from agent.daemon import _policy_config

    cfg = configmod.load(None, {}, environ={"ADLOADER_MIN_CONFIDENCE": "0", "ADLOADER_HYSTERESIS": "0.05"})
    pc = _policy_config(cfg)
    assert (pc.min_confidence, pc.hysteresis) == (0.0, 0.05)
    assert _policy_config(configmod.load(None, {}, environ={})).min_confidence == 0.2


def _in_a_thread(fn, deadline_s: float = 10.0, unblock=None):
    """``fn()``'s result or exception, or a failure if it is still running after the deadline (a blocked
    ``open``), after which ``unblock()`` releases it so the test run does not hang."""
    import threading

    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:   # noqa: BLE001 (handed to the test)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        if unblock is not None:
            unblock()
        t.join(deadline_s)
        pytest.fail(f"still blocked after {deadline_s} s")
    return out


def _open_for_writing(path):
    import os

    def unblock():
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    return unblock


def test_a_config_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    """Before: ``open()`` of a FIFO waits for a writer, so the agent never started (and a SIGHUP reload
    never returned). Now anything but a regular file is a config error that says what it is."""
    import os

    fifo = tmp_path / "agent.toml"
    os.mkfifo(fifo)
    out = _in_a_thread(lambda: configmod.load(str(fifo), {}, environ={}), unblock=_open_for_writing(str(fifo)))
    assert isinstance(out.get("error"), configmod.ConfigError), out
    assert "not a regular file" in str(out["error"]) and "FIFO" in str(out["error"]) and str(fifo) in str(out["error"])
    with pytest.raises(configmod.ConfigError, match="(?i)directory"):
        configmod.load(str(tmp_path), {}, environ={})
    with pytest.raises(configmod.ConfigError, match="not a regular file \\(a character device\\)"):
        configmod.load("/dev/zero", {}, environ={})
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert configmod.load(os.devnull, {}, environ={}) == configmod.load(str(empty), {}, environ={})
    out = _in_a_thread(lambda: configmod.client_endpoint(None, str(fifo), environ={}),
                       unblock=_open_for_writing(str(fifo)))
    ep, note = out["value"]
    assert ep.startswith("ipc://") and "not a regular file" in note


def test_a_config_file_nested_too_deeply_is_a_config_error(tmp_path):
    """Before: RecursionError out of tomllib, a traceback at start and a dead agent on a SIGHUP reload."""
    f = tmp_path / "agent.toml"
    f.write_text("policy = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(configmod.ConfigError, match="not valid TOML: nested too deeply") as e:
        configmod.load(str(f), {}, environ={})
    assert str(f) in str(e.value) and len(str(e.value)) < 300


LONG = "x" * 5000


@pytest.mark.parametrize("text", [
    f'policy = "{LONG}"\n',                         # validated: unknown policy
    f'tick_s = "{LONG}"\n',                         # not a number
    f'io_weights = "{LONG}"\n',                     # not a bool
    f'loader_memory = "{LONG}"\n',                  # not a size
    f'memory_min_available = "off{LONG}"\n',
    f'cgroup_subtree = "{LONG}"\n',
    f'endpoint = "ipc:///{LONG}"\n',
    f'policy = [{", ".join(["1"] * 3000)}]\n',      # not a string
    f'max_jobs = "{"1" * 5000}"\n',
    f'{LONG} = 1\n',                                # an unknown key
    "".join(f"unknown_{i} = 1\n" for i in range(500)),
])
def test_a_long_value_in_a_config_error_is_cut_to_a_readable_length(tmp_path, text):
    """The error line repeated the whole offending value (5,000 characters of it)."""
    f = tmp_path / "agent.toml"
    f.write_text(text)
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(str(f), {}, environ={})
    msg = str(e.value)
    known = len(", ".join(configmod.KEYS)) if "unknown key" in msg else 0    # the list of keys is the help
    assert len(msg) - known < 400 and "..." in msg and str(f) in msg, msg[:600]


def test_a_long_value_from_the_environment_or_in_the_clients_note_is_cut_too(tmp_path):
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(None, {}, environ={"ADLOADER_POLICY": LONG})
    assert len(str(e.value)) < 400 and "ADLOADER_POLICY" in str(e.value) and "..." in str(e.value)
    f = tmp_path / "agent.toml"
    f.write_text(f'endpoint = "http://{LONG}"\n')
    ep, note = configmod.client_endpoint(None, str(f), environ={})
    assert ep.startswith("ipc://") and len(note) < 400 and "..." in note, note


def _hung_reader(monkeypatch, timeout_s=0.1):
    """The config module's file read replaced by one that blocks (a network mount that stopped answering)
    until the returned event is set; ``calls`` counts the reads started."""
    import threading

    gate, calls = threading.Event(), []

    def hung(path, missing_ok=False):
        calls.append(path)
        gate.wait(30.0)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(configmod, "_read_file", hung, raising=False)
    monkeypatch.setattr(configmod, "CONFIG_READ_TIMEOUT_S", timeout_s, raising=False)
    return gate, calls


def _wait_until_read_returned(path, deadline_s=10.0):
    import time

    deadline = time.monotonic() + deadline_s
    while path in getattr(configmod, "_reading", {}) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path not in getattr(configmod, "_reading", {})


def test_a_config_file_that_never_answers_is_a_config_error_within_the_timeout(tmp_path, monkeypatch):
    """Before: a config file on a hung network mount blocked ``load`` (the agent never started) for
    ever. Now the read is bounded: a ConfigError naming the file; while that read still hangs, a second
    ``load`` is refused at once without starting another read; once it returned, reads go on."""
    f = tmp_path / "agent.toml"
    f.write_text('policy = "even"\n')
    gate, calls = _hung_reader(monkeypatch)
    try:
        out = _in_a_thread(lambda: configmod.load(str(f), {}, environ={}), unblock=gate.set)
        assert isinstance(out.get("error"), configmod.ConfigError), out
        assert str(f) in str(out["error"]) and "no answer within 0.1 s" in str(out["error"])
        out = _in_a_thread(lambda: configmod.load(str(f), {}, environ={}), unblock=gate.set)
        assert isinstance(out.get("error"), configmod.ConfigError), out
        assert str(f) in str(out["error"]) and "an earlier read of it has not returned" in str(out["error"])
        ep, note = _in_a_thread(lambda: configmod.client_endpoint(None, str(f), environ={}),
                                unblock=gate.set)["value"]
        assert ep.startswith("ipc://") and str(f) in note and "default endpoint" in note
        assert len(calls) == 1                                 # no thread more per attempt
    finally:
        gate.set()
    _wait_until_read_returned(str(f))
    monkeypatch.undo()
    assert configmod.load(str(f), {}, environ={}).policy == "even"


def test_the_agent_command_says_which_config_file_did_not_answer(tmp_path, monkeypatch, capsys):
    """At start a hung config file is the command's config error (exit 2, one line naming the file)."""
    from agent import cli

    f = tmp_path / "agent.toml"
    f.write_text("")
    gate, _ = _hung_reader(monkeypatch)
    try:
        out = _in_a_thread(lambda: cli.main(["agent", "--config", str(f)]), unblock=gate.set)
    finally:
        gate.set()
    _wait_until_read_returned(str(f))
    assert out.get("value") == 2, out
    err = capsys.readouterr().err
    assert err.startswith("adloader agent: cannot read config file " + str(f)) and "no answer within" in err


NOT_PLAIN_NUMBERS = [("tick_s", "1_0"), ("tick_s", "\u0661\u0660"), ("tick_s", "\uff11.5"), ("max_jobs", "1_0"),
                     ("max_jobs", "\u0661\u0660"), ("metrics_port", "\u0669\u0660\u0669\u0660"),
                     ("loader_cpus", "\u0662"), ("loader_cpus", "1_0"), ("hysteresis", "0.0_5"),
                     ("uid_cpu_share", "\u0660.\u0661")]


@pytest.mark.parametrize("key,text", NOT_PLAIN_NUMBERS)
def test_a_number_from_the_environment_or_the_command_line_is_ascii_digits_without_underscores(key, text):
    """Before: Python's float() and int() read '1_0' as 10 and Arabic-Indic or full-width digits ('١٠',
    '１') as ASCII ones, so ADLOADER_TICK_S=1_0 ran a 10 s tick. Now it is a config error naming the key,
    where the value came from and the value, from the environment and from the command line alike."""
    env_name = "ADLOADER_" + key.upper()
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(None, {}, environ={env_name: text})
    assert f"config key {key!r} from environment {env_name}" in str(e.value) and repr(text) in str(e.value)
    assert "ASCII digits" in str(e.value)
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(None, {key: text}, environ={})
    assert f"config key {key!r} from the command line" in str(e.value) and repr(text) in str(e.value)


def test_plain_numbers_in_text_are_still_read():
    cfg = configmod.load(None, {"max_jobs": " 12 "}, environ={"ADLOADER_TICK_S": "0.5", "ADLOADER_HYSTERESIS": "5e-2",
                                                           "ADLOADER_LOADER_CPUS": "+3", "ADLOADER_METRICS_PORT": "0"})
    assert (cfg.tick_s, cfg.hysteresis, cfg.loader_cpus, cfg.max_jobs, cfg.metrics_port) == (0.5, 0.05, 3.0, 12, 0)


@pytest.mark.parametrize("text", ["1_0GiB", "\u0661\u0660GiB", "\uff16MiB", "1_073_741_824"])
def test_a_size_from_the_environment_is_ascii_digits_without_underscores(text):
    """(``parse_bytes`` already took ASCII digits only; held here for both size keys.)"""
    for key in ("loader_memory", "memory_min_available"):
        with pytest.raises(configmod.ConfigError, match=f"config key {key!r} from environment"):
            configmod.load(None, {}, environ={"ADLOADER_" + key.upper(): text})


@pytest.mark.parametrize("flag,text", [("--tick-s", "1_0"), ("--max-jobs", "\u0661\u0660"),
                                       ("--metrics-port", "\u0669\u0660\u0669\u0660"), ("--loader-cpus", "1_0")])
def test_the_agent_commands_number_flags_refuse_underscores_and_non_ascii_digits(flag, text, capsys):
    """Before: argparse's type=float / type=int converted '1_0' and '١٠' before the config saw them. Now
    the flags hand the text to the config, whose error names the key. (The endpoint is invalid too, so
    that the old code, which accepted the number, stops at it instead of starting an agent.)"""
    from agent import cli

    assert cli.main(["agent", "--endpoint", "bogus", flag, text]) == 2
    err = capsys.readouterr().err
    key = flag[2:].replace("-", "_")
    assert f"config key {key!r} from the command line" in err and repr(text) in err, err


@pytest.mark.parametrize("argv", [
    ["job", "register", "--job", "4242", "--uid", "1_0"],
    ["job", "register", "--job", "4242", "--cpus", "\u0661\u0660"],
    ["job", "release", "--job", "4242", "--timeout-s", "0_5"],
    ["simulate", "--nodes", "1_000"],
    ["simulate", "--cores", "\uff14\uff18"],
    ["bench", "--reps", "1_0"],
    ["demo", "--measure-s", "2_0"],
    ["profile", "--duration", "6_0", "--", "true"],
])
def test_the_other_commands_number_flags_refuse_underscores_and_non_ascii_digits(argv, capsys):
    """Every command's number flags read text as the agent's config does: '1_0' and digits of other
    scripts are a usage error (exit 2) naming the value, not the number int() or float() made of them."""
    from agent import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "in ASCII digits without '_' expected" in err and repr(argv[-1] if argv[-2] != "--" else argv[-3]) in err, err


def test_plain_number_types_read_what_int_and_float_read():
    import argparse

    from agent.commands import plain_float, plain_int

    assert plain_int("42") == 42 and plain_int(" -7 ") == -7 and plain_float("2.5") == 2.5 and plain_float("1e3") == 1000.0
    for bad in ("x", "4.2", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            plain_int(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        plain_float("two")


@pytest.mark.parametrize("argv", [["bench", "--warmup-s", "nan"], ["demo", "--measure-s", "inf"],
                                  ["simulate", "--cores", "1e999"], ["profile", "--cores", "inf", "--", "true"]])
def test_a_command_s_number_flag_refuses_what_is_not_finite(argv, capsys):
    """float() reads 'nan', 'inf' and '1e999'; no flag of the adloader command means one ('--warmup-s
    inf' never ends, 'nan' passes a range check written as ``x < 0``): a usage error naming the value."""
    from agent import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "a finite number expected" in err and repr(argv[2]) in err, err


def test_a_state_dir_that_cannot_be_made_is_named_with_what_is_in_the_way(tmp_path, capsys):
    """state_dir is made at start where missing; where it cannot be (a file in its place or above it)
    the command said "cannot start: [Errno 17] File exists: '<the file>'", naming neither the key nor
    the directory asked for. Now one line names state_dir, the path and the file in the way; exit 1,
    and nothing is bound."""
    from agent import cli

    blocker = tmp_path / "state"
    blocker.write_text("")
    for state_dir in (blocker, blocker / "sub"):
        rc = cli.main(["agent", "--state-dir", str(state_dir), "--endpoint", f"ipc://{tmp_path}/a.sock",
                       "--cgroup-mode", "off"])
        err = capsys.readouterr().err
        assert rc == 1 and err.startswith(f"adloader agent: state_dir '{state_dir}': {blocker} is not a directory"), err
        assert not (tmp_path / "a.sock").exists()



@pytest.mark.parametrize("key,value", [("state_dir", "state"), ("state_dir", "\x01"), ("cgroup_root", "sys/fs/cgroup")])
@pytest.mark.parametrize("source", ["environment", "the command line"])
def test_a_relative_state_dir_or_cgroup_root_is_refused_naming_the_key(key, value, source):
    """Before: ``--state-dir state`` (or ``ADLOADER_STATE_DIR=$'\\x01'``, a stray control character)
    started the agent with its journal in whatever directory it was started from; systemd starts it in /,
    so its journal was another one. Now a config error names the key and where it came from."""
    from agent.config import ConfigError, load

    environ = {f"ADLOADER_{key.upper()}": value} if source == "environment" else {}
    cli = {key: value} if source == "the command line" else {}
    with pytest.raises(ConfigError) as e:
        load("/dev/null", cli, environ=environ)
    assert f"config key '{key}' ({source}" in str(e.value) and "must be an absolute path" in str(e.value), e.value
