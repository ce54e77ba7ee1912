"""Domain types that cross the agent's parts: what one tick sees and what it decides.

collector -> ``NodeSnapshot`` (with one ``JobStats`` per registered job, rates not counters)
predictor -> ``predictor.curve.ThroughputCurve`` per job
policy    -> ``AllocationPlan`` (one ``JobAllocation`` per job, each with its reason; what could not
             be satisfied is data in ``unsatisfied``, not a log line; ``NodeAllocation``: the loaders
             together against the training processes and the rest of the node)
actuators -> ``ApplyResult`` per job

Policies are pure: ``decide(snapshot, curves, config) -> AllocationPlan``. They see the allocation in
force for each job in ``NodeSnapshot.applied`` (for hysteresis), never a clock or a file.

Data flows one way: the collector measures (``JobStats``, ``NodeSnapshot`` without ``applied``), the
controller adds what it alone knows, the allocation it has applied (``NodeSnapshot.applied``), and
hands that snapshot to the policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class JobAllocation:
    job: str
    workers: int                          # loader worker count (directive to the client)
    cpus: float                           # CPU cores for the job's loader workers (share, quota or set size)
    cpuset: Optional[tuple[int, ...]] = None   # exclusive CPU ids, when the policy pins
    io_weight: Optional[int] = None       # 1..1000 (blkio.bfq.weight / io.weight scale), None = leave
    reason: str = ""
    enforce_cpu: bool = True              # False: `cpus` is informational; CPU actuators leave the workers alone
    cpu_weight: Optional[float] = None    # cores the job's group weighs (``shares`` knob) when not ``cpus``:
                                          # a job with all the cores it can use weighs more (policies.satisfied_weight)
    cold: bool = False                    # planned without a curve (a cold-start rule), not from an estimate
    budget: Optional[float] = None        # the share budget (cores) of the plan that made it: adaptive's own
                                          # record, so that a re-plan keeps the budget in force (its sticky rule)
    delivery: float = 1.0                 # the factor its CPU weight carries over its cores so that it receives
                                          # them (adaptive's ``delivery_correction``; 1 = none)
    extra_workers: int = 0                # of ``workers``, those over its thread split because its workers received
                                          # less of its cores than the other CPU-bound jobs' (``delivery_workers``)

    @property
    def weight_cores(self) -> float:
        """The cores the job's CPU group weighs: ``cpu_weight`` where the plan sets one, else ``cpus``."""
        return self.cpus if self.cpu_weight is None else self.cpu_weight


@dataclass(frozen=True)
class NodeAllocation:
    """What a plan decides for all the jobs' loaders together, against the rest of the node.

    ``loaders_yield``: the loaders' subtree runs only on CPU that the training processes (and every
    other task on the node) leave idle (cgroup ``cpu.idle``): a trainer's CPU part is on its GPU's
    critical path, a loader's work is queued ahead (prefetch), so the trainer goes first. Otherwise the
    subtree weighs its planned cores and is capped at the node less the trainers' expected use.
    ``weigh_workers``: the subtree, not yielding because other processes use the node, weighs one task per
    worker (as the workers would unmanaged) instead of one per planned core (``PolicyConfig.
    foreign_weight`` "workers"); still capped.
    ``foreign_load``: the subtree does not yield because other processes use the node (the plan's reason
    says how much); ``agent.policies.ForeignPattern`` reads it to tell a load that comes and goes.
    ``intermittent``: of those, the subtree keeps weighing through the gaps of such a load
    (``PolicyConfig.foreign_intermittent``).
    ``trainers``: job -> (cores its training processes need at full speed, cores they will use at the
    pace the data allows), measured this tick (``agent.policies.trainer_cores_needed`` / ``_expected``).
    """
    loaders_yield: bool = False
    trainers: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    reason: str = ""
    weigh_workers: bool = False
    foreign_load: bool = False
    intermittent: bool = False


@dataclass(frozen=True)
class AllocationPlan:
    policy: str
    allocations: Mapping[str, JobAllocation]
    unsatisfied: Mapping[str, str] = field(default_factory=dict)   # job -> what it wanted and did not get
    predicted_total: Optional[float] = None   # GPU-weighted sum of normalised throughput, when known
    node: Optional[NodeAllocation] = None     # the loaders together vs the node (None: no CPU control)


@dataclass(frozen=True)
class Report:
    """One rank's report as the agent received it: the loader's monotonic totals (the predictor's
    windows are differences of two reports, never smoothed rates; ``agent.collector.settled_window``)."""
    recv_t: float                         # the agent's clock when it arrived (monotonic seconds)
    uptime_s: float                       # the client's clock (window lengths are measured on it)
    totals: Mapping[str, Optional[float]] # counter -> total (None: the client does not report it)
    workers: int                          # the loader's target worker count at the report
    live_workers: Optional[int] = None    # worker processes taking tasks (None: the client does not say)
    epoch: Optional[int] = None           # the loader's epoch, 0-based (None: the client does not say)


@dataclass(frozen=True)
class JobStats:
    """One job on this node over the last window: rates and means, never raw counters."""
    job: str
    uid: int
    ranks: int                            # training processes of this job on this node
    gpus: int                             # GPUs this job uses on this node (weight in the objective; >= 1)
    # A job of several ranks is one loader here, its ranks' loaders together (agent.collector's docstring):
    batch_size: int                       # as the clients report it (a batch sampler's: a rounded mean since
                                          # its loader started), summed over ranks: one step's batch of each
    workers: int                          # current worker target reported by the client(s), summed over ranks
    requested_workers: int                # the user's own num_workers (what `none` keeps), summed over ranks
    max_workers: Optional[int]            # the loaders' max_workers bound, summed over ranks (None: a rank has none)
    samples_per_s: float                  # summed over ranks
    compute_s_per_step: float             # mean over ranks
    data_wait_s_per_step: float           # max over ranks (a stall on one rank stalls all)
    data_wait_frac: float                 # data_wait / (data_wait + compute), max over ranks
    cpu_s_per_batch: float                # per-batch figures are the job's batch's (``batch_size``): each rank's
    wall_s_per_batch: float               # mean over its batches, times the ranks
    runq_s_per_batch: float
    blocked_s_per_batch: float
    worker_cpu_cores: float               # CPU cores the job's workers used (rate)
    # (compute_s_per_step less trainer_runq_s_per_step is the step with data ready and the trainer not starved)
    trainer_cpu_cores: float = 0.0        # CPU cores the job's training processes themselves used (summed over ranks)
    job_cpu_cores: float = 0.0            # ... and with everything else they ran: their CPU outside steps (a
                                          # validation pass, a checkpoint save) and every process they
                                          # started, every loader's workers (the client's ``job_cpu_s``;
                                          # 0 where a client does not report it)
    trainer_cpu_s_per_step: float = 0.0   # their CPU seconds per step (summed over ranks: all run each step)
    trainer_runq_s_per_step: float = 0.0  # per step, how long a training process waited for a CPU while runnable
                                          # (mean over ranks): the part of compute_s_per_step that is CPU starvation
    gpu_idle_frac: Optional[float] = None # from NVML when available, else None
    gpu_idle_source: str = "client"       # "nvml" or "client" (data_wait_frac stands in)
    allowed_cpus: tuple[int, ...] = ()    # CPUs the job may use (Slurm/affinity); () = all node loader CPUs
    cpu_quota_cores: Optional[float] = None   # cores its ranks' cgroup CPU quotas allow together (a container's
                                          # CPU limit), trainers included; None = no quota
    cooperative: bool = False             # another manager owns the job's cgroup: no cgroup writes
    age_s: float = 0.0                    # since arrival
    observed_s: float = 0.0               # how long we have reports for
    window_s: float = 0.0                 # length of the window these figures cover (0 = no data yet)
    samples_per_step: Optional[float] = None  # that window's own batch size: samples delivered over steps taken
                                          # (``predictor.bank.window_batch_size``), the job's (as ``batch_size``).
                                          # None: ``batch_size`` stands (no step, no samples, refused)
    window_steps: Optional[float] = None  # steps per rank in that window (counter deltas, mean over ranks);
                                          # None: not counted (no step, refused; hand-made stats)
    samples_per_step_note: str = ""       # why that window's own batch size is not taken ("" where it is)
    requested_cpus: Optional[float] = None    # from registration (Slurm CPUs), if any
    pids: tuple[int, ...] = ()            # training processes (ranks) on this node: never throttled
    worker_pids: tuple[int, ...] = ()     # the loader worker processes: what CPU actuators move/pin
    # worker pid -> its start time (clock ticks) as the registry recorded it when it took the worker
    # (``registry.Rank.worker_starts``; None: not recorded, a journal older than start times). Actuators
    # check it, with ``uid``, right before each write to a worker pid (``security.same_process``): a worker
    # that exited may have left its pid to another process since the client's last report. A pid not
    # here is not checked (stats made by hand, the simulator); the collector puts every worker here.
    worker_starts: Mapping[int, Optional[int]] = field(default_factory=dict, repr=False, compare=False)
    # memory (bytes; from the loaders' reports, ``adloader.memory``; 0 = not measured yet)
    worker_memory_bytes: float = 0.0      # one worker's cost: mean USS + its share of batches in flight,
                                          # never below the most seen since the loaders started (collector)
    loader_memory_bytes: float = 0.0      # the job's loader memory now: workers' USS + batches in flight,
                                          # of every loader of its processes (other_loader_memory_bytes too)
    other_loader_memory_bytes: float = 0.0   # of that, its loaders' the agent does not size (a validation
                                             # loader's workers; ``adloader.client``): held as they are
    worker_growth_bytes: float = 0.0      # mean USS growth of a worker since it started (copy-on-read)
    steps_left: Optional[float] = None    # steps the job has left (its loader's ``total_steps`` counted down,
                                          # the most over ranks); None: the job did not say
    steps_left_refused: bool = False      # a rank's steps_left is not taken: it does not count down
                                          # (``agent.collector``)
    epoch_fixed: bool = False             # every rank's loader changes workers only at an epoch: its hello or
                                          # latest report says dataset_kind "iterable" (False: a rank says
                                          # "map", or does not say: a client older than dataset_kind)
    away_s: float = 0.0                   # how long the job's training loop has been out of its loader's next()
                                          # (a validation pass, a checkpoint save, a debugger stop; not a wait for
                                          # data), the least over ranks, by their latest reports; 0: stepping,
                                          # waiting for data, or not reported (a client older than ``away_s``)
    away_cpu_cores: Optional[float] = None   # while away: the job's CPU (``job_cpu_cores``' count) from the
                                          # reports inside the pause only, the most over any 3 s of them, not
                                          # smoothed (a validation pass's own use, without the decaying figure
                                          # of its training before, nor what its lent cores' takers leave it);
                                          # None when not away or not known yet
    # each rank's recent reports, oldest first (``agent.collector.HISTORY_S``): the raw totals the
    # predictor's windows are cut from. () where no collector keeps them (the simulator, hand-made stats)
    history: tuple[tuple[Report, ...], ...] = field(default=(), repr=False, compare=False)

    @property
    def cpu_cores(self) -> float:
        """CPU cores the job used, all of it: its training processes and its loaders' workers during its
        steps (``trainer_cpu_cores + worker_cpu_cores``) or, where its clients count more
        (``job_cpu_cores``: a validation pass with a loader of its own, a checkpoint save), that. What the
        collector leaves out of other processes' load (``NodeSnapshot.foreign_cpu_cores``)."""
        return max(self.trainer_cpu_cores + self.worker_cpu_cores, self.job_cpu_cores)

    @property
    def cpu_cap_cores(self) -> Optional[float]:
        """The most cores the job can run on: its allowed CPUs' count or its CPU quota, whichever is less;
        None when neither bounds it. Cores planned above it are throttled by the kernel, not used."""
        caps = [float(len(self.allowed_cpus))] if self.allowed_cpus else []
        if self.cpu_quota_cores is not None and self.cpu_quota_cores > 0:
            caps.append(self.cpu_quota_cores)
        return min(caps) if caps else None


@dataclass(frozen=True)
class NodeSnapshot:
    now: float                            # monotonic seconds (for ages only; policies do not read clocks)
    loader_cpus: float                    # CPU cores the node gives to data loading, all jobs together
    cpu_ids: tuple[int, ...]              # the CPUs those cores are on
    jobs: Mapping[str, JobStats]
    max_jobs: int = 0                     # for even-static: the most jobs the node is sized for (0 = unknown)
    cpu_pressure: Optional[float] = None  # PSI some avg10 (percent), when present
    io_pressure: Optional[float] = None
    loader_memory_bytes: Optional[float] = None   # loader memory budget in force (None = no budget);
                                                  # below the configured one under memory pressure
    memory_pressure: Optional[float] = None       # PSI memory some avg10 (percent), when present
    memory_available_bytes: Optional[float] = None   # MemAvailable
    memory_note: str = ""                 # why the budget in force differs from the configured one
    busy_cpu_cores: Optional[float] = None    # CPU the whole node used (rate, /proc/stat), when known
    foreign_cpu_cores: Optional[float] = None # of it, what neither the jobs' training processes nor their
                                          # loader workers used (other tenants, daemons; smoothed), when known
    foreign_held_cpu_cores: Optional[float] = None   # the least foreign_cpu_cores of the last FOREIGN_HOLD_S
                                          # (agent.collector): what other processes kept using, not a burst
    foreign_intermittent: bool = False    # other processes' load came back within foreign_return_s of
                                          # leaving and has not stayed away that long since (the
                                          # controller's ``agent.policies.ForeignPattern``)
    applied: Mapping[str, JobAllocation] = field(default_factory=dict)   # job -> allocation in force;
                                          # set by the controller alone (the collector leaves it empty)
    applied_node: Optional[NodeAllocation] = None   # the node allocation in force (the controller's, too)
    applied_age_s: Mapping[str, float] = field(default_factory=dict)   # job -> seconds since its allocation
                                          # in force last changed (the controller's; absent: unknown, old)
    loader_cpus_auto: bool = False        # loader_cpus is the "auto" default (the CPUs less a 10% reserve):
                                          # the controller may grow it into the part of the reserve that the
                                          # training processes and other processes leave (policies.grown_loader_cpus)


@dataclass(frozen=True)
class ApplyResult:
    job: str
    ok: bool
    applied: Optional[JobAllocation]      # what is now in force (may be partial)
    error: str = ""
    not_enforced: tuple[str, ...] = ()    # knobs that exist but do nothing here, e.g. ("io: scheduler none",)


def epoch_fixed_workers(job: JobStats) -> Optional[int]:
    """The workers a job runs until its epoch ends, where its worker count cannot change before then:
    every rank's loader says so (``JobStats.epoch_fixed``: an ``IterableDataset``, whose epoch's worker
    shards are fixed; a resize waits for the next epoch, which for an endless stream never comes). That
    holds whether or not a target is pending: a count sent now waits for the epoch's end as well. The
    ranks' live workers (``live_workers``); before any rank has reported, the target its hello said
    (the hello comes at the loader's first iteration, so its first epoch runs that many). 0: the job
    loads in its training processes (``num_workers=0``), and a count sent now starts workers only at
    its next epoch. None otherwise: a map-style loader (its resize is under way between two batches;
    its workers may take a while to start and must not be held), a client that does not say its
    dataset's kind (older than ``dataset_kind``: never held), or ranks of which only some reported."""
    if not job.epoch_fixed:
        return None
    if not any(job.history):
        return job.workers
    return live_workers(job)


def epochs_end(job: JobStats) -> bool:
    """Whether the job's loaders have been seen past an epoch's end: every rank's latest report is of an
    epoch after its first (``Report.epoch`` >= 1). A target sent to an ``IterableDataset``'s loader then
    takes effect at the next epoch; an endless stream stays in its first epoch (so does a finite one in
    its first: it is told a count only from its second on)."""
    lasts = [h[-1] for h in job.history if h]
    return bool(lasts) and len(lasts) >= job.ranks and all(r.epoch is not None and r.epoch >= 1 for r in lasts)


def live_workers(job: JobStats) -> Optional[int]:
    """The workers taking tasks at each rank's latest report (``Report.live_workers``), summed over the
    ranks; None where a rank has no report or does not say. Below the target (``JobStats.workers``)
    while a resize is under way, and for as long as an ``IterableDataset``'s epoch lasts: its worker
    shards are fixed until the next epoch (``adloader.DataLoader.resize``), which for an endless stream
    is never. A job whose reports never settle is observed from its smoothed figures
    (``agent.controller.UNSETTLED_FALLBACK_S``): those are the live workers' work, and counted as the target's they
    told the predictor that the target's workers buy what the live ones do."""
    lasts = [h[-1] for h in job.history if h]
    if not lasts or len(lasts) < job.ranks or any(r.live_workers is None for r in lasts):
        return None
    return sum(r.live_workers for r in lasts)
