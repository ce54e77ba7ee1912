"""Every environment variable A-Dloader reads, in one place (STYLE 10). Stdlib only.

Training processes (the client hook inside ``adloader.DataLoader``):

    ADLOADER_DISABLE=1       no agent client at all: the loader trains exactly as without an agent
                             (also true/yes/on; 0/false/no/off: on; anything else: one warning, on)
    ADLOADER_ENDPOINT        where the agent listens (``ipc:///path``); default: ``default_endpoint()``;
                             a malformed one (``endpoint_problem``): one warning, and no agent contact
    ADLOADER_JOB_ID          the job this process belongs to; default: SLURM_JOB_ID, then torchrun's
                             TORCHELASTIC_RUN_ID, then ``pid-<pid>`` (a job of one process)
    RANK, LOCAL_RANK, WORLD_SIZE (torch.distributed), else SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS
    LOCAL_WORLD_SIZE (torchrun), else SLURM_NTASKS_PER_NODE: the job's processes on this node (where
                             ``num_workers="auto"`` starts: its CPUs shared among them)
    (each of these numbers in ASCII digits alone, and the two process counts at least 1; a variable
    holding anything else, '1_0', '-1' or WORLD_SIZE=0, is skipped as an unset one is, with one
    warning naming it: logger ``adloader.env``)
    CUDA_VISIBLE_DEVICES, else SLURM_JOB_GPUS: the GPUs this process uses (reported in hello)

The agent (``adloader agent``; see ``agent.config``): ``ADLOADER_<KEY>`` for every config key
(``ADLOADER_TICK_S``, ``ADLOADER_POLICY``, ...; list: ``agent.config.KEYS``) overrides the TOML
file; the command line overrides both. A variable close to one of those names (``misspelt_agent_names``)
stops the agent with an error. Also read, from systemd: NOTIFY_SOCKET, WATCHDOG_USEC,
WATCHDOG_PID; and XDG_RUNTIME_DIR for the per-user runtime directory.

Invariant: nothing else in the project reads ``os.environ`` for these names; ask a function here.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Mapping, Optional

from adloader import protocol

PREFIX = "ADLOADER_"

log = logging.getLogger("adloader.env")


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


DISABLE_ON = ("1", "true", "yes", "on")
DISABLE_OFF = ("", "0", "false", "no", "off")


def disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """ADLOADER_DISABLE set to 1/true/yes/on (any case): no client, no agent contact at all.
    0/false/no/off or unset: the client runs. Any other value ('y', '2', 'disabled') is not read as
    either: the client runs, and one warning names the variable and its value (a user who meant to
    opt out would otherwise be connected without a word)."""
    raw = _env(environ).get("ADLOADER_DISABLE", "")
    value = raw.strip().lower()
    if value in DISABLE_ON:
        return True
    if value not in DISABLE_OFF:
        _report_malformed("ADLOADER_DISABLE", raw, "the agent client stays on",
                          f"not one of {', '.join(DISABLE_ON)} (opt out) or {', '.join(DISABLE_OFF[1:])}")
    return False


def runtime_dir(uid: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the agent's socket lives: /run/adloader for root, else $XDG_RUNTIME_DIR/adloader,
    else /tmp/adloader-<uid> (a per-user directory)."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return "/run/adloader"
    xdg = _env(environ).get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "adloader")
    return f"/tmp/adloader-{uid}"


def default_endpoint(uid: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    return "ipc://" + os.path.join(runtime_dir(uid, environ), "agent.sock")


def default_state_dir(uid: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """Root: /var/lib/adloader; a user: ``<runtime dir>/state``."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return "/var/lib/adloader"
    return os.path.join(runtime_dir(uid, environ), "state")


def endpoint(environ: Optional[Mapping[str, str]] = None) -> str:
    """The agent endpoint a training process (or ``adloader status``) talks to.

    Training processes do not know whether the agent runs as root or as their user: without
    ADLOADER_ENDPOINT they take the system agent's socket if it exists, else their own user's."""
    env = _env(environ)
    ep = env.get("ADLOADER_ENDPOINT", "").strip()
    if ep:
        return ep
    system = default_endpoint(0, env)
    if os.getuid() != 0 and not os.path.exists(ipc_path(system) or ""):
        return default_endpoint(None, env)
    return system


def endpoint_problem(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why ADLOADER_ENDPOINT cannot be the agent's endpoint (``protocol.endpoint_problem``, the check the
    agent makes of its own and ``adloader job``/``status`` of ``--endpoint``), else None (unset, or well
    formed). A malformed value is reported once per value (``_report_malformed``): the agent client
    then contacts no agent, neither at that value (``ipc://`` with no path, a relative path that names
    a different file in each working directory, ``bogus``, which libzmq refuses) nor at the default
    socket (the variable was set to reach some other agent); training goes on without one."""
    value = _env(environ).get("ADLOADER_ENDPOINT", "").strip()
    why = protocol.endpoint_problem(value) if value else None
    if why is not None:
        _report_malformed("ADLOADER_ENDPOINT", value, "the agent client contacts no agent; training goes on "
                          "without it", why)
    return why


def ipc_path(ep: str) -> Optional[str]:
    """The file behind an ``ipc://`` endpoint, None for other transports."""
    return ep[len("ipc://"):] if ep.startswith("ipc://") else None


def job_id(environ: Optional[Mapping[str, str]] = None, pid: Optional[int] = None) -> str:
    """ADLOADER_JOB_ID, else SLURM_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID, else ``pid-<pid>``.

    torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID="none" for every run; then the ranks of one
    node share the torchrun agent as parent, so the job is ``torchrun-<parent pid>``."""
    env = _env(environ)
    for key in ("ADLOADER_JOB_ID", "SLURM_JOB_ID"):
        v = env.get(key, "").strip()
        if v:
            return v
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    if run_id == "none":
        return f"torchrun-{os.getppid()}"
    return f"pid-{os.getpid() if pid is None else pid}"


def _whole_number(text: str) -> Optional[int]:
    """``text`` (stripped) as a whole number when it is written in ASCII digits alone, else None.

    Python's ``int()`` also reads '1_0' as 10 and digits of other scripts ('١٠', '１０') as ASCII ones,
    so a typo or a pasted value became a rank or a process count no one wrote (``agent.config`` refuses
    the same text for the agent's numbers). No number read here has a meaningful sign: ranks are >= 0,
    process counts >= 1 (``_int``'s ``least``) and WATCHDOG_USEC > 0, so '+1' and '-1' are refused too."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


NOT_DIGITS = "not a whole number in ASCII digits (0-9 only: no sign, '_' or digits of other scripts)"


def _report_malformed(name: str, value: str, instead: str, why: str = NOT_DIGITS) -> None:
    """Log, once per variable and value, that ``name`` holds no number this module reads, ``why``
    (a training process reads its rank once per client, the autotuner at every loader: one line is
    enough). Never raises (STYLE 8: the hook inside training does not fail on its own account)."""
    with _reported_lock:
        if (name, value) in _reported:
            return
        _reported.add((name, value))
    log.warning("adloader: ignoring %s=%r: %s; %s", name, value, why, instead)


def _int(env: Mapping[str, str], keys: tuple[str, ...], default: int, least: int = 0) -> int:
    """The first of ``keys`` that is set and holds a whole number (``_whole_number``) of at least
    ``least``, else ``default``. A key set to anything else is skipped, as an unset one is, and
    reported (``_report_malformed``) with what is used instead."""
    malformed = []
    value, source = default, None
    for k in keys:
        v = env.get(k, "").strip()
        if not v:
            continue
        n = _whole_number(v)
        if n is not None and n >= least:
            value, source = n, k
            break
        malformed.append((k, v, NOT_DIGITS if n is None else f"a count of processes must be at least {least}"))
    for k, v, why in malformed:
        _report_malformed(k, v, f"using {source}={value}" if source else f"using the default {value}", why)
    return value


def rank(environ: Optional[Mapping[str, str]] = None) -> int:
    return _int(_env(environ), ("RANK", "SLURM_PROCID"), 0)


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    return _int(_env(environ), ("LOCAL_RANK", "SLURM_LOCALID"), 0)


def world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Processes of this job: WORLD_SIZE, else SLURM_NTASKS; 1 when neither is set or readable. A count
    of 0 is refused as a malformed one is (the agent refuses a hello with world_size 0: the rank was
    never registered)."""
    return _int(_env(environ), ("WORLD_SIZE", "SLURM_NTASKS"), 1, least=1)


def local_world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Processes of this job on this node: LOCAL_WORLD_SIZE (torchrun, and the launchers built on it),
    else SLURM_NTASKS_PER_NODE; 1 when neither is set or readable (0 included, as for ``world_size``)."""
    return _int(_env(environ), ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), 1, least=1)


def gpus(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """GPU ids (indices or UUIDs) this process sees: CUDA_VISIBLE_DEVICES, else SLURM_JOB_GPUS."""
    env = _env(environ)
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"):
        v = env.get(key)
        if v is not None and v.strip() not in ("", "-1", "NoDevFiles"):
            return [g.strip() for g in v.split(",") if g.strip()]
    return []


# ADLOADER_ names read by something other than the agent's config (the client above, the Slurm scripts'
# ADLOADER_BIN, the ./run script's ADLOADER_VENV, the tests' ADLOADER_RUN_SLOW and ADLOADER_TEST_INIT)
OTHER_NAMES = ("ADLOADER_DISABLE", "ADLOADER_JOB_ID", "ADLOADER_BIN", "ADLOADER_VENV", "ADLOADER_RUN_SLOW",
               "ADLOADER_TEST_INIT")


def misspelt_agent_names(keys, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``{name: the config key's name it is close to}`` for every ADLOADER_ variable that is neither a
    config key's (``ADLOADER_<KEY>``) nor one of ``OTHER_NAMES`` but close to a config key's (difflib,
    ratio 0.85 or more): ADLOADER_TIK_S=5 would otherwise be ignored without a word. A name close to
    none is left alone (another tool's)."""
    import difflib

    env = _env(environ)
    names = [PREFIX + k.upper() for k in keys]
    out = {}
    for name in env:
        if not name.startswith(PREFIX) or name in names or name in OTHER_NAMES:
            continue
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
        if near:
            out[name] = near[0]
    return out


def agent_overrides(keys, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``{key: raw string}`` for every config key with ADLOADER_<KEY upper> set (config parses them)."""
    env = _env(environ)
    out = {}
    for key in keys:
        name = PREFIX + key.upper()
        if name in env:
            out[key] = env[name]
    return out


def notify_socket(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """systemd's NOTIFY_SOCKET (a path, or '@name' for an abstract socket), or None."""
    v = _env(environ).get("NOTIFY_SOCKET", "")
    return v or None


def watchdog_interval_s(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """WATCHDOG_USEC as seconds, when it is meant for this process (WATCHDOG_PID absent or ours)."""
    env = _env(environ)
    usec = env.get("WATCHDOG_USEC", "")
    wpid = env.get("WATCHDOG_PID", "")
    if not usec:
        return None
    if wpid and wpid.strip() != str(os.getpid()):
        return None
    v = _whole_number(usec)
    if v is None:
        _report_malformed("WATCHDOG_USEC", usec.strip(), "no watchdog keep-alive is sent")
        return None
    return v / 1e6 if v > 0 else None
