"""``adloader job register|release``: tell the node agent that a job starts or ends on this node.

The Slurm prolog and epilog (``deploy/slurm/``) call this with ``--slurm``; an operator or another
scheduler calls it with explicit ``--job/--uid/--gpus/--cpus``.

Invariants (DESIGN "Slurm": a failing or hanging prolog drains the node):

- One request through ``agent.rpc.request`` (one short-lived DEALER, one poll loop against a monotonic
  deadline): the call returns within ``--timeout-s`` (plus process start-up) whether the agent is up,
  down (no socket / nobody listening) or hung (never answers).
- Exactly one line is printed per call, on stderr, saying what was done or why not (agent down,
  timeout, bad flag value or variable, error reply). The prolog hands that line to ``logger``.
- With ``--slurm`` the exit status is ALWAYS 0: the prolog must never fail because of A-Dloader.
  Without it: 0 on success, 1 when the agent could not be reached or refused, 2 for bad arguments.
- Idempotent from the caller's side: registering twice is the agent's business (it answers ok or
  error, never hangs); releasing a job the agent does not know (``unknown_job``) counts as done.
- Nothing heavier than pyzmq is imported (the prolog pays for every import).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional

from agent.commands import plain_int, plain_number

NAME = "job"
DEFAULT_TIMEOUT_S = 2.0

# exit statuses without --slurm
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class JobSpecError(ValueError):
    """A job description that cannot be sent: a missing or malformed SLURM_* variable or flag.

    ``heading`` says what is at fault in the log line ("not sent: <heading>: <text>"): "bad variable"
    for an environment variable (the text names it), "bad --job value" for a flag's value (the text says
    what is wrong with it), "" where the text says it all ("--job is required without --slurm")."""

    def __init__(self, text: str, heading: str = "bad variable"):
        super().__init__(text)
        self.heading = heading

    def line(self) -> str:
        return f"{self.heading}: {self}" if self.heading else str(self)


@dataclass(frozen=True)
class JobSpec:
    """What the agent is told about a job on this node (the ``register`` message's fields)."""

    job: str
    uid: int
    gpus: list[str] = field(default_factory=list)
    cpus: Optional[int] = None
    note: str = ""  # something worth a word in the log line (e.g. why cpus is unknown)


@dataclass(frozen=True)
class Outcome:
    """Result of one request: ``ok`` says whether the agent accepted it; ``why`` is for the log line;
    ``code`` is the agent's error code when it refused (``adloader.protocol.ERROR_CODES``)."""

    ok: bool
    why: str
    code: Optional[str] = None


# --- parsing the Slurm environment ----------------------------------------------------------------

_CPUS_ITEM = re.compile(r"^\s*([0-9]{1,9})\s*(?:\(x([0-9]{1,9})\))?\s*$")   # (Slurm's counts fit in 32 bits)


def cpus_per_node_runs(value: str) -> list[tuple[int, int]]:
    """Slurm's compressed per-node CPU counts as (count, nodes) runs, not expanded (a repeat count is
    a number of nodes: ``2(x100000000)`` must not become a list of 10^8): ``"2(x3),1"`` -> [(2, 3),
    (1, 1)]. Raise ``JobSpecError`` on anything else."""
    if not value or not value.strip():
        raise JobSpecError("SLURM_JOB_CPUS_PER_NODE is empty")
    runs: list[tuple[int, int]] = []
    for item in value.split(","):
        m = _CPUS_ITEM.match(item)
        if not m:
            raise JobSpecError(f"SLURM_JOB_CPUS_PER_NODE={value[:80]!r}: cannot parse {item[:40]!r} "
                               f"(want N or N(xK), at most 9 digits each)")
        n, repeat = int(m.group(1)), int(m.group(2) or 1)
        if n <= 0 or repeat <= 0:
            raise JobSpecError(f"SLURM_JOB_CPUS_PER_NODE={value[:80]!r}: counts must be positive")
        runs.append((n, repeat))
    return runs


def parse_cpus_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed per-node CPU counts: ``"4"`` -> [4]; ``"2(x3)"`` -> [2, 2, 2];
    ``"4,2"`` -> [4, 2]; ``"2(x3),1"`` -> [2, 2, 2, 1]. Raise ``JobSpecError`` on anything else.
    (``slurm_job`` reads the runs, ``cpus_per_node_runs``, without expanding them.)"""
    return [n for n, repeat in cpus_per_node_runs(value) for _ in range(repeat)]


def _node_count(runs: list[tuple[int, int]], node: int) -> Optional[int]:
    """Entry ``node`` (0-based) of the expanded counts, or None past their end."""
    for n, repeat in runs:
        if node < repeat:
            return n
        node -= repeat
    return None


def parse_gpus(value: str) -> list[str]:
    """``"0,1"`` -> ["0", "1"]; empty, ``"NoDevFiles"`` or ``"-1"`` -> [] (Slurm's ways to say none)."""
    v = (value or "").strip()
    if v in ("", "-1", "NoDevFiles", "(null)"):
        return []
    return [g.strip() for g in v.split(",") if g.strip()]


def _parse_uid(value: str, what: str) -> int:
    try:
        uid = int(value.strip())
    except (ValueError, AttributeError):
        raise JobSpecError(f"{what}={value!r} is not a numeric uid") from None
    if uid < 0:
        raise JobSpecError(f"{what}={value!r} is negative")
    return uid


def slurm_job(environ: Mapping[str, str], need_resources: bool = True) -> JobSpec:
    """The job as the Slurm prolog/epilog environment describes it.

    Reads SLURM_JOB_ID and SLURM_JOB_UID (required), SLURM_JOB_GPUS and SLURM_JOB_CPUS_PER_NODE
    (optional; ``need_resources=False`` for release skips them). The CPU count is this node's entry:
    indexed by SLURM_NODEID when Slurm sets it, else the common value when every node has the same
    count; with differing counts and no index the count is left to the agent (cpus None, noted). A
    SLURM_JOB_CPUS_PER_NODE that is set but empty or malformed (``"2(x3),bad"``) is no reason to leave
    the job unregistered: cpus is None and the note says what was wrong with it (before, the prolog
    sent nothing and the job ran without the agent's share).

    Heterogeneous jobs: slurmd gives a component's prolog and epilog that component's own id in
    SLURM_JOB_ID (and the leader's in SLURM_HET_JOB_ID); both scripts key the job by SLURM_JOB_ID, so
    they register and release the same id (docs/operations.md, "Heterogeneous jobs")."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        raise JobSpecError("SLURM_JOB_ID is not set (not running as a Slurm prolog/epilog?)")
    if not job.isdigit():
        raise JobSpecError(f"SLURM_JOB_ID={job!r} is not a job number")
    if "SLURM_JOB_UID" not in environ:
        raise JobSpecError("SLURM_JOB_UID is not set")
    uid = _parse_uid(environ["SLURM_JOB_UID"], "SLURM_JOB_UID")
    het = environ.get("SLURM_HET_JOB_ID", "").strip()
    het_note = (f"heterogeneous job component (leader {het[:20]}): its ranks attach as job {het[:20]}"
                if het and het != job else "")
    if not need_resources:
        return JobSpec(job=job, uid=uid, note=het_note)
    gpus = parse_gpus(environ.get("SLURM_JOB_GPUS", ""))
    cpus, note = None, ""
    raw = environ.get("SLURM_JOB_CPUS_PER_NODE")
    try:
        runs = cpus_per_node_runs(raw) if raw is not None else []
    except JobSpecError as e:   # the job is registered all the same, without its CPU count
        runs, note = [], f"cpus left to the agent: {e}"
    if runs:
        node = environ.get("SLURM_NODEID", "").strip()
        mine = _node_count(runs, int(node)) if node.isascii() and node.isdigit() else None
        if mine is not None:
            cpus = mine
        elif len({n for n, _ in runs}) == 1:
            cpus = runs[0][0]
        else:
            note = (f"cpus left to the agent: per-node counts {raw[:80]!r} differ and SLURM_NODEID "
                    + (f"{node[:20]!r} is not one of their {sum(r for _, r in runs)} nodes" if node else "is not set"))
    return JobSpec(job=job, uid=uid, gpus=gpus, cpus=cpus, note="; ".join(n for n in (note, het_note) if n))


def cli_job(args: argparse.Namespace) -> JobSpec:
    """The job as the command-line flags describe it (``--job`` required)."""
    if not args.job:
        raise JobSpecError("--job is required without --slurm", heading="")
    uid = os.getuid() if args.uid is None else args.uid
    if uid < 0:
        raise JobSpecError(f"{uid} is negative", heading="bad --uid value")
    cpus = getattr(args, "cpus", None)  # release has no --gpus/--cpus
    if cpus is not None and cpus <= 0:
        raise JobSpecError(f"{cpus} must be positive", heading="bad --cpus value")
    return JobSpec(job=args.job, uid=uid, gpus=parse_gpus(getattr(args, "gpus", None) or ""), cpus=cpus)


def resolve_endpoint(flag: Optional[str], config_path: Optional[str] = None,
                     environ: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """(endpoint, note): ``--endpoint``, else ADLOADER_ENDPOINT, else the agent config's ``endpoint``
    (``--config``, default /etc/adloader/agent.toml when it exists), else the system agent's socket
    (``agent.config.client_endpoint``)."""
    from agent import config

    return config.client_endpoint(flag, config_path, environ)


# --- talking to the agent -------------------------------------------------------------------------


def build_message(verb: str, spec: JobSpec, source: str) -> dict:
    from adloader import protocol

    if verb == "register":
        return protocol.make(
            "register", job=spec.job, uid=spec.uid, gpus=list(spec.gpus), cpus=spec.cpus, pids=[], source=source
        )
    return protocol.make("release", job=spec.job, uid=spec.uid)


def request(endpoint: str, message: dict, timeout_s: float) -> Outcome:
    """Send ``message`` to the agent and wait for its ``ok``/``error`` until ``timeout_s`` has passed
    (``agent.rpc.request``). Never raises for the agent's absence, silence or refusal; the outcome says
    which it was."""
    from agent import rpc

    try:
        reply = rpc.request(endpoint, message, timeout_s)
    except rpc.AgentRefused as e:
        return Outcome(False, str(e), e.code)
    except rpc.RequestError as e:
        return Outcome(False, str(e))
    detail = reply.get("detail")
    return Outcome(True, "ok" + (f" ({detail})" if detail else ""))


# --- the command ----------------------------------------------------------------------------------


def register(sub) -> None:
    p = sub.add_parser(
        NAME,
        description="Tell the node agent that a job starts (register) or ends (release) on this node. "
        "With --slurm the job comes from the SLURM_* variables and the exit status is always 0.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="{register,release}")
    verbs.required = True
    for verb, help_ in (
        ("register", "a job starts on this node: its uid, GPUs and CPUs"),
        ("release", "a job ended on this node: the agent forgets it and restores what it changed"),
    ):
        v = verbs.add_parser(verb, help=help_)
        v.add_argument("--slurm", action="store_true",
                       help=("read SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GPUS, SLURM_JOB_CPUS_PER_NODE (and "
                             "SLURM_NODEID if set; --job overrides SLURM_JOB_ID, --uid, --gpus and --cpus are ignored)"
                             if verb == "register" else
                             "read SLURM_JOB_ID and SLURM_JOB_UID (--job overrides SLURM_JOB_ID, --uid is ignored)")
                            + "; always exit 0, log why on failure")
        v.add_argument("--job", metavar="ID", help="job id (without --slurm; required then)")
        v.add_argument("--uid", type=plain_int, metavar="N", help="owner's uid (default: the caller's)")
        if verb == "register":
            v.add_argument("--gpus", metavar="LIST", help="GPU indices or UUIDs, comma-separated (e.g. 0,1)")
            v.add_argument("--cpus", type=plain_int, metavar="N", help="CPUs allocated to the job on this node")
        v.add_argument("--endpoint", metavar="EP",
                       help="agent endpoint (default: ADLOADER_ENDPOINT, else the endpoint key of the agent's "
                            "config file, else the system socket if it exists, else your user's)")
        v.add_argument("--config", metavar="PATH",
                       help="the agent's config file, read for its endpoint key only (default "
                            "/etc/adloader/agent.toml when it exists; the Slurm scripts pass it)")
        v.add_argument("--timeout-s", type=plain_number, default=DEFAULT_TIMEOUT_S, metavar="S",   # inf, nan: refused in run()
                       help=f"give up after S seconds (default {DEFAULT_TIMEOUT_S:g})")
        v.set_defaults(func=run, verb=verb)


def run(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    verb = args.verb
    prefix = f"adloader job {verb}"
    slurm = bool(args.slurm)
    try:
        if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
            raise JobSpecError(f"{args.timeout_s:g} must be a positive, finite number of seconds",
                               heading="bad --timeout-s value")
        from adloader import protocol
        from agent import config

        if args.endpoint is not None:   # the flag wins over ADLOADER_ENDPOINT (config.client_endpoint)
            why = protocol.endpoint_problem(args.endpoint)
            if why:
                raise JobSpecError(f"{config.shown(args.endpoint)}: {why}", heading="bad --endpoint value")
        else:
            bad_endpoint = config.endpoint_argument_problem(None, environ)   # "ADLOADER_ENDPOINT 'x': why"
            if bad_endpoint:
                raise JobSpecError(bad_endpoint)
        if slurm:
            spec = slurm_job(environ, need_resources=(verb == "register"))
            # --job still wins over SLURM_JOB_ID; --uid, --gpus and --cpus are not read with --slurm
            if args.job:
                spec = JobSpec(args.job, spec.uid, spec.gpus, spec.cpus, spec.note)
        else:
            spec = cli_job(args)
        bad_job = protocol.check_job_id(spec.job)   # what the agent would refuse (malformed): not sent
        if bad_job:   # --job, else (--slurm) SLURM_JOB_ID: digits, but maybe too many
            raise (JobSpecError(bad_job, heading="bad --job value") if args.job
                   else JobSpecError(f"SLURM_JOB_ID: {bad_job}"))
    except JobSpecError as e:
        print(f"{prefix}: not sent: {e.line()}", file=sys.stderr, flush=True)
        return EXIT_OK if slurm else EXIT_USAGE
    except Exception as e:  # a bug of ours reading the variables: the prolog must not fail on it either
        print(f"{prefix}: not sent: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_OK if slurm else EXIT_FAILED

    what = f"job {spec.job} uid {spec.uid}"
    if verb == "register":
        # (a GPU id is any text to the agent: one with a newline or an escape, shown as repr writes it,
        # kept the prolog's log one line)
        gpus = ",".join(g if g.isprintable() else repr(g)[1:-1] for g in spec.gpus)
        what += f" gpus [{gpus}] cpus {spec.cpus if spec.cpus is not None else '?'}"
    ep_note = ""
    try:
        endpoint, ep_note = resolve_endpoint(args.endpoint, getattr(args, "config", None), environ)
        outcome = request(endpoint, build_message(verb, spec, "slurm" if slurm else "cli"), args.timeout_s)
    except Exception as e:  # the prolog must not fail on a bug of ours either; say what it was
        outcome = Outcome(False, f"internal error: {type(e).__name__}: {e}")
    if verb == "release" and outcome.code == "unknown_job":
        outcome = Outcome(True, "ok (the agent did not know the job: already released)")
    if not outcome.ok:
        from agent import config

        if config.endpoint_from_environment(args.endpoint, environ):
            ep_note = config.ENDPOINT_FROM_ENV_NOTE
    note = "".join(f"; {n}" for n in (spec.note, ep_note) if n)
    print(f"{prefix}: {what}: {outcome.why}{note}", file=sys.stderr, flush=True)
    if outcome.ok or slurm:
        return EXIT_OK
    return EXIT_FAILED
