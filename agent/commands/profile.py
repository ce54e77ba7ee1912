"""``adloader profile -- <training command>``: where a training job's time goes, and what-ifs, from one run.

    adloader profile [--duration S] [--json PATH] [--cores N] -- python train.py ...

Runs the command with the loader's hook (no agent needed) for at most ``--duration`` seconds (default
60), then prints, per step and per batch, what the loader measured: compute (time outside ``next()``),
data wait, and inside the workers preprocessing CPU, fetch/IO wait (blocked) and run-queue wait; then
what-if predictions from ``predictor`` (throughput with k workers or c cores, the knee). In the spirit of
DS-Analyzer, but online and from a single run.

Memory: each worker's unique (USS) and proportional (PSS) memory and how its USS grew over the run,
the batches in flight in shared memory, and, when a worker's private memory grows with the samples it
reads, the copy-on-read pattern named with its usual remedy (``memory_analysis``).

Mechanism: profile binds its own ZeroMQ ROUTER on a temporary ipc endpoint and gives the child
``ADLOADER_ENDPOINT`` and ``ADLOADER_JOB_ID``; ``adloader.client`` in the child sends hello and report
messages (``adloader.protocol``); profile answers hello with "welcome", sends heartbeats (the client
reconnects after three silent heartbeat periods), and sends no directives, so the job runs exactly as configured. The child is stopped (SIGTERM, then
SIGKILL) when the duration is up; its own exit status is returned if it finished first.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from agent.commands import path_arg, plain_float

NAME = "profile"
DEFAULT_DURATION_S = 60.0
HEARTBEAT_S = 2.0
WINDOW_MIN_S = 3.0
WINDOW_MIN_STEPS = 20


def register(sub) -> None:
    p = sub.add_parser(NAME, description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=plain_float, default=DEFAULT_DURATION_S, metavar="S",
                   help=f"stop the command after S seconds (default {DEFAULT_DURATION_S:g})")
    p.add_argument("--cores", type=plain_float, default=None, metavar="N",
                   help="CPU cores the loader may use (default: the CPUs this process may use)")
    p.add_argument("--json", default=None, metavar="PATH", type=path_arg, help="also write the profile as JSON")
    p.add_argument("--job", default=None, metavar="ID", help="job id to give the command (default profile-<pid>)")
    p.add_argument("cmd", nargs="*", help="the training command, after --")
    p.set_defaults(func=run, unrecognized_hint="the training command goes after --: "
                                               "adloader profile [options] -- python train.py ...")


# -- collecting -----------------------------------------------------------------------------------


class Collector:
    """The ROUTER side: answers hello/heartbeat, keeps every report's stats per training process."""

    def __init__(self, endpoint: str):
        import zmq

        from adloader import protocol

        self.protocol = protocol
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.sock.bind(endpoint)
        self.hellos: dict[tuple, dict] = {}
        self.idents: dict[bytes, float] = {}     # client identity -> last heard (monotonic)
        self.last_beat = time.monotonic()
        self.reports: dict[tuple, list[tuple[float, dict]]] = {}
        self.errors: list[str] = []

    def poll(self, timeout_s: float) -> None:
        import zmq

        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_S / 2:  # the client reconnects after 3 silent heartbeats
            self.last_beat = now
            for ident in list(self.idents):
                self._send(ident, self.protocol.make("heartbeat"))
        if not self.sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            ident, data = frames[0], frames[-1]
            self.idents[ident] = time.monotonic()
            try:
                msg = self.protocol.decode(data)
            except self.protocol.ProtocolError as e:
                self.errors.append(str(e))
                self._send(ident, self.protocol.error(e.code, str(e)))
                continue
            t = msg["type"]
            key = (msg.get("job"), msg.get("rank"), msg.get("pid"))
            if t == "hello":
                self.hellos[key] = msg
                self._send(ident, self.protocol.make("welcome", job=msg["job"], heartbeat_s=HEARTBEAT_S, challenge=None))
            elif t == "report":
                self.reports.setdefault(key, []).append((time.monotonic(), msg["stats"]))
            elif t == "heartbeat":
                self._send(ident, self.protocol.make("heartbeat"))
            elif t == "bye":
                self.idents.pop(ident, None)

    def _send(self, ident: bytes, msg: dict) -> None:
        import zmq

        try:
            self.sock.send_multipart([ident, self.protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.idents.pop(ident, None)  # the client went away: nothing to answer

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# -- analysis -------------------------------------------------------------------------------------


def _per_step_delta(first: dict, last: dict, key: str, steps: int) -> float | None:
    """A counter's growth per step between two reports; None when the loader does not report it."""
    if key not in first or key not in last or steps <= 0:
        return None
    from predictor.observation import counter_deltas
    return counter_deltas(first, last, (key,))[key] / steps


def analyse(reports: list[dict], cores: float) -> dict:
    """Profile document from one training process's successive ``stats()`` totals."""
    from adloader.autotune import observation_from_totals
    from predictor.bank import PredictorBank

    usable = [s for s in reports if s.get("steps", 0) > 0]
    if len(usable) < 2:
        return {"error": "fewer than two reports with finished steps: run longer (--duration) or check "
                         "that the command iterates an adloader.DataLoader"}
    first, last = usable[0], usable[-1]
    # the whole run as measured (compute time as the training loop saw it, run-queue wait included);
    # the predictor's windows below take the trainer's run-queue wait out, as the agent does
    whole = observation_from_totals(first, last, cores, strict=False, unstarved=False)
    if whole is None:
        return {"error": "no usable window between the first and the last report (no steps, or figures "
                         "beyond the observation limits of predictor.observation)"}
    bank = PredictorBank(prior="default")
    # windows of at least WINDOW_MIN_S and WINDOW_MIN_STEPS (reports come every second or so; a
    # window of a few steps is mostly noise), never across a resize
    a = usable[0]
    for b in usable[1:]:
        if b.get("resizes") != a.get("resizes") or b.get("workers") != a.get("workers"):
            a = b
            continue
        if (b.get("uptime_s", 0) - a.get("uptime_s", 0) >= WINDOW_MIN_S
                and b.get("steps", 0) - a.get("steps", 0) >= WINDOW_MIN_STEPS):
            o = observation_from_totals(a, b, cores)
            if o is not None:
                bank.observe("job", o)
            a = b
    if bank.curve("job") is None:
        bank.observe("job", whole)
    cur = bank.curve("job")
    step = whole.step_s
    w = whole.workers
    spb = whole.wall_s_per_batch
    doc = {
        "window_s": whole.duration_s, "steps": whole.steps, "batch_size": whole.batch_size,
        "workers": w, "cores": cores, "samples_per_s": whole.samples_per_s,
        "per_step": {"step_s": step, "compute_s": whole.compute_s_per_step, "data_wait_s": whole.data_wait_s_per_step,
                     "data_wait_frac": whole.data_wait_frac,
                     "trainer_runq_s": _per_step_delta(first, last, "main_runq_s", whole.steps)},
        "per_batch_in_workers": {"wall_s": spb, "cpu_s": whole.cpu_s_per_batch,
                                 "blocked_s": whole.blocked_s_per_batch, "runq_s": whole.runq_s_per_batch},
        "worker_cpu_cores": whole.cpu_s_per_batch * whole.samples_per_s / max(1, whole.batch_size),
        "prediction": {
            "ceiling_samples_per_s": cur.ceiling_samples_per_s,
            "knee_workers_at_cores": cur.knee_workers(cores),
            "max_useful_workers": cur.max_useful_workers,
            "max_useful_cores": cur.max_useful_cores,
            "confidence": cur.confidence,
            "observed_configs": cur.observed_configs,
            "overhead_s_per_step": cur.overhead_s_per_step,
            "workers": {k: cur.throughput(k, cores) for k in _worker_grid(w, cur.knee_workers(cores))},
            "cores": {c: cur.throughput(max(cur.knee_workers(c), w), c) for c in _core_grid(cores)},
        },
        "verdict": verdict(whole, cur, cores),
        "memory": memory_analysis(usable),
    }
    return doc


COPY_ON_READ_MIN_BYTES = 8 << 20      # growth per worker below this is noise (allocator, caches)
COPY_ON_READ_MIN_FRAC = 0.05          # ... or below 5% of what the worker held when first measured
COPY_ON_READ = ("copy-on-read: each worker's private memory grows with the samples it reads. The dataset "
                "is most likely held as Python objects (lists, dicts, strings) created before the workers "
                "started: reading an object writes its reference count, so every worker copies each page "
                "it reads, up to one copy of the dataset per worker (pytorch/pytorch#13246). Remedy: hold "
                "the data in numpy arrays or torch tensors (one buffer, no per-object headers), a "
                "memory-mapped file, or shared buffers (pyarrow, multiprocessing.shared_memory) instead of "
                "lists of Python objects; or fewer workers.")


def memory_analysis(reports: list[dict]) -> dict | None:
    """Workers' memory from the reports' memory keys (``adloader.memory.STATS_KEYS``); None without any.

    Growth is each worker's USS growth since its first sample; the copy-on-read verdict needs a mean
    growth of at least COPY_ON_READ_MIN_BYTES and COPY_ON_READ_MIN_FRAC of the workers' first USS."""
    measured = [r for r in reports if (r.get("memory_workers") or 0) > 0]
    if not measured:
        return None
    # the last report that measured every worker the loader had: one taken while the loader shut its
    # workers down (the script's end) or while one was being replaced measures only the ones left, and
    # one taken as they exited may count them all at no memory (an exiting process's smaps are empty;
    # a fresh-clone run saw 2 workers at 0 bytes): a live worker always holds private pages
    whole = [r for r in measured if r["memory_workers"] >= (r.get("workers") or 0)
             and (r.get("worker_uss_bytes") or 0) > 0]
    first, last = measured[0], (whole or measured)[-1]
    n = last["memory_workers"]
    uss, pss = last.get("worker_uss_bytes", 0) / n, last.get("worker_pss_bytes", 0) / n
    growth = float(last.get("worker_growth_bytes") or 0.0)
    start_uss = max(1.0, uss - growth)
    samples = max(0, (last.get("samples") or 0) - (first.get("samples") or 0))
    per = last.get("memory") or {}
    doc = {
        "workers": n, "uss_per_worker": uss, "pss_per_worker": pss, "growth_per_worker": growth,
        "growth_frac": growth / start_uss, "samples_measured": samples,
        "growth_bytes_per_sample": growth * n / samples if samples else None,
        "batch_bytes": last.get("batch_bytes", 0), "shm_inflight_bytes": last.get("shm_inflight_bytes", 0),
        "sample_cost_s": last.get("memory_sample_cost_s"),
        "per_worker": {str(k): v for k, v in per.items()} if isinstance(per, dict) else {},
        "copy_on_read": growth >= COPY_ON_READ_MIN_BYTES and growth >= COPY_ON_READ_MIN_FRAC * start_uss,
    }
    doc["verdict"] = COPY_ON_READ if doc["copy_on_read"] else (
        "no copy-on-read seen: the workers' private memory stayed flat as they read samples.")
    return doc


def render_memory(m: dict | None) -> list[str]:
    from adloader.memory import format_bytes as fb

    if not m:
        return ["memory: not measured (no worker sampled yet: run longer, or the loader has no workers)"]
    lines = [
        "memory of the loader's workers (/proc/<pid>/smaps_rollup)",
        f"  {m['workers']} workers: unique (USS) {fb(m['uss_per_worker'])} each, proportional (PSS) "
        f"{fb(m['pss_per_worker'])} each; batches in flight {fb(m['shm_inflight_bytes'])} "
        f"({fb(m['batch_bytes'])} a batch)",
        f"  growth of a worker's USS over the run: {fb(m['growth_per_worker'])} ({m['growth_frac']:.0%} of its "
        f"first measured USS)" + (f", about {fb(m['growth_bytes_per_sample'])} per sample read"
                                  if m.get("growth_bytes_per_sample") else ""),
    ]
    for pid, v in sorted(m.get("per_worker", {}).items()):
        lines.append(f"    worker pid {pid}: USS {fb(v.get('uss'))}  PSS {fb(v.get('pss'))}  "
                     f"growth {fb(v.get('growth'))}")
    lines.append("  " + m["verdict"])
    return lines


def _worker_grid(current: int, knee: int) -> list[int]:
    top = max(current, knee) + 2
    return sorted({1, 2, max(1, current - 1), current, current + 1, knee, top} | set(range(1, min(top, 8) + 1)))


def _core_grid(cores: float) -> list[float]:
    return sorted({0.5, 1.0, max(0.5, cores / 2), cores, cores * 1.5, cores * 2, float(math.ceil(cores)) + 1})


def verdict(o, cur, cores: float) -> str:
    if o.data_wait_frac < 0.05:
        return ("compute-bound: the loop waits for data {:.0%} of a step; {} workers suffice "
                "(knee {}).".format(o.data_wait_frac, o.workers, cur.knee_workers(cores)))
    blocked, runq, cpu = o.blocked_s_per_batch, o.runq_s_per_batch, o.cpu_s_per_batch
    if runq > max(blocked, 0.25 * cpu):
        why = "workers wait for a CPU (run queue): more cores help, more workers do not"
    elif blocked > cpu:
        why = "workers wait on fetch/IO (blocked): more workers help, more cores do not"
    else:
        why = "workers are busy on CPU preprocessing: more workers, each with a core, help"
    return f"data-bound: the loop waits for data {o.data_wait_frac:.0%} of a step; {why}."


def render(doc: dict) -> str:
    if "error" in doc:
        return f"adloader profile: {doc['error']}"
    ps, pb, pr = doc["per_step"], doc["per_batch_in_workers"], doc["prediction"]
    ms = lambda s: f"{s * 1e3:8.1f} ms"
    step = ps["step_s"] or 1.0
    wall = pb["wall_s"] or 1.0
    lines = [
        f"profiled {doc['steps']} steps over {doc['window_s']:.1f} s: {doc['samples_per_s']:.1f} samples/s, "
        f"batch {doc['batch_size']}, {doc['workers']} workers on {doc['cores']:g} cores",
        "",
        "where a step goes (training process)",
        f"  compute (outside next())   {ms(ps['compute_s'])}  {ps['compute_s'] / step:6.1%}",
        f"  data wait (in next())      {ms(ps['data_wait_s'])}  {ps['data_wait_s'] / step:6.1%}",
        *([f"  of compute, trainer waiting for a CPU  {ms(ps['trainer_runq_s'])}"]
          if ps.get("trainer_runq_s") else []),
        "where a batch goes (inside the loader's workers)",
        f"  preprocessing CPU          {ms(pb['cpu_s'])}  {pb['cpu_s'] / wall:6.1%}",
        f"  fetch / IO wait (blocked)  {ms(pb['blocked_s'])}  {pb['blocked_s'] / wall:6.1%}",
        f"  run-queue wait (no CPU)    {ms(pb['runq_s'])}  {pb['runq_s'] / wall:6.1%}",
        f"  workers used {doc['worker_cpu_cores']:.2f} CPU cores",
        "",
        doc["verdict"],
        "",
        f"what if (predicted; ceiling with data always ready {pr['ceiling_samples_per_s']:.1f} samples/s, "
        f"confidence {pr['confidence']:.2f})",
        "  workers  samples/s   (at {:g} cores)".format(doc["cores"]),
    ]
    for k, v in pr["workers"].items():
        mark = "  <- now" if k == doc["workers"] else ("  <- knee" if k == pr["knee_workers_at_cores"] else "")
        lines.append(f"  {k:7d}  {v:9.1f}{mark}")
    lines.append("  cores    samples/s   (workers grown to the knee)")
    for c, v in pr["cores"].items():
        lines.append(f"  {c:7.2f}  {v:9.1f}{'  <- now' if abs(c - doc['cores']) < 1e-9 else ''}")
    lines += ["",
              f"knee: {pr['knee_workers_at_cores']} workers at {doc['cores']:g} cores; with enough cores "
              f"{pr['max_useful_workers']} workers and {pr['max_useful_cores']:.2f} cores reach within a few "
              "percent of the ceiling", ""]
    lines += render_memory(doc.get("memory"))
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------


def run(args) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("adloader profile: give the training command after --, e.g. "
              "adloader profile -- python train.py", file=sys.stderr)
        return 2
    if not args.duration > 0:
        print("adloader profile: --duration must be > 0", file=sys.stderr)
        return 2
    if args.cores is not None and not (args.cores > 0 and math.isfinite(args.cores)):
        print(f"adloader profile: --cores must be a positive number of cores, got {args.cores:g}", file=sys.stderr)
        return 2
    if args.job is not None:   # (a job id the client refuses to send ran the command to say "no report")
        from adloader.protocol import check_job_id

        why = check_job_id(args.job)
        if why:
            print(f"adloader profile: --job: {why}", file=sys.stderr)
            return 2
    if args.json:   # (a --json that cannot be written was a traceback after the whole run)
        from agent.commands.bench import out_file_error

        why = out_file_error(args.json)
        if why:
            print(f"adloader profile: --json {args.json}: {why}", file=sys.stderr)
            return 2
    from adloader.autotune import usable_cpus

    cores = args.cores if args.cores else usable_cpus()
    tmp = tempfile.mkdtemp(prefix="adloader-profile-")
    endpoint = f"ipc://{tmp}/profile.sock"
    job = args.job or f"profile-{os.getpid()}"
    col = Collector(endpoint)
    env = dict(os.environ, ADLOADER_ENDPOINT=endpoint, ADLOADER_JOB_ID=job)
    env.pop("ADLOADER_DISABLE", None)
    rc: int | None = None
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as e:
        col.close()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"adloader profile: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    deadline = time.monotonic() + args.duration
    stopped = False
    try:
        while True:
            col.poll(0.2)
            rc = child.poll()
            if rc is not None:
                break
            if time.monotonic() >= deadline:
                stopped = True
                child.send_signal(signal.SIGTERM)
                try:
                    rc = child.wait(5.0)
                except subprocess.TimeoutExpired:
                    child.kill()
                    rc = child.wait()
                break
        col.poll(0.05)  # a last report sent on the way out
    except KeyboardInterrupt:
        child.kill()
        child.wait()
        raise
    finally:
        col.close()
        shutil.rmtree(tmp, ignore_errors=True)

    if not col.reports:
        print("adloader profile: no report from the command (does it iterate an adloader.DataLoader? "
              "is ADLOADER_DISABLE set inside it?)", file=sys.stderr)
        return rc if (rc and not stopped) else 1
    # the training process with the most reports (rank 0 when ranks are alike)
    key = max(col.reports, key=lambda k: (len(col.reports[k]), -(k[1] or 0)))
    doc = analyse([s for _t, s in col.reports[key]], cores)
    doc["command"] = cmd
    doc["job"], doc["rank"], doc["pid"] = key
    doc["stopped_after_s"] = args.duration if stopped else None
    print(render(doc))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=str)
        except OSError as e:   # (checked before the run; a full disk still ends here)
            print(f"adloader profile: --json {args.json}: cannot write it: {e.strerror or e}", file=sys.stderr)
            return 1
    if "error" in doc:
        return 1
    return 0 if stopped else (rc or 0)
