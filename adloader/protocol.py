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
    hello      job, rank, local_rank, world_size, pid, worker_pids[int], gpus[str], batch_size,
               workers (current target), requested_workers (the user's num_workers),
               max_workers (int|null), hostname, uid
    report     job, rank, pid, worker_pids[int], stats{...}  (``adloader.DataLoader.stats()``: totals)
    heartbeat  job, rank, pid
    bye        job, rank, pid
    register   job, uid, gpus[str], cpus (int|null), pids[int], source ("slurm"|"cli")
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
- The ``status`` reply may exceed MAX_MESSAGE_BYTES (many jobs): readers of it parse it without the
  limit (``agent.status.query``); the limit guards the agent's socket, not the clients'.

Invariants: ``decode(encode(m)) == m`` for every valid message; ``decode`` never raises anything but
``ProtocolError``; a message over ``MAX_MESSAGE_BYTES`` is refused before parsing.
"""
from __future__ import annotations

import json
import os
from typing import Any

VERSION = "1.0"
MAJOR = int(VERSION.split(".")[0])
MAX_MESSAGE_BYTES = 64 * 1024

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
    {"malformed", "version", "too_large", "unknown_type", "unknown_job", "not_permitted", "rate_limited", "internal"}
)


class ProtocolError(ValueError):
    """A message that cannot be accepted. ``code`` is one of ``ERROR_CODES``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


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
        msg = json.loads(bytes(data).decode("utf-8"))
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
