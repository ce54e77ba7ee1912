"""The wire protocol between training processes (and the ``adloader job``/``status`` commands) and the
node agent. Stdlib only: both sides import it; the agent must not need torch, the client not numpy.

Transport: ZeroMQ. The agent binds a ROUTER (``ROUTER_MANDATORY``, ``LINGER=0``, ``MAXMSGSIZE`` =
``MAX_MESSAGE_BYTES``); each training process is a DEALER whose identity is ``client_identity()``.
A message is ONE frame holding one UTF-8 JSON object (no pickle on the wire). Every message has:

    "v":    protocol version "MAJOR.MINOR" (this module's ``VERSION``)
    "type": one of ``MESSAGE_TYPES``

Readers ignore unknown fields (a newer minor adds fields) and refuse another major version with an
error that says which side to upgrade. Messages, by direction (fields beyond v/type):

client -> agent
    hello      job, rank, local_rank, world_size, pid, worker_pids[int], gpus[str],
               batch_size (int >= 1|null: as ``stats()`` reports it, null before a loader with a custom
               batch_sampler has delivered a batch; a rounded mean may flip by one: the agent's
               predictor takes sizes within ``predictor.bank.BATCH_SIZE_TOL`` as one), workers (current target), requested_workers (the
               user's num_workers), max_workers (int|null), dataset_kind ("map"|"iterable", optional: as
               ``stats()`` says it; "iterable": the worker count changes only at an epoch), hostname, uid,
               cpu_quota (float|null, optional: cores the process's cgroup CPU quota allows, a container's
               CPU limit; null: none)
    report     job, rank, pid, worker_pids[int], stats{...}  (``adloader.DataLoader.stats()``: totals),
               cpu_quota (as in hello, read again for each report)
    heartbeat  job, rank, pid
    bye        job, rank, pid
    register   job, uid (0 to 2**32 - 2), gpus[str], cpus (int|null), pids[int], source ("slurm"|"cli"|null)
    release    job, uid
    status     (no fields) -> reply "status" with the agent's status document
agent -> client
    welcome    job, heartbeat_s, challenge (str|null: path of a file only the claimed uid can read)
    directive  job, seq (int, increasing per job), workers (int), cpus (float|null),
               cpuset ([int]|null), reason (str)
    heartbeat  (no fields)
    ok         re (the type it answers), detail (optional)
    error      code (``ERROR_CODES``), message, re (optional)
    status     doc (the status document; ``agent.status`` documents its fields)

Notes on use (v1.0, no wire change; agentd):
- Identity: the client appends ``:<8 hex>`` to ``client_identity()`` for each new socket, so a socket
  opened after a reconnect never collides with the old one that the ROUTER may still know.
- Who the caller is comes from the kernel, not from the message: on ipc:// the agent reads the peer's
  uid/pid (SO_PEERCRED, libzmq's ``Peer-Address`` property). A ``hello`` is accepted only from the
  process whose ``pid`` it names (as the process's own pid namespace numbers it: a client in a container
  sends its local pids, the agent maps them to host pids; ``agent.security``); ``uid`` must be the caller's; worker/registered pids must belong to
  that uid; a job id keeps the uid that created it (root may register/release for any uid). So the
  ``welcome`` field ``challenge`` is always null in this version (no token file is needed).
- A training process's ``report`` (every ~1 s) is its heartbeat; an explicit client ``heartbeat``
  with job/rank/pid is accepted too. The agent sends ``heartbeat`` to every client each heartbeat_s;
  a client that hears nothing for 3 periods reconnects and says hello again. On ``error`` with code
  ``unknown_job`` (the agent restarted and does not know the connection) the client says hello again.
- Error code ``over_limit`` (v1.0, added): the caller's uid is over a per-user bound of the agent
  (jobs, jobs registered without a process); the message says which and the agent key that sets it.
  A client backs off as for ``not_permitted``.
- Endpoints (``endpoint_problem``): ``ipc://`` and an absolute path of at most 100 bytes (UTF-8), or
  ``tcp://[source;]HOST:PORT`` (PORT 0-65535 or ``*``); the agent's ``endpoint`` key, ``--endpoint`` of ``adloader job``/``status`` and a
  training process's ADLOADER_ENDPOINT are each checked by it.
- Job ids (``check_job_id``): 1 to 128 characters from ``A-Z a-z 0-9 _ . : @ + = -``, starting with a
  letter, digit or ``_`` (so never ``.``, ``..`` or a hidden name); no ``/``, no whitespace, no control
  characters. Slurm ids (``4242``, array ``4242_7``), ``pid-<pid>`` and ``torchrun-<run id>`` fit. The
  agent refuses any other id with ``malformed`` before it touches its registry; a cgroup name is made
  from the id one-to-one (``agent.actuators.cgroup.group_name``).
- A directive's ``workers`` is a count, at least 0 (0: the loader loads in the training process).
  ``validate`` checks types only; a client ignores a directive with a negative count (one warning),
  it does not clamp it to 0. A client applies at most one directive per ``adloader.client.DIRECTIVE_MIN_S``
  (0.25 s): one that comes sooner waits, and a newer one replaces it meanwhile.
- A client reads no frame over ``MAX_MESSAGE_BYTES`` either (``MAXMSGSIZE`` on its DEALER: libzmq
  closes the connection that brings one; the client warns once and connects again); after an
  ``error`` reply it says hello again after its hello back-off, not at once.
- Integers are at most ``MAX_INT_DIGITS`` digits (a 4,000-digit number is ``malformed``, not an
  ``OverflowError`` deep inside the agent); ``NaN``, ``Infinity`` and numbers that overflow a float
  are ``malformed`` too.
- The ``status`` reply may exceed MAX_MESSAGE_BYTES (many jobs): readers of it parse it without the
  limit (``agent.status.query``); the limit guards the agent's socket, not the clients'.

Invariants: ``decode(encode(m)) == m`` for every valid message; ``decode`` never raises anything but
``ProtocolError``; a message over ``MAX_MESSAGE_BYTES`` is refused before parsing.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

VERSION = "1.0"
MAJOR = int(VERSION.split(".")[0])
MAX_MESSAGE_BYTES = 64 * 1024
MAX_JOB_ID_CHARS = 128
MAX_PIDS_PER_MESSAGE = 256   # worker or registered pids in one message (the agent reads /proc for each; it refuses more)
MAX_INT_DIGITS = 20          # JSON integers beyond this are refused (int64 has 19 digits)
JOB_ID_GRAMMAR = "[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,127}"
_JOB_ID_RE = re.compile(JOB_ID_GRAMMAR)

# type -> required fields and their JSON types (int means int and not bool)
_STR, _INT, _NUM, _LIST, _DICT = "str", "int", "num", "list", "dict"
SCHEMA: dict[str, dict[str, str]] = {
    "hello": {"job": _STR, "rank": _INT, "pid": _INT},
    "report": {"job": _STR, "rank": _INT, "pid": _INT, "stats": _DICT},
    "heartbeat": {},
    "bye": {"job": _STR, "rank": _INT, "pid": _INT},
    "register": {"job": _STR, "uid": _INT},
    "release": {"job": _STR, "uid": _INT},
    "status": {},
    "welcome": {"job": _STR},
    "directive": {"job": _STR, "seq": _INT, "workers": _INT},
    "ok": {"re": _STR},
    "error": {"code": _STR, "message": _STR},
}
MESSAGE_TYPES = frozenset(SCHEMA)
ERROR_CODES = frozenset(
    {"malformed", "version", "too_large", "unknown_type", "unknown_job", "not_permitted", "rate_limited", "over_limit",
     "internal"}
)


class ProtocolError(ValueError):
    """A message that cannot be accepted. ``code`` is one of ``ERROR_CODES``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_job_id(job: Any) -> Optional[str]:
    """None if ``job`` is a valid job id (module docstring), else why not (for an error message)."""
    if not isinstance(job, str):
        return f"a job id must be a string, got {type(job).__name__}"
    if not job or len(job) > MAX_JOB_ID_CHARS:
        return f"a job id must be 1 to {MAX_JOB_ID_CHARS} characters, got {len(job)}"
    if _JOB_ID_RE.fullmatch(job) is None:
        return (f"job id {job[:64]!r} is not allowed: use letters, digits and _ . : @ + = - only, "
                f"starting with a letter, digit or _ (grammar {JOB_ID_GRAMMAR})")
    return None


def endpoint_problem(endpoint: str) -> Optional[str]:
    """None if ``endpoint`` can be the agent's endpoint (ipc:// with an absolute path of at most 100
    bytes, or tcp://[source;]HOST:PORT), else why not (for an error message). One check for every side: the agent's
    ``endpoint`` key (``agent.config``), ``--endpoint`` of ``adloader job``/``status``, and the
    training process's ADLOADER_ENDPOINT (``adloader.env.endpoint_problem``)."""
    if not endpoint.startswith(("ipc://", "tcp://")):
        return "must start with ipc:// or tcp://"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            return "an ipc:// endpoint needs the socket's path, e.g. ipc:///run/adloader/agent.sock"
        if not path.startswith("/"):
            return ("an ipc:// path must be absolute (ipc:///...): a relative one names a different file in "
                    "each process's working directory")
        if len(path.encode("utf-8", "surrogateescape")) > 100:
            # bytes, not characters: sun_path holds 108 bytes (unix(7)); 'é' * 60 passed as 60 characters,
            # and the client's connect failed on it without a word, for the whole run
            return "an ipc:// path must be at most 100 bytes (the unix socket limit)"
        return None
    # tcp://[source;]HOST:PORT, HOST a name, an address ([::1] for IPv6), an interface or * (bind to
    # all); PORT 0-65535 or * (ZeroMQ's own forms). 'tcp://host' and 'tcp://host:x' passed here and
    # failed only at the agent's bind ("Invalid argument"); ZeroMQ takes 'host:70000' as port 4464
    host, colon, port = endpoint[len("tcp://"):].rpartition(";")[2].rpartition(":")
    if not colon or not host:
        return "a tcp:// endpoint needs a host and a port, e.g. tcp://127.0.0.1:5555"
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return f"a tcp:// port must be a number from 0 to 65535 (or *), got {port!r}"
    return None


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:32]} is out of range")
    return v


def _parse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _type_ok(value: Any, kind: str) -> bool:
    if kind == _STR:
        return isinstance(value, str)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _LIST:
        return isinstance(value, list)
    if kind == _DICT:
        return isinstance(value, dict)
    return False


def validate(msg: Any) -> dict:
    """Check a decoded message against the schema; return it, or raise ``ProtocolError``."""
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", f"a message must be a JSON object, got {type(msg).__name__}")
    v = msg.get("v")
    if not isinstance(v, str) or not v.partition(".")[0].isdigit():
        raise ProtocolError("malformed", f"missing or bad protocol version field 'v': {v!r}")
    major = int(v.partition(".")[0])
    if major != MAJOR:
        newer = "agent" if major > MAJOR else "client"
        raise ProtocolError(
            "version",
            f"protocol version {v} is not compatible with {VERSION} (major {major} != {MAJOR}); "
            f"upgrade adloader on the {'side that speaks ' + VERSION if newer == 'agent' else 'client side'}",
        )
    t = msg.get("type")
    if t not in SCHEMA:
        raise ProtocolError("unknown_type", f"unknown message type {t!r}; known: {', '.join(sorted(SCHEMA))}")
    for field, kind in SCHEMA[t].items():
        if field not in msg:
            raise ProtocolError("malformed", f"{t} message is missing field {field!r}")
        if not _type_ok(msg[field], kind):
            raise ProtocolError("malformed", f"{t} message field {field!r} must be {kind}, got {msg[field]!r}")
    return msg


def make(type_: str, **fields: Any) -> dict:
    """Build a message of ``type_`` (validated)."""
    return validate({"v": VERSION, "type": type_, **fields})


def encode(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, max_bytes: int | None = MAX_MESSAGE_BYTES) -> dict:
    """Parse and validate one frame. Raises only ``ProtocolError``. ``max_bytes`` None: no size limit
    (a command reading the agent's status document, which may exceed a message's limit)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("malformed", f"a frame must be bytes, got {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise ProtocolError("too_large", f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        msg = json.loads(bytes(data).decode("utf-8"), parse_int=_parse_int, parse_float=_parse_float,
                         parse_constant=_parse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError("malformed", f"not a UTF-8 JSON object: {e}") from None
    return validate(msg)


def error(code: str, message: str, re: str | None = None) -> dict:
    assert code in ERROR_CODES, code
    m = {"v": VERSION, "type": "error", "code": code, "message": message}
    if re:
        m["re"] = re
    return m


def client_identity(job: str, rank: int, pid: int | None = None) -> bytes:
    """DEALER identity: unique per training process; the ROUTER addresses replies with it."""
    return f"{job}:{rank}:{pid if pid is not None else os.getpid()}".encode()[:255]
