"""The bench harness: real job processes on this node, run side by side under each policy.

One *phase* = one scenario under one policy for one repeat: start the agent (for the policies it
runs), launch the scenario's jobs (``evaluation.jobproc``), apply its timed events (arrivals,
departures, a CPU hog), read every job's progress file while it runs, then stop everything and keep
the records. Phases are interleaved (every policy once per repeat, the order rotated per repeat) so
that the machine's noise hits every policy alike. Metrics are computed afterwards from the records
(``phase_metrics``), never from the agent's own view.

How each policy runs (the jobs are the same processes in every case), as users and operators run it:
    even-static, even, adaptive   the agent with that policy; each job asks for its user's habitual
                                  num_workers (``JobSpec.num_workers``), which the agent then directs
    oracle                        the agent with the oracle's fixed plan (``evaluation.oracle_agent``): the
                                  best static plan for each job's measured points, from co-located probes
                                  of the mix (``measure_colocated``; repeated) or, for scenarios with
                                  arrivals or ``--oracle solo``, each kind's sweep alone on the node
    plan:FILE                     the agent applying a given fixed plan per scenario (``load_plans``: e.g.
                                  ``evaluation.best_plan``'s output), each job asking for its habitual
                                  num_workers as under the agent's policies: is a model's plan real?
    none                          no agent; every job keeps its user's habitual num_workers; the OS arbitrates
    autotune                      no agent; every job num_workers="auto" (its own tuner, alone)
    static-cores                  no agent; every job (training process and workers) in its own cgroup
                                  (v1 ``cpu`` or v2) with a hard quota of node cores x its GPUs / the node's
                                  GPUs, habitual num_workers: what a batch scheduler gives (Slurm
                                  ``--cpus-per-gpu``, Kubernetes CPU limits); needs root

Every process the harness starts runs in its own session and is killed with its process group when
the phase ends (loader workers included); nothing outlives ``run_phase``.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from evaluation import metrics as M
from evaluation.catalog import Catalog, JobSpec, make_job

POLICIES_ALL = ("even-static", "even", "none", "autotune", "static-cores", "adaptive", "oracle")
AGENT_POLICIES = ("even-static", "even", "adaptive", "oracle")
PLAN_PREFIX = "plan:"   # ``plan:FILE``: the agent applying a fixed plan per scenario from FILE (``load_plans``)


def plan_file(policy: str) -> Optional[Path]:
    """The plan file of a ``plan:FILE`` policy, else None."""
    return Path(policy[len(PLAN_PREFIX):]) if policy.startswith(PLAN_PREFIX) else None


def policy_dirname(policy: str) -> str:
    """A phase directory's name for the policy: ``plan:FILE`` as ``plan-STEM`` (a path has slashes)."""
    f = plan_file(policy)
    return f"plan-{f.stem}" if f is not None else policy


def load_plans(path: Path) -> dict[str, dict]:
    """Scenario -> ``{"plan": {job: {"workers": int, "cpus": float}}, "loaders_yield": bool or None}``
    from ``path``, for a ``plan:FILE`` policy. Two forms:

    - ``python -m evaluation.best_plan --out`` JSON (``{"rows": [...]}``): per scenario, of its rows
      (one per repeat of each bench run it was searched on) the one whose best plan has the median
      aggregate (the lower median for an even count), its plan's worker counts and CPU weights (which
      sum to the loader CPUs, as a plan's cores do) and its loaders' yield;
    - ``{"plans": {scenario: {job: {"workers": w, "cpus": c}}}, "loaders_yield": bool (optional)}``:
      a plan written by hand; without ``loaders_yield`` the agent's rule decides, as for any plan.

    A job of the scenario that the plan does not name gets the even share (``oracle_agent``). Raises
    ``BenchError`` naming the problem: an unreadable file, neither form, a plan that is not per job
    ``workers`` >= 1 and ``cpus`` > 0."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"plan file {path}: cannot read it as JSON: {e}") from None
    out: dict[str, dict] = {}
    if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
        by_sc: dict[str, list] = {}
        for r in doc["rows"]:
            if isinstance(r, dict) and isinstance(r.get("best_plan"), dict) and r.get("scenario"):
                by_sc.setdefault(str(r["scenario"]), []).append(r)
        for sc, rows in by_sc.items():
            rows.sort(key=lambda r: (float(r.get("best_plan_agg") or 0.0), r.get("rep") or 0))
            r = rows[(len(rows) - 1) // 2]
            try:
                plan = {j: {"workers": int(v[0]), "cpus": float(v[1])} for j, v in r["best_plan"].items()}
            except (TypeError, ValueError, IndexError) as e:
                raise BenchError(f"plan file {path}: scenario {sc!r}: best_plan is not job -> [workers, weight]: {e}") from None
            out[sc] = {"plan": plan, "loaders_yield": r.get("loaders_yield")}
    elif isinstance(doc, dict) and isinstance(doc.get("plans"), dict):
        ly = doc.get("loaders_yield")
        if ly is not None and not isinstance(ly, bool):
            raise BenchError(f"plan file {path}: loaders_yield must be true or false, got {ly!r}")
        for sc, plan in doc["plans"].items():
            if not isinstance(plan, dict):
                raise BenchError(f"plan file {path}: plans[{sc!r}] must be job -> {{\"workers\": w, \"cpus\": c}}")
            try:
                out[sc] = {"plan": {j: {"workers": int(v["workers"]), "cpus": float(v["cpus"])} for j, v in plan.items()},
                           "loaders_yield": ly}
            except (TypeError, ValueError, KeyError) as e:
                raise BenchError(f"plan file {path}: plans[{sc!r}]: each job needs workers and cpus: {e!r}") from None
    else:
        raise BenchError(f"plan file {path}: expected evaluation.best_plan's output ({{\"rows\": [...]}}) or "
                         f"{{\"plans\": {{scenario: {{job: {{\"workers\": w, \"cpus\": c}}}}}}}}")
    for sc, p in out.items():
        bad = [j for j, a in p["plan"].items() if a["workers"] < 1 or not a["cpus"] > 0]
        if bad or not p["plan"]:
            raise BenchError(f"plan file {path}: scenario {sc!r}: every job needs workers >= 1 and cpus > 0"
                             + (f" (not {', '.join(bad)})" if bad else " (the plan names no job)"))
    return out


def split_policies(text: str) -> list[str]:
    """``--policies``: comma-separated, commas inside a variant's brackets kept (see ``parse_policy``)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [p for p in out if p]


def parse_policy(spec: str) -> tuple[str, dict[str, str]]:
    """``adaptive[loaders_yield=never,hysteresis=0.05]`` -> ("adaptive", {"loaders_yield": "never", ...}).

    A variant runs the agent policy with those agent config keys (``agent.config``) set in a config file
    of its own, so an A/B of one mechanism is one interleaved bench run. Raises ``BenchError`` for a
    variant of a policy that runs no agent (or the oracle), a malformed entry, or an unknown key."""
    base, _, rest = spec.partition("[")
    if not rest:
        return spec, {}
    if not rest.endswith("]"):
        raise BenchError(f"policy {spec!r}: a variant is name[key=value,...]")
    if base not in AGENT_POLICIES or base == "oracle":
        raise BenchError(f"policy {spec!r}: only the agent's own policies take config keys "
                         f"({', '.join(p for p in AGENT_POLICIES if p != 'oracle')})")
    from agent.config import KEYS

    overrides = {}
    for item in rest[:-1].split(","):
        k, eq, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k:
            raise BenchError(f"policy {spec!r}: {item!r} is not key=value")
        if k not in KEYS or k in ("policy", "endpoint", "state_dir"):
            raise BenchError(f"policy {spec!r}: {k!r} is not an agent config key a variant may set")
        overrides[k] = v
    import os

    from agent import config as configmod

    try:   # each value checked now, as the agent will (before: the agent refused it only after the calibration)
        configmod.load(os.devnull, overrides, environ={})
    except configmod.ConfigError as e:
        raise BenchError(f"policy {spec!r}: {e}") from None
    return base, overrides
STATIC_SCENARIOS = ("heterogeneous", "homogeneous", "light", "gpu-weighted", "trainer-cpu", "oversubscribed",
                    "nothing-to-arbitrate", "memory", "gpu-weighted-ddp", "validating",
                    "validating-loader", "validating-torch-loader")
MEMORY_SCENARIO_BUDGET = 1 << 30        # the "memory" scenario's loader memory budget unless --loader-memory
SCENARIOS_ALL = STATIC_SCENARIOS[:3] + ("dynamic", "reaction", "hog", "phase") + STATIC_SCENARIOS[3:]
STATIC_CGROUP_ROOT = "/sys/fs/cgroup"      # the v2 root, or where the v1 hierarchies are mounted


class BenchError(RuntimeError):
    """The bench cannot go on; the message says what failed and where its log is."""


@dataclass
class Launch:
    spec: JobSpec
    at_s: float = 0.0                       # offset from the phase origin; 0 = the initial set
    depart_at_s: Optional[float] = None     # SIGTERM at this offset (an external departure)


@dataclass
class Scenario:
    name: str
    launches: list[Launch]
    kind: str                               # "static" (window after warm-up), "timed" (events), "dynamic" (fixed work)
    warmup_s: float
    measure_s: float                        # static/timed: length after warm-up; dynamic: timeout
    hog_at_s: Optional[float] = None
    hog_procs: int = 1
    loader_memory: Optional[int] = None     # the agent's loader memory budget in this scenario (bytes)

    @property
    def max_concurrent(self) -> int:
        return self._peak(lambda l: 1)

    @property
    def node_gpus(self) -> int:
        """GPUs of the node: the most the scenario's jobs hold at once (a full node)."""
        return max(1, self._peak(lambda l: l.spec.gpus))

    def _peak(self, size) -> int:
        pts = []
        for l in self.launches:
            pts.append((l.at_s, size(l)))
            if l.depart_at_s is not None:
                pts.append((l.depart_at_s, -size(l)))
        n = best = 0
        for _, d in sorted(pts, key=lambda p: (p[0], p[1])):
            n += d
            best = max(best, n)
        return best

    def planned_s(self) -> float:
        return self.warmup_s + self.measure_s


@dataclass
class BenchConfig:
    catalog: Catalog
    calib: dict
    loader_cpus: float
    node_cores: int
    out_dir: Path
    cgroup_mode: str = "off"
    tick_s: float = 1.0
    device: str = "emulated"
    sweep_segment_s: float = 3.0
    oracle_source: str = "colocated"        # the oracle's curves: "colocated" probes of the mix, or "solo" sweeps
    oracle_probe_reps: int = 2              # repeats of each co-located probe plan
    python: str = sys.executable
    keep_logs: bool = True
    memory_sample_s: float = 2.0            # how often the harness reads every job's workers' memory
    loader_memory: Optional[int] = None     # the "memory" scenario's budget (None: MEMORY_SCENARIO_BUDGET)
    loader_cpus_auto: bool = False          # the agent runs with loader_cpus = "auto" (its default: it may grow
                                            # the budget into an idle reserve); loader_cpus is then what auto gives
    agent_log_level: str = "info"           # the agents' log level ("debug": every window the predictor got)
    steps_known: bool = False               # a job with a fixed amount of work (the dynamic scenario's) tells its
                                            # loader its steps (``total_steps``): what adaptive's finish guard uses
    foreign_cores: float = 0.0              # CPU load outside every job for the whole phase (``foreign_load``):
                                            # other tenants, daemons, jobs that do not report
    foreign_bursts: Optional[tuple[float, float]] = None    # (on, off) seconds: the foreign load comes and
                                            # goes (``FOREIGN_SCRIPT``); None: steady


# -- scenarios -----------------------------------------------------------------------------------

def build_scenarios(cfg: BenchConfig, names, quick: bool) -> list[Scenario]:
    """The scenarios from the catalogue's mixes; ``quick`` shortens every phase."""
    cat, cal = cfg.catalog, cfg.calib
    warm, meas = (4.0, 12.0) if quick else (6.0, 24.0)
    out = []
    for name in names:
        if name not in cat.mixes:
            raise BenchError(f"scenario {name!r} needs a mix of that name in catalogue {cat.path}")
        kinds = cat.mixes[name]
        jobs = [make_job(cat, cal, k, f"{name[:4]}-{i}-{k.split('[')[0]}", seed=100 + i, node_cores=cfg.node_cores)
                for i, k in enumerate(kinds)]
        if name == "memory":
            out.append(Scenario(name, [Launch(j) for j in jobs], "static", warm, meas,
                                loader_memory=cfg.loader_memory or MEMORY_SCENARIO_BUDGET))
        elif name in STATIC_SCENARIOS:
            out.append(Scenario(name, [Launch(j) for j in jobs], "static", warm, meas))
        elif name == "reaction":
            # two jobs run; the third arrives; the first departs
            t_arr, t_dep = (warm + 4.0, warm + 10.0) if quick else (warm + 8.0, warm + 18.0)
            ls = [Launch(jobs[0], depart_at_s=t_dep), Launch(jobs[1]), Launch(jobs[2], at_s=t_arr)]
            out.append(Scenario(name, ls, "timed", warm, (t_dep - warm) + (6.0 if quick else 10.0)))
        elif name == "hog":
            t_hog = warm + (5.0 if quick else 10.0)
            out.append(Scenario(name, [Launch(j) for j in jobs], "timed", warm, (t_hog - warm) * 2 + 2.0,
                                hog_at_s=t_hog, hog_procs=max(1, cfg.node_cores // 2)))
        elif name == "dynamic":
            arr = cat.dynamic_arrivals_s or [0.0] * len(kinds)
            work = cat.dynamic_work_s or [20.0] * len(kinds)
            scale = 0.5 if quick else 1.0
            ls = []
            for i, (j, k) in enumerate(zip(jobs, kinds)):
                a = arr[i % len(arr)] * scale
                samples = int(work[i % len(work)] * scale * j.ceiling_samples_per_s)
                spec = make_job(cat, cal, k, j.job_id, seed=100 + i, samples=samples, arrival_s=a,
                                node_cores=cfg.node_cores)
                ls.append(Launch(spec, at_s=a))
            # generous: on a loaded machine (or with trainers starved under some policy) a job may take
            # several times its work at the ceiling; an unfinished phase has no makespan at all
            timeout = (max(arr) * scale + sum(work) * scale) * 5 + 60
            out.append(Scenario(name, ls, "dynamic", 0.0, timeout))
        else:
            out.append(Scenario(name, [Launch(j) for j in jobs], "static", warm, meas))
    return out


def apply_mix_windows(scs: list[Scenario], catalog) -> list[str]:
    """Lengthen each static phase to its mix's ``[windows]`` minimum (the catalogue's: the warm-up and
    window that mix needs to measure a steady state, e.g. habitual 8-16 workers per job on a few cores
    start slowly and then deliver in waves several seconds apart); returns a note per phase lengthened."""
    notes = []
    for sc in scs:
        w = catalog.windows.get(sc.name)
        if not w or sc.kind != "static":
            continue
        warm, meas = max(sc.warmup_s, w.get("warmup_s", 0.0)), max(sc.measure_s, w.get("measure_s", 0.0))
        if (warm, meas) != (sc.warmup_s, sc.measure_s):
            notes.append(f"{sc.name}: warm-up {warm:g} s, window {meas:g} s (the catalogue's [windows] minimum "
                         f"for this mix; asked {sc.warmup_s:g} s and {sc.measure_s:g} s)")
            sc.warmup_s, sc.measure_s = warm, meas
    return notes


# -- processes -----------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def _term_when_bench_dies(bench_pid: int) -> None:
    """In a child, before exec: SIGTERM when the bench dies (Linux PR_SET_PDEATHSIG). A child runs in its own
    session, so a bench killed before its cleanup (SIGKILL, or a timeout that ends the shell around it) would
    otherwise leave an agent or a job running, holding cores and cgroups, into whatever runs next."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # not Linux: stop() and the finally blocks are all there is
        return
    if os.getppid() != bench_pid:     # the bench died between fork and prctl
        os.kill(os.getpid(), signal.SIGTERM)


class Proc:
    """A child process in its own session; ``stop`` ends it and every process in its group. The child gets
    SIGTERM if the bench process dies first (spawn from the main thread only: the signal follows the thread)."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, cwd: Optional[Path] = None):
        """``cwd``: the child's working directory (default this process's). ``python -m`` puts it first on
        the module path, before PYTHONPATH: a child meant to run another checkout's code must start there."""
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")     # this start's output only (a run directory may be reused)
        bench_pid = os.getpid()
        self.p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=lambda: _term_when_bench_dies(bench_pid))
        self.pid = self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig=signal.SIGTERM) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 5.0) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)   # the group: loader workers, anything left
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


class ProgressReader:
    """Reads a job's JSON-lines progress file incrementally (partial last lines are kept for later)."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = 0
        self.partial = ""
        self.records: list[dict] = []
        self.start: Optional[dict] = None
        self.done: Optional[dict] = None
        self.segments: list[dict] = []
        self.phases: list[dict] = []         # the job's pipeline changed here (a spec's ``phases``)
        self.pauses: list[dict] = []         # its loop stopped here for ``pause_s`` (a spec's ``pause_s``)

    def poll(self) -> None:
        try:
            with open(self.path, "r") as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return
        if not chunk:
            return
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ev = rec.get("event")
            if ev == "start":
                self.start = rec
            elif ev == "done":
                self.done = rec
            elif ev == "segment":
                self.segments.append(rec)
            elif ev == "phase":
                self.phases.append(rec)
            elif ev == "pause":
                self.pauses.append(rec)
            elif ev is None:
                self.records.append(rec)


def child_env(**extra: str) -> dict:
    """Environment for children: this checkout's packages importable, inherited ADLOADER_* removed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADLOADER_")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def _socket_path(endpoint: str) -> str:
    return endpoint[len("ipc://"):]


def start_agent(cfg: BenchConfig, policy: str, run_dir: Path, sock_dir: str, max_jobs: int,
                curves_path: Optional[Path] = None, loader_memory: Optional[int] = None) -> tuple[Proc, str]:
    endpoint = f"ipc://{sock_dir}/agent.sock"
    policy, overrides = parse_policy(policy)
    config = []
    if overrides:       # a variant: its keys in a config file of its own (file < command line: no clash below)
        path = Path(sock_dir) / "variant.toml"
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in overrides.items()))
        config = ["--config", str(path)]
    flags = [*config, "--endpoint", endpoint, "--state-dir", str(Path(sock_dir) / "state"), "--tick-s", f"{cfg.tick_s:g}",
             "--loader-cpus", "auto" if cfg.loader_cpus_auto else f"{cfg.loader_cpus:g}", "--max-jobs", str(max_jobs),
             "--cgroup-mode", cfg.cgroup_mode, "--log-level", cfg.agent_log_level,
             "--loader-memory", str(loader_memory) if loader_memory else "off"]
    if policy == "oracle" or plan_file(policy) is not None:
        argv = [cfg.python, "-m", "evaluation.oracle_agent", str(curves_path), *flags]
    else:
        argv = [cfg.python, "-m", "agent", "agent", "--policy", policy, *flags]
    proc = Proc(argv, child_env(), run_dir / "agent.log")
    deadline = time.monotonic() + 30.0
    while not os.path.exists(_socket_path(endpoint)):
        if not proc.alive():
            tail = proc.log_tail()
            proc.stop()
            raise BenchError(f"the agent exited before binding {endpoint} (policy {policy}); "
                             f"log {proc.log_path}:\n{tail}")
        if time.monotonic() > deadline:
            proc.stop()
            raise BenchError(f"the agent did not bind {endpoint} within 30 s; log {proc.log_path}")
        time.sleep(0.05)
    return proc, endpoint


STATUS_KEYS = ("ranks", "weight", "trainer_cpu_cores", "trainer_cores_needed", "workers", "cpus", "cpu_weight",
               "delivery", "extra_workers", "desired_workers", "desired_cpus", "max_useful_workers", "max_useful_cores",
               "curve_confidence", "worker_cpu_cores", "data_wait_frac", "reason", "unsatisfied", "apply_ok",
               "apply_error", "gpu_idle_frac", "gpu_idle_source", "steps_left")


def query_status(cfg: BenchConfig, endpoint: str, run_dir: Path) -> Optional[dict]:
    """The agent's own view at the end of the window (`adloader status --json`): per job, what it applied
    and why. Kept for the reading of results; metrics never come from it."""
    try:
        p = subprocess.run([cfg.python, "-m", "agent", "status", "--endpoint", endpoint, "--json"],
                           env=child_env(), capture_output=True, text=True, timeout=15)
        doc = json.loads(p.stdout)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None
    (run_dir / "agent-status.json").write_text(json.dumps(doc, indent=1))
    ag = doc.get("agent") or {}
    return {"predicted_total": doc.get("predicted_total"), "gpu_source": ag.get("gpu_source"),
            "nvml_error": ag.get("nvml_error"), "cgroup_mode": ag.get("cgroup_mode"),
            "actuators": ag.get("actuators"),
            "jobs": {j.get("job"): {k: j.get(k) for k in STATUS_KEYS} for j in doc.get("jobs", [])}}


def start_job(cfg: BenchConfig, spec: JobSpec, run_dir: Path, workers, endpoint: Optional[str],
              extra_args: tuple = ()) -> tuple[Proc, ProgressReader]:
    prog = run_dir / f"{spec.job_id}.jsonl"
    # a run directory used before (a second `adloader demo` into the same --out) holds the last run's
    # progress: the job appends, and the reader would take the old records for this start's
    prog.unlink(missing_ok=True)
    # the job's GPUs as its ranks see them (the client reports them in its hello; emulated here)
    env = child_env(ADLOADER_JOB_ID=spec.job_id, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(spec.gpus)))
    if endpoint:
        env["ADLOADER_ENDPOINT"] = endpoint
    else:
        env["ADLOADER_DISABLE"] = "1"
    if cfg.steps_known and spec.samples:
        extra_args = (*extra_args, "--total-steps", str(math.ceil(spec.samples / spec.batch_size)))
    argv = [cfg.python, "-m", "evaluation.jobproc", "--spec", spec.to_json(), "--progress", str(prog),
            "--workers", str(workers), "--device", cfg.device, *extra_args]
    return Proc(argv, env, run_dir / f"{spec.job_id}.log"), ProgressReader(prog)


# -- static cores (what a batch scheduler gives) --------------------------------------------------

class StaticCores:
    """Each job in its own cgroup with a hard quota: ``node_cores * gpus / node_gpus`` cores for the
    training process and its loader workers together (Slurm ``--cpus-per-gpu`` with a CPU limit,
    Kubernetes ``limits.cpu``). cgroup v1: ``cpu.cfs_quota_us`` in ``adl-bench-<pid>/<job>`` of the ``cpu``
    hierarchy, found at its mount point under ``cgroup_root`` (``agent.cgroupfs.v1_hierarchy``: a joined
    ``cpu,cpuacct`` too); cgroup v2 (``cgroup_root`` has ``cgroup.controllers`` with ``cpu`` and no v1
    ``cpu`` hierarchy is mounted): ``cpu.max`` in ``<cgroup_root>/adl-bench-<pid>/<job>``,
    ``+cpu`` enabled in the root's and the base's ``cgroup.subtree_control`` (the root is exempt from the
    no-internal-processes rule; the base holds no process). ``close`` moves processes back to the root
    group and removes the groups (a ``+cpu`` it enabled at the root stays: other groups may rely on it).
    Writes go through ``agent.cgroupfs`` (the one module that writes cgroups), as the agent's do."""

    PERIOD_US = 100_000

    def __init__(self, node_cores: int, node_gpus: int, cgroup_root: str = STATIC_CGROUP_ROOT,
                 proc_root: str = "/proc"):
        from agent import cgroupfs

        self.per_gpu = node_cores / max(1, node_gpus)
        v1 = cgroupfs.v1_hierarchy(cgroup_root, "cpu", proc_root)
        self.version = 1 if v1.has_file("", "cpu.cfs_quota_us") else 2
        if self.version == 2 and "cpu" not in cgroupfs.V2Hierarchy(cgroup_root).controllers():
            self.version = 0
        if os.geteuid() != 0 or self.version == 0:
            raise BenchError("static-cores needs root and a cgroup v1 cpu hierarchy at "
                             f"{v1.root} or cgroup v2 with the cpu controller at {cgroup_root} (hard per-job "
                             "quotas); run it as root or leave it out of --policies")
        self.h = v1 if self.version == 1 else cgroupfs.V2Hierarchy(cgroup_root)
        self.rel = f"adl-bench-{os.getpid()}"
        self.base = Path(self.h.path(self.rel))
        if self.version == 2 and "cpu" not in self.h.subtree_control():
            self.h.write("", "cgroup.subtree_control", "+cpu")
        self.h.mkdir(self.rel)
        if self.version == 2:
            self.h.write(self.rel, "cgroup.subtree_control", "+cpu")
        self.groups: list[str] = []

    def cores_for(self, spec: JobSpec) -> float:
        return self.per_gpu * spec.gpus

    def place(self, spec: JobSpec, pid: int) -> float:
        g = f"{self.rel}/{spec.job_id}"
        self.h.mkdir(g)
        cores = self.cores_for(spec)
        quota = max(1000, int(cores * self.PERIOD_US))
        if self.version == 2:
            self.h.write(g, "cpu.max", f"{quota} {self.PERIOD_US}")
        else:
            self.h.write(g, "cpu.cfs_period_us", self.PERIOD_US)
            self.h.write(g, "cpu.cfs_quota_us", quota)
        # before it forks its workers, or starts its other ranks (a job of rank processes: after its imports,
        # seconds from now): they and theirs inherit the group
        self.h.move(g, pid)
        self.groups.append(g)
        return cores

    def throttling(self) -> dict[str, dict]:
        """Each job group's CFS bandwidth counters now (``cpu.stat``): periods, periods throttled and
        seconds throttled, cumulative. A group that cannot be read is left out."""
        from agent.cgroupfs import CgroupError

        out = {}
        for g in self.groups:
            try:
                stat = dict(line.split() for line in self.h.read(g, "cpu.stat").splitlines() if line.strip())
                throttled_s = (int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat
                               else int(stat["throttled_time"]) / 1e9)
                out[g.rsplit("/", 1)[-1]] = {"periods": int(stat["nr_periods"]), "throttled": int(stat["nr_throttled"]),
                                             "throttled_s": throttled_s}
            except (CgroupError, KeyError, ValueError):
                continue
        return out

    def close(self) -> None:
        from agent.cgroupfs import CgroupError

        for g in self.groups + [self.rel]:
            try:
                for pid in self.h.procs(g):
                    try:
                        self.h.move("", pid)
                    except CgroupError:
                        pass
                self.h.rmdir(g)
            except CgroupError:
                pass


# -- oracle sweeps -------------------------------------------------------------------------------

def sweep_points(reader: ProgressReader, ceiling: float, settle_s: float = 1.0) -> list[tuple[int, float, float]]:
    """(workers, cores used, normalised throughput) per sweep segment, skipping each segment's start."""
    segs = reader.segments
    end = reader.done["t"] if reader.done else (reader.records[-1]["t"] if reader.records else 0.0)
    pts = []
    for i, s in enumerate(segs):
        t1 = segs[i + 1]["t"] if i + 1 < len(segs) else end
        t0 = min(s["t"] + settle_s, (s["t"] + t1) / 2)
        if t1 - t0 <= 0.2:
            continue
        sps = M.rate_between(reader.records, "samples", t0, t1)
        cores = M.rate_between(reader.records, "cpu_s", t0, t1)
        pts.append((int(s["workers"]), round(cores, 4), round(min(1.0, M.normalised(sps, ceiling)), 4)))
    return pts


def measure_sweeps(cfg: BenchConfig, specs: list[JobSpec], run_dir: Path, progress=None,
                   memory_out: Optional[dict] = None) -> dict[str, list]:
    """Each distinct kind alone on the node at worker counts 1..ceil(loader_cpus)+1 -> points per job.

    ``memory_out``: filled with job -> one worker's memory (bytes): the most unique memory (USS) one
    loader worker held in any sample of the kind's sweep (every ``cfg.memory_sample_s``), so the
    budget oracle plans with what the harness itself will measure."""
    top = min(6, math.ceil(cfg.loader_cpus) + 1)
    workers = ",".join(str(w) for w in range(1, top + 1))
    by_kind: dict[str, list] = {}
    mem_kind: dict[str, float] = {}
    run_dir.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        if spec.kind in by_kind:
            continue
        if progress:
            progress.note(f"oracle sweep: {spec.kind} alone at {workers} workers")
        proc, reader = start_job(cfg, spec, run_dir, workers=1, endpoint=None,
                                 extra_args=("--sweep", workers, "--segment-s", f"{cfg.sweep_segment_s:g}"))
        deadline = time.monotonic() + 60 + top * cfg.sweep_segment_s * 3
        per_worker = 0.0
        next_mem = 0.0
        try:
            while proc.alive() and time.monotonic() < deadline:
                if memory_out is not None and time.monotonic() >= next_mem:
                    # the largest single worker, not the mean: a sample taken as the sweep adds a
                    # worker counts one still starting (its memory not yet touched), and the mean of
                    # the two read 129 MiB for 208-MiB workers (the budget oracle then planned two of
                    # them under a 350-MiB budget: the memory test's flake)
                    _, _, largest = worker_memory(proc.pid)
                    per_worker = max(per_worker, float(largest))
                    next_mem = time.monotonic() + cfg.memory_sample_s
                time.sleep(0.2)
            reader.poll()
        finally:
            proc.stop()
        if not reader.start:
            raise BenchError(f"oracle sweep of {spec.kind} produced no progress; log {proc.log_path}:\n"
                             f"{proc.log_tail()}")
        ceiling = spec.batch_size / float(reader.start["step_s"])
        by_kind[spec.kind] = sweep_points(reader, ceiling)
        mem_kind[spec.kind] = per_worker
    if memory_out is not None:
        memory_out.update({s.job_id: mem_kind[s.kind] for s in specs})
    return {s.job_id: by_kind[s.kind] for s in specs}


PROBE_NOTE = ("co-located probes: the whole mix under fixed plans (the even split, then each job given "
              "(N+1)/2N of the loader cores), each repeated; per job the median cores its workers used and "
              "its normalised throughput per plan; budget_cores: the median cores the loaders got in all")


def probe_plans(specs: list[JobSpec], budget: float) -> list[dict]:
    """The fixed plans the co-located oracle measures: the even split of ``budget``, and for each job one
    plan that gives it (N+1)/2N of the budget and the others the rest evenly (N = 3: 2/3 and 1/6 each),
    so each job is seen at three core levels beside its real neighbours. Workers: one more than the
    cores (the share, not the count, bounds its CPU), at least 2."""
    ids = [s.job_id for s in specs]
    n = len(ids)
    shares = [{j: budget / n for j in ids}]
    if n > 1:
        hi = budget * (n + 1) / (2 * n)
        lo = (budget - hi) / (n - 1)
        shares += [{k: hi if k == j else lo for k in ids} for j in ids]
    return [{j: {"cpus": round(c, 3), "workers": max(2, math.ceil(c) + 1)} for j, c in p.items()} for p in shares]


def colocated_applies(sc: Scenario) -> bool:
    """Co-located probes need the whole mix present for the whole phase (no arrivals, departures, hog),
    and no loader memory budget: the budget oracle chooses worker counts, so it needs each job's points
    at every count (1 included), which the solo sweeps measure and the probes do not."""
    return sc.kind == "static" and sc.hog_at_s is None and sc.loader_memory is None and \
        all(l.at_s <= 0 and l.depart_at_s is None for l in sc.launches)


def measure_colocated(cfg: BenchConfig, sc: Scenario, run_dir: Path, progress=None,
                      memory_out: Optional[dict] = None) -> tuple[dict[str, list], float]:
    """The oracle's curves from the mix itself: every ``probe_plans`` plan run as a phase of its own
    (the real agent applying it), ``cfg.oracle_probe_reps`` times (order rotated per repeat); per job
    and plan one point ``(workers, median cores used, median normalised)``. Returns (points per job, the
    median total cores the loaders used: the budget the plans really had beside the trainers).
    ``memory_out``: job -> one worker's memory, the largest worker seen in any sample (a sample taken
    while a worker starts would halve a mean over the planned workers)."""
    plans = probe_plans([l.spec for l in sc.launches], cfg.loader_cpus)
    seen: dict[str, dict[int, list]] = {l.spec.job_id: {} for l in sc.launches}
    used: list[float] = []
    mem: dict[str, float] = {}
    run_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(max(1, cfg.oracle_probe_reps)):
        for k in policy_order(list(range(len(plans))), rep):
            plan = plans[k]
            if progress:
                progress.note(f"oracle probe {k + 1}/{len(plans)} rep {rep + 1}: " +
                              ", ".join(f"{j} {p['cpus']:g}c/{p['workers']}w" for j, p in plan.items()))
            path = run_dir / f"probe{k}.json"
            path.write_text(json.dumps({"plan": plan}))
            ph = run_phase(cfg, sc, "oracle", rep, run_dir / f"probe{k}-rep{rep + 1}", path)
            m = phase_metrics(ph)
            if not m.get("jobs"):
                raise BenchError(f"oracle probe {k} of {sc.name} measured nothing: {m.get('error')}; "
                                 f"logs in {run_dir}")
            for j, v in m["jobs"].items():
                seen[j].setdefault(k, []).append((v["worker_cpu_cores"], v["normalised"]))
            used.append(sum(v["worker_cpu_cores"] for v in m["jobs"].values()))
            for smp in ph.get("memory") or []:
                for j, b in (smp.get("largest") or {}).items():
                    if j in plan and b:
                        mem[j] = max(mem.get(j, 0.0), float(b))
    points = {j: [(plans[k][j]["workers"], round(M.median([c for c, _ in xs]), 4),
                   round(min(1.0, M.median([v for _, v in xs])), 4)) for k, xs in sorted(per.items())]
              for j, per in seen.items()}
    if memory_out is not None:
        memory_out.update(mem)
    return points, M.median(used)


# -- one phase -----------------------------------------------------------------------------------

def run_phase(cfg: BenchConfig, sc: Scenario, policy: str, rep: int, run_dir: Path,
              curves_path: Optional[Path] = None, tick: Optional[Callable[[float, float], None]] = None) -> dict:
    """Run one scenario under one policy; returns the raw phase record (see ``phase_metrics``)."""
    import psutil

    run_dir.mkdir(parents=True, exist_ok=True)
    sock_dir = tempfile.mkdtemp(prefix="adl-bench-")
    agent: Optional[Proc] = None
    endpoint = None
    jobs: dict[str, dict] = {}
    procs: dict[str, Proc] = {}
    readers: dict[str, ProgressReader] = {}
    hogs: list[Proc] = []
    foreign: list[Proc] = []            # --foreign-cores: load outside the jobs for the whole phase
    events: list[dict] = []
    agent_cpu = {}
    throttle: Optional[dict] = None     # static-cores: the job groups' cpu.stat at the window's ends
    node_cpu: Optional[dict] = None     # the node's busy CPU seconds at the window's ends (node_busy_s)
    agent_status = None
    error = None
    memory: list[dict] = []                 # {"t", "total" (bytes), "jobs": {job: bytes}}: workers' USS
    next_mem = 0.0
    static: Optional[StaticCores] = None
    t_phase0 = time.monotonic()
    try:
        if parse_policy(policy)[0] in AGENT_POLICIES or plan_file(policy) is not None:
            agent, endpoint = start_agent(cfg, policy, run_dir, sock_dir, sc.max_concurrent, curves_path,
                                          sc.loader_memory)
        if policy == "static-cores":
            static = StaticCores(cfg.node_cores, sc.node_gpus)
        bursts = [repr(x) for x in (*cfg.foreign_bursts, time.monotonic())] if cfg.foreign_bursts else []
        for i, duty in enumerate(foreign_load(cfg.foreign_cores)):     # there before the jobs, to the end
            foreign.append(Proc([cfg.python, "-c", FOREIGN_SCRIPT, repr(duty), repr(FOREIGN_PERIOD_S), *bursts],
                                child_env(), run_dir / f"foreign{i}.log"))
        pending = sorted(sc.launches, key=lambda l: l.at_s)

        def launch(l: Launch) -> None:
            # every policy but autotune starts the job at its user's habitual num_workers
            workers = "auto" if policy == "autotune" else l.spec.num_workers
            proc, reader = start_job(cfg, l.spec, run_dir, workers, endpoint)
            procs[l.spec.job_id], readers[l.spec.job_id] = proc, reader
            jobs[l.spec.job_id] = {"spec": asdict(l.spec), "launch_t": time.monotonic(), "at_s": l.at_s}
            if static is not None:
                jobs[l.spec.job_id]["static_cores"] = static.place(l.spec, proc.pid)

        for l in [l for l in pending if l.at_s <= 0]:
            launch(l)
        pending = [l for l in pending if l.at_s > 0]
        departures = sorted([l for l in sc.launches if l.depart_at_s is not None], key=lambda l: l.depart_at_s)
        origin = None
        deadline_start = time.monotonic() + 90.0
        window0 = None
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            for r in readers.values():
                r.poll()
            for jid, p in procs.items():
                if not p.alive() and readers[jid].done is None:
                    readers[jid].poll()
                    if readers[jid].done is None and jid not in [d.spec.job_id for d in departures
                                                                  if origin and now >= origin + d.depart_at_s]:
                        raise BenchError(f"job {jid} exited without finishing (rc {p.p.returncode}); "
                                         f"log {p.log_path}:\n{p.log_tail()}")
            if origin is None:
                if all(readers[j].records for j in readers):
                    origin = max(readers[j].records[0]["t"] for j in readers)
                    window0 = origin + sc.warmup_s
                elif now > deadline_start:
                    slow = [j for j in readers if not readers[j].records]
                    raise BenchError(f"jobs did not start within 90 s: {', '.join(slow)}; "
                                     f"log {procs[slow[0]].log_path}:\n{procs[slow[0]].log_tail()}")
                else:
                    continue
            rel = now - origin
            while pending and rel >= pending[0].at_s:
                l = pending.pop(0)
                launch(l)
                events.append({"t": time.monotonic(), "label": f"{l.spec.job_id} arrives", "kind": "arrival",
                               "job": l.spec.job_id})
            while departures and rel >= departures[0].depart_at_s:
                l = departures.pop(0)
                procs[l.spec.job_id].signal(signal.SIGTERM)
                events.append({"t": time.monotonic(), "label": f"{l.spec.job_id} departs", "kind": "departure",
                               "job": l.spec.job_id})
            if sc.hog_at_s is not None and not hogs and rel >= sc.hog_at_s:
                for i in range(sc.hog_procs):
                    hogs.append(Proc([cfg.python, "-c", "while True: pass"], child_env(), run_dir / f"hog{i}.log"))
                events.append({"t": time.monotonic(), "label": f"CPU hog x{sc.hog_procs} starts", "kind": "hog"})
            if agent is not None and not agent_cpu and now >= window0:
                try:
                    t = psutil.Process(agent.pid).cpu_times()
                    agent_cpu = {"t0": now, "cpu0": t.user + t.system}
                except psutil.Error:
                    agent_cpu = {"t0": now, "cpu0": math.nan}
            if node_cpu is None and window0 is not None and now >= window0:
                node_cpu = {"t0": now, "busy0": node_busy_s()}
            if static is not None and throttle is None and window0 is not None and now >= window0:
                throttle = {"t0": now, "at0": static.throttling()}
            if agent is not None and not agent.alive():
                raise BenchError(f"the agent died during the phase; log {agent.log_path}:\n{agent.log_tail()}")
            if now >= next_mem:
                next_mem = now + cfg.memory_sample_s
                memory.append(loader_memory_sample(procs, now))
            if tick:
                tick(rel, sc.planned_s())
            if sc.kind == "dynamic":
                if not pending and all(readers[j].done for j in readers):
                    break
                if rel > sc.measure_s:
                    error = f"timeout after {sc.measure_s:.0f}s: unfinished " + \
                        ", ".join(j for j in readers if not readers[j].done)
                    break
            elif rel >= sc.warmup_s + sc.measure_s:
                break
        end_t = time.monotonic()
        if throttle is not None:
            throttle.update(t1=end_t, at1=static.throttling())
        if node_cpu is not None:
            node_cpu.update(t1=end_t, busy1=node_busy_s())
        if agent is not None and agent_cpu:   # before the status query below, which the agent works for
            try:
                t = psutil.Process(agent.pid).cpu_times()
                agent_cpu.update(t1=end_t, cpu1=t.user + t.system)
            except psutil.Error:
                pass
        if agent is not None:
            agent_status = query_status(cfg, endpoint, run_dir)
    finally:
        for p in hogs + foreign:
            p.stop(grace_s=0.5)
        for p in procs.values():
            p.signal(signal.SIGTERM)
        for p in procs.values():
            p.stop()
        if agent is not None:
            agent.stop()
        if static is not None:
            static.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    for jid, r in readers.items():
        r.poll()
        jobs[jid].update(records=r.records, start=r.start, done=r.done, phases=r.phases, pauses=r.pauses)
        for p in r.phases:
            events.append({"t": p["t"], "label": f"{jid}'s pipeline changes (phase {p['index']})", "kind": "phase",
                           "job": jid})
        for p in r.pauses:
            events.append({"t": p["t"], "label": f"{jid}'s loop stops {p['pause_s']:g} s (a validation pass)",
                           "kind": "pause", "job": jid})
    # An arrival counts from when the job's process is up and about to iterate (its "start" record; the
    # agent hears its hello at the first batch), not from the launch: interpreter and dataset start-up
    # (seconds here) is the same under every policy and is no reaction time.
    for e in events:
        st = readers[e["job"]].start if e.get("kind") == "arrival" and e.get("job") in readers else None
        if st:
            e["launch_t"], e["t"] = e["t"], st["t"]
    if sc.kind == "dynamic":   # a job finishing its work is a departure the policy reacts to
        for jid, r in readers.items():
            if r.done and r.done.get("reason") == "work":
                events.append({"t": r.done["t"], "label": f"{jid} finishes", "kind": "finish", "job": jid})
    events.sort(key=lambda e: e["t"])
    return {"scenario": sc.name, "kind": sc.kind, "policy": policy, "rep": rep, "origin": origin,
            "window": [window0 if sc.kind != "dynamic" else None, end_t], "phase_start": t_phase0,
            "events": events, "jobs": jobs, "agent_cpu": agent_cpu, "agent_status": agent_status, "error": error,
            "warmup_s": sc.warmup_s, "run_dir": str(run_dir), "memory": memory,
            "loader_memory_budget": sc.loader_memory, "static_throttle": throttle, "node_cpu": node_cpu}


FOREIGN_PERIOD_S = 0.05      # foreign_load: each process's busy/sleep cycle


def foreign_load(cores: float) -> list[float]:
    """How ``adloader bench --foreign-cores CORES`` loads the node from outside the jobs: ceil(CORES)
    processes, each busy the same part of every ``FOREIGN_PERIOD_S`` (a duty cycle: CORES / processes),
    so that 0.5 is one process busy half the time and 1.5 two busy three quarters. Busy in short bursts
    with sleeps between, as daemons, a neighbour's preprocessing or a test suite are, not one spinning
    thread: such a process wakes, competes for a CPU where one is contended, and sleeps. It keeps its
    rate, not each period's shape: one starved for a while runs the periods it missed back to back
    (busy CORES / processes of the wall clock since it started). With ``--foreign-bursts ON_S,OFF_S``
    (``BenchConfig.foreign_bursts``) all of them are on for ON_S and asleep for OFF_S in turn, from the
    phase's start (a neighbour's bursts of work), catching up only within each on-time: CORES x ON_S /
    (ON_S + OFF_S) on average. The duties."""
    if not cores > 0:
        return []
    n = math.ceil(cores - 1e-9)
    return [cores / n] * n


# argv: duty, period[, on_s, off_s, origin]: with the last three the load is on for on_s and off for off_s
# in turn from ``origin`` (a CLOCK_MONOTONIC time, one clock for every process of the node), asleep while off;
# the periods missed while starved are caught up within the same on-time only (``foreign_load``)
FOREIGN_SCRIPT = """import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
on, off, origin = (float(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (0.0, 0.0, 0.0)
nxt = time.monotonic()
while True:
    if off > 0:
        k, into = divmod(time.monotonic() - origin, on + off)
        if into >= on:
            time.sleep(on + off - into)
            nxt = origin + (k + 1) * (on + off)
            continue
    busy_until = time.monotonic() + duty * period
    while time.monotonic() < busy_until:
        pass
    nxt += period
    time.sleep(max(0.0, nxt - time.monotonic()))
"""


def node_busy_s() -> float:
    """CPU seconds the whole node has been busy or had stolen by the hypervisor, all CPUs together
    (``/proc/stat``: user, nice, system, irq, softirq, steal; guest time is inside user)."""
    import psutil

    t = psutil.cpu_times()
    return sum(float(getattr(t, k, 0.0)) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _rank_processes(job) -> set[int]:
    """The other ranks' training processes of a job of rank processes: ``job``'s (rank 0's) children
    started as ``evaluation.jobproc --spawned-rank``. (Their own forked workers carry the same command
    line, but are their children, not rank 0's; rank 0's forked workers carry rank 0's, without the flag.)"""
    import psutil

    out = set()
    for k in job.children():
        try:
            if "--spawned-rank" in k.cmdline():
                out.add(k.pid)
        except psutil.Error:
            pass
    return out


def worker_memory(pid: int) -> tuple[int, int, int]:
    """(loader workers measured, their unique memory (USS, ``/proc/<pid>/smaps_rollup``) in bytes, the
    largest one worker's) of one job process: its descendants (the training process itself is not loader
    memory), but for a job of rank processes its other ranks' training processes (``_rank_processes``):
    their workers count, they do not."""
    import psutil

    from adloader.memory import process_memory

    try:
        job = psutil.Process(pid)
        ranks = _rank_processes(job)
        kids = [k for k in job.children(recursive=True) if k.pid not in ranks]
    except psutil.Error:
        kids = []
    n = total = largest = 0
    for k in kids:
        m = process_memory(k.pid)
        if m is not None:
            n += 1
            total += m.uss
            largest = max(largest, m.uss)
    return n, total, largest


def loader_memory_sample(procs: dict, now: float) -> dict:
    """Every job's loader workers' unique memory (``worker_memory``), now: their total per job
    ("jobs") and its largest worker's ("largest")."""
    got = {jid: worker_memory(p.pid) for jid, p in procs.items()}
    per = {jid: m[1] for jid, m in got.items()}
    return {"t": now, "total": sum(per.values()), "jobs": per, "largest": {jid: m[2] for jid, m in got.items()}}


# -- metrics of a phase --------------------------------------------------------------------------

def _ceiling(job: dict) -> float:
    spec = job["spec"]
    step = (job.get("start") or {}).get("step_s") or spec["step_s"]
    return spec["batch_size"] / step


def phase_metrics(ph: dict, bin_s: float = 1.0) -> dict:
    """Metrics of one phase from its records (definitions in ``evaluation.metrics``)."""
    jobs = ph["jobs"]
    recs = {j: v["records"] for j, v in jobs.items() if v.get("records")}
    if not recs:
        return {"error": ph.get("error") or "no records"}
    if ph["kind"] == "dynamic":
        w0 = min(v["launch_t"] for v in jobs.values())
        ends = [v["done"]["t"] for v in jobs.values() if v.get("done")]
        w1 = max(ends) if ends else ph["window"][1]
    else:
        w0, w1 = ph["window"]
    per_job = {}
    tot_norm_s = tot_samples = tot_wait = tot_alive = 0.0
    for j, r in recs.items():
        a, b = max(w0, r[0]["t"]), min(w1, r[-1]["t"])
        if b <= a:
            continue
        d = lambda k: max(0.0, M.counter_at(r, k, b) - M.counter_at(r, k, a))
        samples, wait, comp = d("samples"), d("wait_s"), d("compute_s")
        ceil = _ceiling(jobs[j])
        gpus = int(jobs[j]["spec"].get("gpus") or 1)
        per_job[j] = {"kind": jobs[j]["spec"]["kind"], "gpus": gpus, "samples_per_s": samples / (b - a),
                      "normalised": M.normalised(samples / (b - a), ceil), "ceiling": ceil,
                      "data_wait_frac": wait / (wait + comp) if wait + comp > 0 else math.nan,
                      "resizes": int(r[-1].get("resizes", 0)), "workers_end": r[-1]["workers"],
                      "worker_cpu_cores": d("cpu_s") / (b - a), "trainer_cpu_cores": (d("main_cpu_s") if "main_cpu_s" in r[-1] else math.nan) / (b - a),
                      "trainer_runq_cores": (d("main_runq_s") if "main_runq_s" in r[-1] else math.nan) / (b - a),
                      "alive_s": b - a}
        tot_norm_s += gpus * samples / ceil      # GPU-weighted: a job's throughput counts once per GPU
        tot_samples += samples
        tot_wait += gpus * wait
        tot_alive += gpus * (wait + comp)
    span = w1 - w0
    out = {"window_s": span, "agg_normalised": tot_norm_s / span if span > 0 else math.nan,
           "samples_per_s": tot_samples / span if span > 0 else math.nan,
           "gpu_idle_frac": M.gpu_idle_fraction([tot_wait], [tot_alive]),
           "jain": M.jain_index(v["normalised"] for v in per_job.values()),
           "resizes": sum(v["resizes"] for v in per_job.values()), "jobs": per_job, "error": ph.get("error")}
    th = ph.get("static_throttle") or {}
    for j, a0 in (th.get("at0") or {}).items():     # static-cores: the job group's quota throttling in the window
        a1 = (th.get("at1") or {}).get(j)
        if j in per_job and a1 and a1["periods"] > a0["periods"]:
            per_job[j]["throttled_frac"] = (a1["throttled"] - a0["throttled"]) / (a1["periods"] - a0["periods"])
            per_job[j]["throttled_s_per_s"] = (a1["throttled_s"] - a0["throttled_s"]) / max(1e-9, th["t1"] - th["t0"])
    mem = [m for m in ph.get("memory") or [] if w0 <= m["t"] <= w1]
    if mem:
        budget = ph.get("loader_memory_budget")
        out["loader_memory_max_bytes"] = max(m["total"] for m in mem)
        out["loader_memory_mean_bytes"] = M.mean(m["total"] for m in mem)
        out["loader_memory_samples"] = len(mem)
        if budget:
            out["loader_memory_budget_bytes"] = budget
            out["loader_memory_over_budget_samples"] = sum(1 for m in mem if m["total"] > budget)
    ac = ph.get("agent_cpu") or {}
    if "cpu1" in ac and ac["t1"] > ac["t0"]:
        out["agent_cpu_cores"] = (ac["cpu1"] - ac["cpu0"]) / (ac["t1"] - ac["t0"])
    nc = ph.get("node_cpu") or {}
    if ph["kind"] == "static" and "busy1" in nc and nc["t1"] > nc["t0"]:
        # what else ran on the node in the window: its busy (and stolen) CPU less the jobs' and the
        # agent's (other tenants, this bench process): the CPU the jobs could not have had
        busy = (nc["busy1"] - nc["busy0"]) / (nc["t1"] - nc["t0"])
        jobs_cpu = sum(v.get("worker_cpu_cores", 0.0) + v.get("trainer_cpu_cores", 0.0) for v in per_job.values())
        out["node_busy_cores"] = busy
        if math.isfinite(jobs_cpu):
            out["node_other_cores"] = max(0.0, busy - jobs_cpu - out.get("agent_cpu_cores", 0.0))
    if ph["kind"] == "dynamic":
        arrivals = {j: v["launch_t"] for j, v in jobs.items()}
        finishes = {j: v["done"]["t"] for j, v in jobs.items() if v.get("done") and v["done"].get("reason") == "work"}
        jct = M.completion_times(arrivals, finishes)
        out.update(makespan_s=M.makespan(list(arrivals.values()), list(finishes.values())) if finishes else math.nan,
                   jct_mean_s=M.mean(jct.values()), jct_p95_s=M.percentile(jct.values(), 95),
                   jct_gpu_mean_s=M.gpu_weighted_mean(jct, {j: jobs[j]["spec"].get("gpus") or 1 for j in jct}),
                   unfinished=len(jobs) - len(finishes))
    # reaction after each event: allocation settling (last worker change) and throughput settling
    evs = sorted(ph.get("events") or [], key=lambda e: e["t"])
    agg_t, agg_v = aggregate_series(ph, bin_s)
    reactions = []
    for i, e in enumerate(evs):
        nxt = evs[i + 1]["t"] if i + 1 < len(evs) else w1
        alloc = 0.0
        for j, r in recs.items():
            ts = [x["t"] for x in r]
            ws = [x["workers"] for x in r]
            alloc = max(alloc, M.last_change_after(ts, ws, e["t"], nxt))
        tput = M.settle_time(agg_t, agg_v, e["t"], nxt, rel_tol=0.10)
        seg = [v for t, v in zip(agg_t, agg_v) if e["t"] + min(5.0, (nxt - e["t"]) / 2) <= t <= nxt]
        reactions.append({"event": e["label"], "kind": e.get("kind"), "at_s": e["t"] - (ph["origin"] or e["t"]),
                          "alloc_settle_s": alloc, "tput_settle_s": tput,
                          "agg_normalised_after": M.mean(seg) if seg else math.nan})
    if reactions:
        out["reactions"] = reactions
        out["reaction_s_max"] = max(r["alloc_settle_s"] for r in reactions)
        ts = [r["tput_settle_s"] for r in reactions if not math.isnan(r["tput_settle_s"])]
        out["tput_settle_s_max"] = max(ts) if ts else math.nan
    return out


def aggregate_series(ph: dict, bin_s: float = 1.0) -> tuple[list, list]:
    """Aggregate GPU-weighted normalised throughput per bin over the phase (absolute monotonic times)."""
    recs = {j: v["records"] for j, v in ph["jobs"].items() if v.get("records")}
    if not recs:
        return [], []
    t0 = min(r[0]["t"] for r in recs.values())
    t1 = max(r[-1]["t"] for r in recs.values())
    ts, tot = [], []
    t = t0
    while t + bin_s <= t1 + 1e-9:
        s = 0.0
        for j, r in recs.items():
            if r[0]["t"] <= t and t + bin_s <= r[-1]["t"]:
                s += (M.rate_between(r, "samples", t, t + bin_s) / _ceiling(ph["jobs"][j])
                      * int(ph["jobs"][j]["spec"].get("gpus") or 1))
        ts.append(t + bin_s / 2)
        tot.append(s)
        t += bin_s
    return ts, tot


def job_series(ph: dict, bin_s: float = 1.0) -> dict:
    """Per job: times relative to the origin, normalised throughput per bin, and worker targets."""
    origin = ph.get("origin") or ph.get("phase_start") or 0.0
    out = {}
    for j, v in ph["jobs"].items():
        r = v.get("records") or []
        if len(r) < 2:
            continue
        ts, vs = M.series(r, "samples", r[0]["t"], r[-1]["t"], bin_s)
        ceil = _ceiling(v)
        out[j] = {"t": [round(t - origin, 2) for t in ts], "normalised": [round(x / ceil, 4) for x in vs],
                  "wt": [round(x["t"] - origin, 2) for x in r], "workers": [x["workers"] for x in r]}
    return out


# -- the whole run -------------------------------------------------------------------------------

def policy_order(policies: list[str], rep: int) -> list[str]:
    k = rep % len(policies) if policies else 0
    return list(policies[k:]) + list(policies[:k])


def scenario_plans(scenarios: list[str], policies: list[str],
                   job_ids: Optional[dict[str, set]] = None) -> dict[str, dict[str, dict]]:
    """Scenario name -> ``plan:FILE`` policy -> its plan (``load_plans``), checked before anything runs
    (``adloader bench`` before the calibration, ``run_bench`` again with each scenario's ``job_ids``): a
    BenchError where two policies would write one phase folder (``plan:a/x.json`` and ``plan:b/x.json``),
    a file has no plan for a scenario, or its plan names a job the scenario does not have (a plan
    searched for another node's jobs, e.g. ``best_plan --nodes``)."""
    out: dict[str, dict[str, dict]] = {}
    names = [policy_dirname(p) for p in policies]
    twins = sorted({n for n in names if names.count(n) > 1})
    if twins:
        raise BenchError(f"policies that would share the phase folder(s) {', '.join(twins)}: two plan files with one "
                         f"name (or a policy twice); rename one")
    for policy in policies:
        f = plan_file(policy)
        if f is None:
            continue
        loaded = load_plans(f)
        missing = [sc for sc in scenarios if sc not in loaded]
        if missing:
            raise BenchError(f"plan file {f} has no plan for scenario {', '.join(missing)}")
        for sc in scenarios:
            ids = (job_ids or {}).get(sc)
            unknown = sorted(set(loaded[sc]["plan"]) - ids) if ids is not None else []
            if unknown:
                raise BenchError(f"plan file {f}: scenario {sc}'s plan names job(s) {', '.join(unknown)} "
                                 f"it does not have (its jobs: {', '.join(sorted(ids))})")
            out.setdefault(sc, {})[policy] = loaded[sc]
    return out


def run_bench(cfg: BenchConfig, scenarios: list[Scenario], policies: list[str], reps: int, progress) -> dict:
    """Every scenario x repeat x policy (interleaved); returns raw phases plus their metrics."""
    phases = []
    total = len(scenarios) * reps * len(policies)
    i = 0
    plans = scenario_plans([sc.name for sc in scenarios], policies,
                           {sc.name: {l.spec.job_id for l in sc.launches} for sc in scenarios})
    for sc in scenarios:
        curves_path = None
        sweeps = None
        if "oracle" in policies:
            sweep_memory: dict = {}
            doc: dict = {}
            if cfg.oracle_source == "colocated" and colocated_applies(sc):
                sweeps, doc["budget_cores"] = measure_colocated(cfg, sc, cfg.out_dir / "runs" / sc.name / "probes",
                                                                progress, memory_out=sweep_memory)
                doc["note"] = PROBE_NOTE
            else:
                sweeps = measure_sweeps(cfg, [l.spec for l in sc.launches], cfg.out_dir / "runs" / sc.name / "sweep",
                                        progress, memory_out=sweep_memory)
                doc["note"] = "each kind measured alone on the node; memory: one worker's USS, the most seen in its sweep"
            curves_path = cfg.out_dir / "runs" / sc.name / "oracle-curves.json"
            curves_path.write_text(json.dumps({"jobs": sweeps, "memory": sweep_memory, **doc}))
        plan_paths = {}
        for policy, p in plans.get(sc.name, {}).items():
            plan_paths[policy] = cfg.out_dir / "runs" / sc.name / f"{policy_dirname(policy)}.json"
            plan_paths[policy].parent.mkdir(parents=True, exist_ok=True)
            plan_paths[policy].write_text(json.dumps({**p, "source": str(plan_file(policy))}))
        for rep in range(reps):
            for policy in policy_order(policies, rep):
                i += 1
                label = f"{sc.name} {policy} rep {rep + 1}"
                progress.begin(i, total, label)
                run_dir = cfg.out_dir / "runs" / sc.name / f"{policy_dirname(policy)}-rep{rep + 1}"
                try:
                    ph = run_phase(cfg, sc, policy, rep, run_dir, plan_paths.get(policy, curves_path),
                                   tick=lambda rel, planned: progress.tick(i, total, label, rel, planned))
                    ph["metrics"] = phase_metrics(ph)
                except BenchError as e:
                    ph = {"scenario": sc.name, "policy": policy, "rep": rep, "error": str(e), "metrics": {}}
                if sweeps is not None:
                    ph["oracle_curves"] = sweeps if policy == "oracle" else None
                progress.end(i, total, label, ph)
                phases.append(ph)
    return {"phases": phases}
