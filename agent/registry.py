"""The job registry: which jobs are on this node, their ranks, owners and processes.

A job is the set of training processes that share a job id (client side: ADLOADER_JOB_ID, else
SLURM_JOB_ID, else torchrun's run id, else ``pid-<pid>``); each process is a rank. A job arrives on
its first ``hello`` or on ``register`` (Slurm prolog, before any rank connects) and departs when
- it was never registered and its last rank said ``bye``, went silent (no message for
  ``LOST_AFTER_BEATS`` heartbeats) or its process is gone (one read of /proc/<pid>/stat per tick for
  each rank not heard from since the previous sweep, pid reuse caught by the process start time: a
  process that just sent a message was alive, and is checked on the first sweep after its last one,
  so a death is noticed within two ticks); or
- it was registered and ``release`` arrives, or every process it registered and every rank is gone,
  or it has no connected rank and no process of it has been seen for ``unseen_timeout_s`` (config key
  ``unseen_job_timeout_s``): a job registered by the Slurm prolog (no pids: its processes do not exist
  yet) whose epilog's release never arrived. ``agent.jobprocs.find_jobs`` looks for the job's processes
  (slurmstepd's title, the job's Slurm cgroup, its processes' SLURM_JOB_ID/ADLOADER_JOB_ID) only when a
  job has been unseen that long; found, the clock restarts. Journal-adopted jobs start a new clock.
A registered job takes part in allocation (``Collector.snapshot``) only while one of its ranks is
connected: a job that never uses A-Dloader, or opted out, costs its neighbours nothing.
Departures are queued; the daemon takes them with ``take_departed()`` and calls
``controller.forget(job)`` before the next tick, so the share is handed out on that tick.

Invariants:
- a job has one owner uid for its whole life; only that uid (or root) may join, report for, or
  release it (``Refused("not_permitted")`` otherwise);
- ``by_identity`` maps every connected ZeroMQ identity to exactly one (job, rank);
- a rank's ``pid`` is the process that connected (peer credentials), not just a claim, and it and
  ``worker_pids`` are always pids in the agent's (host) pid namespace. A training process in a
  container (its own pid namespace) claims namespace-local pids; the agent accepts them only through
  ``security.host_pid`` / ``security.map_ns_pids`` (NSpid of the peer and of its descendants) and keeps
  the pid the process knows itself by in ``Rank.claimed_pid`` and its worker mapping in ``Rank.ns_workers``;
  a claimed worker pid that no live process holds (it exited since the loader listed it) is left out of
  the rank's workers, on either path; one that another live process holds is refused;
- a job's live ranks agree on the world size where they say one (over 1): a hello saying another is
  refused (``not_permitted``), as two jobs run under one job id by mistake would otherwise be counted
  as one job of both's ranks (the one rank number they share was refused already); ranks of a torchrun
  restart with another ``WORLD_SIZE`` join once the old processes are gone;
- a rank's number is below the world size its hello says, where that is over 1 (``malformed``
  otherwise, naming both; 1 is also what a client that does not know its world size sends);
- register and release are idempotent;
- every job id in the registry satisfies ``protocol.check_job_id`` (checked here, at the boundary);
- ownership is settled by who has the right to the id: root's ``register`` (the Slurm prolog) takes a
  job id over from an ordinary user who claimed it first (the squatter's ranks are dropped and the job
  departs, so its cgroup goes, before the new owner's job is made); an ordinary user never takes an
  id from another uid;
- per ordinary uid (root is exempt): at most ``Limits.jobs_per_uid`` jobs, of which at most
  ``Limits.idle_jobs_per_uid`` registered by the user itself with no rank connected; at most
  ``MAX_PIDS_PER_MESSAGE`` pids in one message, no duplicates. Over a bound: ``Refused("over_limit")``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from agent import jobprocs, security
from agent.security import Peer

from adloader import protocol

LOST_AFTER_BEATS = 3
MAX_PIDS_PER_MESSAGE = protocol.MAX_PIDS_PER_MESSAGE    # worker or registered pids in one message (each is one /proc read)
MAX_WORKER_PIDS = MAX_PIDS_PER_MESSAGE
UNSEEN_TIMEOUT_S = 60.0   # default of config key unseen_job_timeout_s
MAX_UID = 2 ** 32 - 2     # the largest uid: uid_t is 32 bits and (uid_t)-1 means "no uid" (setresuid(2))
MAX_SOURCE_CHARS = 64     # a register's ``source`` ("slurm", "cli"), as logged


@dataclass(frozen=True)
class Limits:
    """Per-uid bounds on what an ordinary user may hold in the registry (root is exempt)."""
    jobs_per_uid: int = 32
    idle_jobs_per_uid: int = 4


class Refused(Exception):
    """A request the registry will not carry out; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Rank:
    job: str
    rank: int
    pid: int
    uid: int
    identity: bytes
    start_ticks: Optional[int]
    last_seen: float
    connected_at: float
    worker_pids: tuple[int, ...] = ()
    local_rank: int = 0
    world_size: int = 1
    gpus: tuple[str, ...] = ()
    batch_size: int = 1
    workers: int = 0
    requested_workers: int = 0
    max_workers: Optional[int] = None
    dataset_kind: Optional[str] = None     # "map" | "iterable" (its workers change only at an epoch), from the
                                           # hello or the latest report; None: the client does not say
    hostname: str = ""
    cpu_quota: Optional[float] = None      # cores its cgroup's CPU quota allows (the client reads its own: in a
                                           # container only it sees its cgroup); None: no quota, or not said
    stats: Optional[dict] = None           # latest totals from the client (the collector windows them)
    reports: int = 0
    claimed_pid: Optional[int] = None      # the pid the process knows itself by, in its own pid namespace (container)
    ns_workers: dict[int, int] = field(default_factory=dict)   # container: claimed worker pid -> host pid
    # worker pid -> its start time (clock ticks) when the agent took it: with the pid, the identity a
    # journal-adopted rank's workers are checked by (a pid reused while the agent was down is another process)
    worker_starts: dict[int, Optional[int]] = field(default_factory=dict)


@dataclass
class Job:
    job: str
    uid: int
    arrived_at: float                      # monotonic
    source: str                            # "hello" | "register" | "journal"
    registered: bool = False
    by_root: bool = False                  # registered by root (the Slurm prolog)
    reg_gpus: tuple[str, ...] = ()
    reg_cpus: Optional[int] = None
    reg_pids: dict[int, Optional[int]] = field(default_factory=dict)   # pid -> start ticks (security.pid_start_ticks)
    ranks: dict[int, Rank] = field(default_factory=dict)
    seq: int = 0                           # last directive seq sent
    last_directive: Optional[dict] = None
    seen_at: Optional[float] = None        # monotonic: a process of the job last known alive (None: arrived_at)

    @property
    def gpus(self) -> tuple[str, ...]:
        out: list[str] = list(self.reg_gpus)
        for r in self.ranks.values():
            out.extend(g for g in r.gpus if g not in out)
        return tuple(out)

    def pids(self) -> tuple[int, ...]:
        return tuple(sorted(r.pid for r in self.ranks.values()))

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(sorted({p for r in self.ranks.values() for p in r.worker_pids}))

    def worker_starts(self) -> dict[int, Optional[int]]:
        """Each worker pid -> its start time as recorded when the rank listed it (``Rank.worker_starts``)."""
        return {p: r.worker_starts.get(p) for r in self.ranks.values() for p in r.worker_pids}


def _int_list(value, name: str, limit: int = MAX_WORKER_PIDS) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > limit or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 2 ** 31 for p in value):
        raise Refused("malformed", f"{name} must be a list of at most {limit} positive integers")
    if len(set(value)) != len(value):
        raise Refused("malformed", f"{name} lists a pid more than once")
    return value


def _str_list(value, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 64 or not all(isinstance(g, str) and len(g) < 128 for g in value):
        raise Refused("malformed", f"{name} must be a list of at most 64 strings")
    return value


def _opt_int(msg: dict, name: str, default, lo: int = 0):
    v = msg.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > 1_000_000:
        raise Refused("malformed", f"field {name!r} must be an integer >= {lo}, got {v!r}")
    return v


def _cpu_quota(msg: dict) -> Optional[float]:
    """A hello's or a report's ``cpu_quota`` (cores, > 0); None where it does not say (no quota, an older
    client) or says something else (ignored, as an unknown field is). It can only lower the job's cores:
    a client that overstates it gets no more than a job without a quota."""
    v = msg.get("cpu_quota")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1_000_000:
        return float(v)
    return None


def _dataset_kind(msg: dict) -> Optional[str]:
    """A hello's or a report's ``dataset_kind`` ("map" or "iterable"); None where it does not say (an older
    client) or says something else (ignored, as an unknown field is)."""
    v = msg.get("dataset_kind")
    return v if v in ("map", "iterable") else None


def _opt_str(msg: dict, name: str, limit: int = 255) -> str:
    """An optional string field, cut to ``limit`` characters; another type is ``malformed``, naming it
    (before, ``str()`` of an object or a list was taken as the rank's host name)."""
    v = msg.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise Refused("malformed", f"field {name!r} must be a string, got {type(v).__name__}")
    return v[:limit]


def _hello_batch_size(v: Optional[int], old: Optional[Rank], pid: int) -> int:
    """A hello's ``batch_size``: an integer >= 1, or null when the client does not know it yet (a loader
    with a custom ``batch_sampler`` before its first batch: torch's ``batch_size`` is None and
    ``stats()`` reports the mean delivered batch only once there is one). Unknown keeps what this
    process's rank already had (a reconnect, or a rank adopted from the journal), else 1 until a report
    carries it: ``samples`` are 0 until then, so no step is counted from the placeholder. ``v``: the
    hello's field, checked (``_opt_int(msg, "batch_size", None, 1)``)."""
    if v is not None:
        return v
    return old.batch_size if old is not None and old.pid == pid else 1


def _job_id(msg: dict) -> str:
    job = msg["job"]
    why = protocol.check_job_id(job)
    if why is not None:
        raise Refused("malformed", why)
    return job


class Registry:
    def __init__(self, heartbeat_s: float = 2.0, proc_root: str = "/proc",
                 unseen_timeout_s: float = UNSEEN_TIMEOUT_S,
                 find_jobs: Optional[Callable[[Mapping[str, int]], set[str]]] = None,
                 limits: Optional[Limits] = None):
        """``find_jobs(wanted job -> uid) -> the jobs with a process on this node`` (default
        ``agent.jobprocs.find_jobs`` on ``proc_root``); tests pass a two-line fake."""
        self.heartbeat_s = heartbeat_s
        self.limits = limits or Limits()
        self.proc_root = proc_root           # where NSpid is read for clients in their own pid namespace
        self.unseen_timeout_s = unseen_timeout_s
        self._find_jobs = find_jobs or (lambda wanted: jobprocs.find_jobs(wanted, proc_root))
        self.scans = 0                       # how many times find_jobs ran (status, tests)
        self.jobs: dict[str, Job] = {}
        self.by_identity: dict[bytes, tuple[str, int]] = {}
        self._departed: list[tuple[str, str]] = []
        self.version = 0                  # bumped on every change the journal must record
        self._swept_at = float("-inf")    # ``now`` of the previous sweep

    # --- authorization ----------------------------------------------------------------------------
    @staticmethod
    def _caller(peer: Optional[Peer]) -> Peer:
        if peer is None:
            raise Refused("not_permitted", "the agent cannot identify the caller (no peer credentials on "
                                           "this transport); use the ipc:// endpoint")
        return peer

    def _room_for(self, uid: int, idle: bool) -> None:
        """Refuse a new job of ordinary user ``uid`` over its per-uid bounds (``idle``: a registration
        by the user itself that has no rank yet)."""
        if uid == 0:
            return
        mine = [j for j in self.jobs.values() if j.uid == uid]
        if len(mine) >= self.limits.jobs_per_uid:
            raise Refused("over_limit", f"uid {uid} already has {len(mine)} jobs on this node "
                                        f"(at most {self.limits.jobs_per_uid}; agent key jobs_per_uid)")
        if idle:
            n = sum(1 for j in mine if not j.ranks and j.registered and not j.by_root)
            if n >= self.limits.idle_jobs_per_uid:
                raise Refused("over_limit", f"uid {uid} already registered {n} jobs that no process has "
                                            f"joined (at most {self.limits.idle_jobs_per_uid}; agent key "
                                            "idle_jobs_per_uid)")

    def _owned(self, job_id: str, uid: int) -> Optional[Job]:
        job = self.jobs.get(job_id)
        if job is not None and job.uid != uid:
            raise Refused("not_permitted", f"job {job_id!r} belongs to uid {job.uid}, not uid {uid}")
        return job

    # --- messages ---------------------------------------------------------------------------------
    def hello(self, peer: Optional[Peer], identity: bytes, msg: dict, now: float) -> Rank:
        """A training process says hello: create or join its job, (re)bind its identity."""
        peer = self._caller(peer)
        if peer.pid == 0:
            raise Refused("not_permitted", "the agent cannot see this process (the kernel gave its pid as 0: "
                                           "it is in a pid namespace the agent is not in or above); run the "
                                           "agent in the host's pid namespace (Kubernetes: hostPID: true; "
                                           "docker/podman: --pid=host)")
        job_id = _job_id(msg)
        rank_no = _opt_int(msg, "rank", 0)
        claimed_pid = msg["pid"]
        pid = security.host_pid(claimed_pid, peer.pid, self.proc_root)
        if pid is None:
            raise Refused("not_permitted", f"hello for pid {claimed_pid} came from pid {peer.pid}; a training "
                                           "process may only speak for itself")
        uid = peer.uid
        claimed = msg.get("uid")
        if claimed is not None and (not isinstance(claimed, int) or isinstance(claimed, bool)):
            raise Refused("malformed", f"field 'uid' must be an integer, got {claimed!r}"[:200])
        if claimed is not None and claimed != uid:
            raise Refused("not_permitted", f"hello claims uid {claimed!r} but comes from uid {uid}")
        ns_workers: dict[int, int] = {}
        worker_pids = _int_list(msg.get("worker_pids"), "worker_pids")
        # a container: its pids are local to its pid namespace. Asked of the kernel, not of the claim: a
        # container pid equal to the host pid (NSpid "N N") took the host path, and its worker pids were
        # read as host pids (other processes of the same uid: every root pod's, on Kubernetes)
        contained = claimed_pid != pid or security.in_child_pid_namespace(pid, self.proc_root)
        if contained:
            ns_workers = self._map_workers(worker_pids, pid, {})
            worker_pids = [ns_workers[p] for p in worker_pids if p in ns_workers]
        worker_pids, why = security.live_pids_owned_by(worker_pids, uid)   # (a worker gone since: left out)
        if why:
            raise Refused("not_permitted", f"worker_pids: {why}")
        # every field is checked before the registry changes: a refusal below used to leave the job it had
        # just made, with no rank, in the registry for good (never swept, journaled, counted against the
        # uid's jobs_per_uid and holding the id against other uids)
        fields = dict(local_rank=_opt_int(msg, "local_rank", 0), world_size=_opt_int(msg, "world_size", 1, 1),
                      gpus=tuple(_str_list(msg.get("gpus"), "gpus")),
                      workers=_opt_int(msg, "workers", 0), requested_workers=_opt_int(msg, "requested_workers", 0),
                      max_workers=_opt_int(msg, "max_workers", None), dataset_kind=_dataset_kind(msg),
                      hostname=_opt_str(msg, "hostname"), cpu_quota=_cpu_quota(msg))
        batch_size = _opt_int(msg, "batch_size", None, 1)
        if rank_no >= fields["world_size"] > 1:
            # (before, taken: rank 3 of a world of 2 joined its job as a third rank, and the job's directive
            # was split three ways. A world size of 1 is what a client sends when neither WORLD_SIZE nor
            # SLURM_NTASKS is set, whatever its rank: it says nothing, as in the world-size check below)
            raise Refused("malformed", f"rank {rank_no} is not below world_size {fields['world_size']} (ranks are "
                                       f"numbered 0 to world_size - 1: check RANK and WORLD_SIZE, or SLURM_PROCID "
                                       f"and SLURM_NTASKS, of the training process)")
        job = self._owned(job_id, uid)
        if job is None:
            self._room_for(uid, idle=False)
        prev = self.by_identity.get(identity)
        if prev is not None and prev != (job_id, rank_no):   # one connection is one rank: the old one goes
            pj = self.jobs.get(prev[0])
            if pj is not None:
                self._drop_rank(pj, prev[1], "hello for another job")
            job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = Job(job=job_id, uid=uid, arrived_at=now, source="hello", seen_at=now)
        old = job.ranks.get(rank_no)
        if old is not None and old.pid != pid and security.alive(old.pid, old.start_ticks, self.proc_root):
            raise Refused("not_permitted", f"rank {rank_no} of job {job_id!r} is already held by live pid {old.pid}")
        ws = fields["world_size"]
        for o in job.ranks.values():   # (a world size of 1 is also what a rank that does not say sends)
            if (o.rank != rank_no and o.pid != pid and o.world_size > 1 and ws > 1 and o.world_size != ws
                    and security.alive(o.pid, o.start_ticks, self.proc_root)):
                raise Refused("not_permitted", f"job {job_id!r} already has rank {o.rank} of world size "
                                               f"{o.world_size} (live pid {o.pid}), and this hello says world size "
                                               f"{ws}: two jobs share the job id (ADLOADER_JOB_ID)?")
        if old is not None:
            self.by_identity.pop(old.identity, None)
        r = Rank(job=job_id, rank=rank_no, pid=pid, uid=uid, identity=identity,
                 start_ticks=security.pid_start_ticks(pid, self.proc_root), last_seen=now,
                 connected_at=old.connected_at if old is not None and old.pid == pid else now,
                 worker_pids=tuple(worker_pids), batch_size=_hello_batch_size(batch_size, old, pid), **fields,
                 claimed_pid=claimed_pid if contained else None, ns_workers=ns_workers)
        r.worker_starts = self._worker_starts(r.worker_pids, old.worker_starts if old is not None and old.pid == pid else {})
        if old is not None and old.pid == pid:
            r.stats, r.reports = old.stats, old.reports
        job.ranks[rank_no] = r
        self.by_identity[identity] = (job_id, rank_no)
        self.version += 1
        return r

    def rank_of(self, identity: bytes, peer: Optional[Peer], msg: dict) -> Rank:
        """The rank behind ``identity`` for a report/heartbeat/bye; refuses strangers and impostors."""
        key = self.by_identity.get(identity)
        if key is None:
            raise Refused("unknown_job", "this connection has not said hello (or the agent restarted): "
                                         "send hello first")
        job_id, rank_no = key
        r = self.jobs[job_id].ranks[rank_no]
        own_pid = r.claimed_pid if r.claimed_pid is not None else r.pid   # as the process numbers itself
        if "job" in msg and (msg["job"] != job_id or msg.get("rank", rank_no) != rank_no or msg.get("pid", own_pid) != own_pid):
            raise Refused("not_permitted", f"this connection speaks for job {job_id!r} rank {rank_no} pid {own_pid}, "
                                           f"not job {msg['job']!r} rank {msg.get('rank')!r} pid {msg.get('pid')!r}")
        if peer is None or peer.pid != r.pid:
            raise Refused("not_permitted", "this connection does not belong to the process that said hello")
        return r

    def report(self, identity: bytes, peer: Optional[Peer], msg: dict, now: float) -> Rank:
        r = self.rank_of(identity, peer, msg)
        worker_pids = _int_list(msg.get("worker_pids"), "worker_pids")
        if r.claimed_pid is not None:   # a container: map its namespace-local pids, new ones via NSpid
            r.ns_workers = self._map_workers(worker_pids, r.pid, r.ns_workers)
            worker_pids = [r.ns_workers[p] for p in worker_pids if p in r.ns_workers]
        new = [p for p in worker_pids if p not in r.worker_pids]
        if new:
            live, why = security.live_pids_owned_by(new, r.uid)
            if why:
                raise Refused("not_permitted", f"worker_pids: {why}")
            if len(live) < len(new):   # workers that exited since the loader listed them: left out
                gone = set(new) - set(live)
                worker_pids = [p for p in worker_pids if p not in gone]
        if tuple(worker_pids) != r.worker_pids:
            self.version += 1
            r.worker_starts = self._worker_starts(worker_pids, r.worker_starts)
        r.worker_pids = tuple(worker_pids)
        stats = msg["stats"]
        r.stats = stats
        r.reports += 1
        r.last_seen = now
        for key, attr in (("workers", "workers"), ("max_workers", "max_workers"),
                          ("requested_workers", "requested_workers"), ("batch_size", "batch_size")):
            v = stats.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1_000_000:
                setattr(r, attr, v)
        r.dataset_kind = _dataset_kind(stats) or r.dataset_kind
        if "cpu_quota" in msg:   # every report says it (null: none): an in-place resize moves it
            r.cpu_quota = _cpu_quota(msg)
        return r

    def _worker_starts(self, pids, known: dict[int, Optional[int]]) -> dict[int, Optional[int]]:
        """Each worker pid's start time: as recorded when it was first taken, read now for a new one."""
        return {p: known[p] if p in known else security.pid_start_ticks(p, self.proc_root) for p in pids}

    def _map_workers(self, claimed: list[int], host: int, known: dict[int, int]) -> dict[int, int]:
        """Claimed (namespace-local) worker pids -> host pids: those already in ``known`` as they are,
        the others through the descendants of ``host`` (``security.map_ns_pids``). Refuses a claimed pid
        that another live process of the caller's pid namespace holds (not a descendant: a claim about
        another process); one that no process there holds exited since the loader listed it and is left
        out of the mapping, as a gone pid is on the host path (``security.live_pids_owned_by``)."""
        out = {p: known[p] for p in claimed if p in known}
        unknown = [p for p in claimed if p not in out]
        if unknown:
            found, missing = security.map_ns_pids(unknown, host, self.proc_root)
            held = security.ns_pids_held(missing, host, self.proc_root) if missing else []
            if held:
                raise Refused("not_permitted", f"worker_pids: pid {held[0]} (in the caller's pid namespace) is "
                                               f"another process, not a descendant of the caller (host pid {host})")
            out.update(found)
        return out

    def touch(self, identity: bytes, peer: Optional[Peer], msg: dict, now: float) -> Rank:
        r = self.rank_of(identity, peer, msg)
        r.last_seen = now
        return r

    def bye(self, identity: bytes, peer: Optional[Peer], msg: dict) -> None:
        r = self.rank_of(identity, peer, msg)
        self._drop_rank(self.jobs[r.job], r.rank, "bye")

    def register(self, peer: Optional[Peer], msg: dict, now: float) -> Job:
        peer = self._caller(peer)
        job_id = _job_id(msg)
        uid = msg["uid"]
        if not 0 <= uid <= MAX_UID:
            # (a uid no process can have: before, accepted, and the job's journal entry was then refused
            # at the next start, so a restart lost the registration)
            raise Refused("malformed", f"uid must be 0 to {MAX_UID}, got {uid}")
        source = msg.get("source")
        if source is not None and (not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS):
            raise Refused("malformed", f"source must be a string of at most {MAX_SOURCE_CHARS} characters "
                                       f"(\"slurm\", \"cli\") or null, got {str(source)[:64]!r}")
        if uid != peer.uid and not peer.root:
            raise Refused("not_permitted", f"uid {peer.uid} may not register a job for uid {uid}")
        pids = _int_list(msg.get("pids"), "pids")
        ok, why = security.pids_owned_by(pids, uid)
        if not ok:
            raise Refused("not_permitted", f"pids: {why}")
        cpus = msg.get("cpus")
        if cpus is not None and (not isinstance(cpus, int) or isinstance(cpus, bool) or not 0 < cpus <= 1_000_000):
            raise Refused("malformed", f"cpus must be a positive integer or null, got {cpus!r}")
        gpus = tuple(_str_list(msg.get("gpus"), "gpus"))
        job = self.jobs.get(job_id)
        if job is not None and job.uid != uid:
            if not peer.root:
                raise Refused("not_permitted", f"job {job_id!r} belongs to uid {job.uid}, not uid {uid}")
            # root (the prolog) has the right to the id: an earlier claim by another uid is dropped
            self._depart(job_id, f"job id taken over by root's registration for uid {uid} "
                                 f"(it was claimed by uid {job.uid})")
            job = None
        if job is None:
            self._room_for(uid, idle=not peer.root)
            job = self.jobs[job_id] = Job(job=job_id, uid=uid, arrived_at=now, source="register", seen_at=now)
        job.registered = True
        job.by_root = job.by_root or peer.root
        job.reg_gpus = gpus
        job.reg_cpus = cpus
        job.reg_pids = {p: security.pid_start_ticks(p, self.proc_root) for p in pids}
        self.version += 1
        return job

    def release(self, peer: Optional[Peer], msg: dict) -> bool:
        """Depart a job (idempotent). True if it was here."""
        peer = self._caller(peer)
        job_id = _job_id(msg)
        job = self.jobs.get(job_id)
        if job is None:
            return False
        if job.uid != peer.uid and not peer.root:
            raise Refused("not_permitted", f"job {job_id!r} belongs to uid {job.uid}, not uid {peer.uid}")
        self._depart(job_id, "released")
        return True

    # --- lifecycle --------------------------------------------------------------------------------
    def _drop_rank(self, job: Job, rank_no: int, why: str) -> None:
        r = job.ranks.pop(rank_no, None)
        if r is not None:
            self.by_identity.pop(r.identity, None)
            self.version += 1
            job.seen_at = max(job.seen_at if job.seen_at is not None else job.arrived_at, r.last_seen)
        if job.ranks:
            return
        if not job.registered:
            self._depart(job.job, why)
        elif job.reg_pids and not any(security.alive(p, ct, self.proc_root) for p, ct in job.reg_pids.items()):
            self._depart(job.job, why)
        # a registered job without known pids stays until release (the Slurm epilog) or until none of
        # its processes has been seen for unseen_timeout_s (``sweep``)

    def _depart(self, job_id: str, why: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        for r in job.ranks.values():
            self.by_identity.pop(r.identity, None)
        self._departed.append((job_id, why))
        self.version += 1

    def sweep(self, now: float) -> None:
        """Drop silent or dead ranks and jobs whose processes are all gone (once per tick); forget a
        registered job none of whose processes has been seen for ``unseen_timeout_s``."""
        lost_s = LOST_AFTER_BEATS * self.heartbeat_s
        since = self._swept_at
        self._swept_at = now
        unseen: list[Job] = []
        for job in list(self.jobs.values()):
            for r in list(job.ranks.values()):
                if not (r.last_seen > since or security.alive(r.pid, r.start_ticks, self.proc_root)):
                    self._drop_rank(job, r.rank, "process gone")
                elif now - r.last_seen > lost_s:
                    self._drop_rank(job, r.rank, "heartbeat lost")
            if job.job not in self.jobs:
                continue
            if job.ranks:
                job.seen_at = now
            elif job.registered and job.reg_pids:
                if any(security.alive(p, ct, self.proc_root) for p, ct in job.reg_pids.items()):
                    job.seen_at = now
                else:
                    self._depart(job.job, "process gone")
            elif job.registered:
                unseen.append(job)
        self._expire_unseen(unseen, now)

    def _expire_unseen(self, jobs: list[Job], now: float) -> None:
        """Registered jobs with no process the registry knows of: once one has been unseen for the
        timeout, look for their processes (one /proc scan for all those unseen for half of it, so their
        clocks line up and the scans stay rare); found ones restart their clock, the others depart."""
        timeout = self.unseen_timeout_s
        if not any(now - (j.seen_at if j.seen_at is not None else j.arrived_at) > timeout for j in jobs):
            return
        due = [j for j in jobs if now - (j.seen_at if j.seen_at is not None else j.arrived_at) > timeout / 2]
        try:
            found = self._find_jobs({j.job: j.uid for j in due})
        except Exception:   # a scan that fails must not forget jobs: try again next tick
            return
        self.scans += 1
        for j in due:
            if j.job in found:
                j.seen_at = now
            elif now - (j.seen_at if j.seen_at is not None else j.arrived_at) > timeout:
                self._depart(j.job, f"no process seen for {timeout:g} s (registered, never released)")

    def _adoptable_workers(self, pids: list[int], starts: dict[int, Optional[int]], uid: int) -> list[int]:
        """The journaled worker pids that are still the processes the dead agent took: alive, with the start
        time it recorded (a journal without one: any), and still the rank's uid's. A worker that exited while
        no agent ran may have left its pid to another process, of any user: adopted as a worker, the first
        tick moved it into the job's cgroup (a root daemon or another user's process, throttled with the
        job's loaders until the job left)."""
        return [p for p in pids if security.same_process(p, starts.get(p), uid, self.proc_root)]

    def take_departed(self) -> list[tuple[str, str]]:
        out, self._departed = self._departed, []
        return out

    def next_seq(self, job_id: str) -> int:
        job = self.jobs[job_id]
        job.seq += 1
        return job.seq

    # --- journal ----------------------------------------------------------------------------------
    def to_doc(self) -> dict:
        return {
            job.job: {
                "uid": job.uid, "source": job.source, "registered": job.registered, "by_root": job.by_root,
                "seq": job.seq,
                "last_directive": job.last_directive,
                "reg_gpus": list(job.reg_gpus), "reg_cpus": job.reg_cpus,
                "reg_pids": {str(p): ct for p, ct in job.reg_pids.items()},
                "ranks": {str(r.rank): {"pid": r.pid, "uid": r.uid, "start_ticks": r.start_ticks,
                                        "worker_pids": list(r.worker_pids), "gpus": list(r.gpus),
                                        "worker_start_ticks": {str(p): r.worker_starts.get(p) for p in r.worker_pids},
                                        "batch_size": r.batch_size, "workers": r.workers,
                                        "requested_workers": r.requested_workers, "max_workers": r.max_workers,
                                        "world_size": r.world_size, "local_rank": r.local_rank}
                          for r in job.ranks.values()},
            }
            for job in self.jobs.values()
        }

    def adopt(self, doc: dict, now: float) -> tuple[list[str], list[str]]:
        """Re-adopt jobs from a journal: live ranks come back (waiting for their hello, with a full
        heartbeat grace), dead ones are dropped, and so is each worker pid that is no longer the worker
        the dead agent took (``_adoptable_workers``). Returns (adopted job ids, dead job ids)."""
        adopted, dead = [], []
        for job_id, j in (doc or {}).items():
            try:
                job = Job(job=job_id, uid=int(j["uid"]), arrived_at=now, source="journal", seen_at=now,
                          registered=bool(j.get("registered")), by_root=bool(j.get("by_root")),
                          seq=int(j.get("seq", 0)),
                          reg_gpus=tuple(j.get("reg_gpus") or ()), reg_cpus=j.get("reg_cpus"),
                          reg_pids={int(p): ct for p, ct in (j.get("reg_pids") or {}).items()},
                          last_directive=j.get("last_directive") if isinstance(j.get("last_directive"), dict) else None)
                for rk, r in (j.get("ranks") or {}).items():
                    if not security.alive(int(r["pid"]), r.get("start_ticks"), self.proc_root):
                        continue
                    starts = {int(p): ct for p, ct in (r.get("worker_start_ticks") or {}).items()}
                    workers = self._adoptable_workers([int(p) for p in r.get("worker_pids") or ()], starts,
                                                      int(r["uid"]))
                    job.ranks[int(rk)] = Rank(
                        job=job_id, rank=int(rk), pid=int(r["pid"]), uid=int(r["uid"]),
                        identity=b"", start_ticks=r.get("start_ticks"), last_seen=now, connected_at=now,
                        worker_pids=tuple(workers), worker_starts={p: starts.get(p) for p in workers},
                        gpus=tuple(r.get("gpus") or ()), batch_size=int(r.get("batch_size") or 1),
                        workers=int(r.get("workers") or 0), requested_workers=int(r.get("requested_workers") or 0),
                        max_workers=r.get("max_workers"), world_size=int(r.get("world_size") or 1),
                        local_rank=int(r.get("local_rank") or 0))
            except (KeyError, TypeError, ValueError, AttributeError):
                dead.append(job_id)
                continue
            reg_alive = job.registered and (not job.reg_pids or any(
                security.alive(p, ct, self.proc_root) for p, ct in job.reg_pids.items()))
            if job.ranks or reg_alive:
                self.jobs[job_id] = job
                adopted.append(job_id)
            else:
                dead.append(job_id)
        self.version += 1
        return adopted, dead
