"""adloader.autotune: usable CPUs (affinity + cgroup quota, fake trees), stats -> Observation, and the
pure tuner's convergence without oscillation on a simulated job (unit tier)."""
import math
import os

import pytest

from adloader import autotune
from predictor.observation import Observation
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


def _v1_tree(tmp_path, quotas):
    """quotas: {relative dir: (quota, period)} under a cpu,cpuacct mount; returns /proc/self/cgroup."""
    mount = tmp_path / "cpu,cpuacct"
    for rel, (q, per) in quotas.items():
        d = mount / rel if rel else mount
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(f"{q}\n")
        (d / "cpu.cfs_period_us").write_text(f"{per}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:cpu,cpuacct:/a/b\n2:memory:/x\n0::/\n")
    return str(proc)


def test_v1_quota_of_own_group(tmp_path):
    proc = _v1_tree(tmp_path, {"": (-1, 100000), "a": (-1, 100000), "a/b": (150000, 100000)})
    assert autotune.cgroup_cpu_quota(proc, str(tmp_path)) == pytest.approx(1.5)


def test_v1_tighter_ancestor_wins(tmp_path):
    proc = _v1_tree(tmp_path, {"": (-1, 100000), "a": (50000, 100000), "a/b": (150000, 100000)})
    assert autotune.cgroup_cpu_quota(proc, str(tmp_path)) == pytest.approx(0.5)


def test_v1_unlimited(tmp_path):
    proc = _v1_tree(tmp_path, {"": (-1, 100000), "a": (-1, 100000), "a/b": (-1, 100000)})
    assert autotune.cgroup_cpu_quota(proc, str(tmp_path)) is None


@pytest.mark.parametrize("cpu_max,expect", [("50000 100000", 0.5), ("max 100000", None), ("250000 100000", 2.5)])
def test_v2_cpu_max(tmp_path, cpu_max, expect):
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "step" / "cpu.max").write_text(cpu_max + "\n")
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    got = autotune.cgroup_cpu_quota(str(proc), str(tmp_path))
    assert got == (pytest.approx(expect) if expect is not None else None)


def test_usable_cpus_bounded_by_affinity_and_quota(tmp_path):
    aff = len(os.sched_getaffinity(0))
    assert 0 < autotune.usable_cpus() <= aff
    proc = _v1_tree(tmp_path, {"": (-1, 100000), "a": (-1, 100000), "a/b": (30000, 100000)})
    assert autotune.usable_cpus(proc, str(tmp_path)) == pytest.approx(min(aff, 0.3))
    assert autotune.usable_cpus("/nonexistent", str(tmp_path)) == aff


def _totals(steps, samples, batches, workers, t, resizes=0, **per):
    return {"steps": steps, "samples": samples, "batches": batches, "workers": workers, "live_workers": workers,
            "batch_size": 8, "uptime_s": t, "resizes": resizes, "data_wait_s": per.get("wait", 0.0),
            "compute_s": per.get("compute", 0.0), "worker_cpu_s": per.get("cpu", 0.0),
            "worker_wall_s": per.get("wall", 0.0), "worker_runq_s": per.get("runq", 0.0),
            "worker_blocked_s": per.get("blocked", 0.0)}


def test_observation_from_totals():
    a = _totals(10, 80, 10, 2, 1.0, wait=0.1, compute=0.5, cpu=0.2, wall=0.5, runq=0.1, blocked=0.2)
    b = _totals(30, 240, 30, 2, 3.0, wait=0.3, compute=1.5, cpu=0.6, wall=1.5, runq=0.3, blocked=0.6)
    o = autotune.observation_from_totals(a, b, cores=1.5)
    assert o.workers == 2 and o.cores == 1.5 and o.steps == 20
    assert o.samples_per_s == pytest.approx(80.0)
    assert o.cpu_s_per_batch == pytest.approx(0.02)
    assert o.blocked_s_per_batch == pytest.approx(0.05 - 0.02 - 0.01)
    assert o.data_wait_s_per_step == pytest.approx(0.01)
    # a resize in between, or no steps: no window
    assert autotune.observation_from_totals(a, {**b, "resizes": 1}, 1.5) is None
    assert autotune.observation_from_totals(a, {**a, "uptime_s": 2.0}, 1.5) is None


def test_observation_from_totals_skips_a_window_the_loop_paused_in():
    """The loader's ``paused_s`` rose in the window (a validation pass or a checkpoint between two
    next() calls): its time holds the pause's seconds but none of its steps, no window of the loop's
    pace (the tuner's curve read the job's throughput at its count as a fraction of what it was)."""
    a = _totals(10, 80, 10, 2, 1.0, compute=0.5, cpu=0.2, wall=0.5)
    b = _totals(30, 240, 30, 2, 3.0, compute=1.5, cpu=0.6, wall=1.5)
    assert autotune.observation_from_totals({**a, "paused_s": 0.0}, {**b, "paused_s": 0.0}, 1.5) is not None
    assert autotune.observation_from_totals({**a, "paused_s": 0.0}, {**b, "paused_s": 8.0}, 1.5) is None
    # (what ``adloader profile`` reads over its whole run is not a tuner's window: kept)
    assert autotune.observation_from_totals({**a, "paused_s": 0.0}, {**b, "paused_s": 8.0}, 1.5, strict=False)


def test_observation_from_totals_takes_the_windows_own_batch_size():
    """A batch sampler's ``batch_size`` in ``stats()`` is its rounded mean since the loader started: the
    tuner's window takes samples over steps, as the agent does (``predictor.bank.window_batch_size``)."""
    a = _totals(10, 80, 10, 2, 1.0, compute=0.5)
    b = _totals(30, 80 + 20 * 32.5, 30, 2, 3.0, compute=1.5)             # a sampler of 32 and 33
    assert autotune.observation_from_totals(a, {**b, "batch_size": 33}, 1.5).batch_size == pytest.approx(32.5)
    c = _totals(50, 80 + 20 * 32.5 + 20 * 64, 50, 2, 5.0, compute=2.5)    # batches doubled; the mean lags
    o = autotune.observation_from_totals(b, {**c, "batch_size": 45}, 1.5)
    assert o.batch_size == 64 and isinstance(o.batch_size, int) and o.samples_per_s == pytest.approx(640.0)
    # fixed batches: the same int as reported; no size reported yet: the window's
    assert autotune.observation_from_totals(a, _totals(30, 240, 30, 2, 3.0, compute=1.5), 1.5).batch_size == 8
    assert autotune.observation_from_totals(a, {**b, "batch_size": None}, 1.5).batch_size == pytest.approx(32.5)
    # counters no loader's (16x off what it reports): the reported size stands
    assert autotune.observation_from_totals(a, {**b, "batch_size": 1000}, 1.5).batch_size == 1000


def simulated_window(workers, cpus, g=0.01, c=0.03, b=0.0, bs=8, dur=2.0):
    """What a job with these true costs does at ``workers`` on ``cpus`` (first principles + the
    run-queue delay that oversubscription causes)."""
    bps = min(1 / g, workers / (c + b), cpus / c)
    busy = bps * c
    runq = max(0.0, c * (min(workers, bps * (c + b)) / cpus - 1)) if cpus < workers else 0.0
    steps = int(bps * dur)
    return Observation(workers=workers, cores=cpus, batch_size=bs, compute_s_per_step=g,
                       data_wait_s_per_step=max(0.0, 1 / bps - g), cpu_s_per_batch=c,
                       wall_s_per_batch=c + b + runq, runq_s_per_batch=runq, blocked_s_per_batch=b,
                       samples_per_s=bps * bs, duration_s=dur, steps=steps)


@pytest.mark.parametrize("c,b,cpus,start", [(0.03, 0.0, 4.0, 1), (0.03, 0.0, 2.0, 2), (0.005, 0.04, 2.0, 2),
                                              (0.002, 0.0, 8.0, 8)])
def test_tuner_settles_near_knee_without_oscillation(c, b, cpus, start):
    from predictor.bank import PredictorBank
    from predictor.curve import ThroughputCurve

    truth = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=c, blocked_s_per_batch=b)
    knee = truth.knee_workers(cpus)
    tuner = autotune.AutoTuner(cpus=cpus, cap=autotune.worker_cap(cpus, None), current=start,
                               bank=PredictorBank(prior="default"))
    seen = []
    for _ in range(40):
        tuner.window(simulated_window(tuner.current, cpus, c=c, b=b))
        seen.append(tuner.current)
    settle_windows = int(30 / autotune.WINDOW_S)                 # ~30 s of real windows
    assert abs(tuner.current - knee) <= 1, (seen, knee)
    assert len(tuner.history) <= 4, tuner.history              # a few moves ...
    assert all(i <= settle_windows for i, _ in tuner.history), (tuner.history, seen)  # ... early
    assert len(set(seen[settle_windows:])) == 1, seen             # then it stays


def test_tuner_follows_a_new_phase_of_the_job_both_ways():
    # a heavy pipeline (knee 3 workers on 4 CPUs), then a light one (1 worker keeps up), then heavy
    # again. The bank drops the old phase's windows; the tuner must drop what it measured in it too:
    # before, 1 worker's heavy-phase throughput (a third of the light phase's) read as "measured worse
    # there" and held 3 workers through the light phase for good, and the heavy phase's turn between
    # two counts doubled the gain the next phase needed.
    from predictor.bank import PredictorBank
    from predictor.curve import ThroughputCurve

    cpus = 4.0
    tuner = autotune.AutoTuner(cpus=cpus, cap=autotune.worker_cap(cpus, None), current=1,
                               bank=PredictorBank(prior="default"))
    for c in (0.03, 0.005, 0.03):
        knee = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=c,
                                blocked_s_per_batch=0.0).knee_workers(cpus)
        seen = []
        for _ in range(30):
            tuner.window(simulated_window(tuner.current, cpus, c=c))
            seen.append(tuner.current)
        assert tuner.current == knee, (c, knee, seen, tuner.history)
        assert len(set(seen[10:])) == 1, (c, seen)          # it got there within ~20 s and stayed
    assert tuner.phase == 2 and not tuner.reversals, (tuner.phase, tuner.reversals)


@pytest.mark.parametrize("phases", [(0.04, 0.004, 0.04), (0.08, 0.01, 0.08), (0.06, 0.02, 0.06)])
def test_tuner_follows_a_change_of_the_jobs_io_latency_both_ways(phases):
    # An IO-bound job (1 ms CPU a batch, 10 ms step) whose fetches get faster or slower while it runs:
    # the page cache warms, shared storage gets busy, the dataset's next shard lives elsewhere. The bank
    # starts a new phase on CPU per sample or step time, not on blocked time (IO latency is noisy), so
    # the tuner kept what it measured before: a count's best throughput from the fast phase (1 worker:
    # 800 samples/s) held it at 1 worker through the slow phase for good (200 samples/s where 4 workers
    # give 800), and a slow phase's figures at 2 workers kept it at 3 where 2 keep up.
    from predictor.bank import PredictorBank
    from predictor.curve import ThroughputCurve

    cpus = 2.0
    tuner = autotune.AutoTuner(cpus=cpus, cap=autotune.worker_cap(cpus, None), current=2,
                               bank=PredictorBank(prior="default"))
    for b in phases:
        knee = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=0.001,
                               blocked_s_per_batch=b).knee_workers(cpus)
        seen = []
        for _ in range(30):
            tuner.window(simulated_window(tuner.current, cpus, c=0.001, b=b))
            seen.append(tuner.current)
        assert tuner.current == knee, (b, knee, seen, tuner.history)
        assert len(set(seen[15:])) == 1, (b, seen)          # it got there within ~30 s and stayed


def test_tuner_follows_the_cpus_it_may_use_when_they_change():
    # a CPU-bound job (knee 6 workers on 8 CPUs, 2 on 2) whose CPUs are cut to 2 and given back, as a
    # Kubernetes in-place resize or a moved cpuset does while it runs. What was measured on 8 CPUs
    # is no evidence on 2: kept, 2 workers' 8-CPU throughput (below 6 workers' on 2) read as
    # "measured worse there" and held 6 workers on 2 CPUs.
    from predictor.bank import PredictorBank
    from predictor.curve import ThroughputCurve

    tuner = autotune.AutoTuner(cpus=8.0, cap=autotune.worker_cap(8.0, None), current=1,
                               bank=PredictorBank(prior="default"))
    for cpus in (8.0, 2.0, 8.0):
        if cpus != tuner.cpus:
            assert tuner.cpus_changed(cpus, autotune.worker_cap(cpus, None)) is None   # under the cap: no shed
        knee = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=0.06,
                               blocked_s_per_batch=0.0).knee_workers(cpus)
        seen = []
        for _ in range(30):
            tuner.window(simulated_window(tuner.current, cpus, c=0.06))
            seen.append(tuner.current)
        assert tuner.current == knee, (cpus, knee, seen, tuner.history)
        assert len(set(seen[12:])) == 1, (cpus, seen)
    # a cap below the count in force is shed at once
    assert tuner.cpus_changed(0.5, autotune.worker_cap(0.5, None)) == 4 and tuner.current == 4


def test_the_tuner_thread_reads_the_cpus_again_every_window(monkeypatch):
    cpus = [16.0]
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: cpus[0])

    class Loader:
        num_workers, max_workers = 12, None
        t = 0

        def stats(self):            # no step finishes: no window for the curve, only the CPUs move it
            self.t += 1
            return _totals(0, 0, 0, self.num_workers, float(self.t))

        def resize(self, n):
            self.num_workers = n

        def worker_pids(self):
            return []

    lo = Loader()
    autotune.attach(lo, window_s=0.02)
    try:
        wait_for(lambda: autotune.tuner_of(lo) is not None and autotune.tuner_of(lo).n_windows >= 2,
                 what="two windows")
        assert autotune.tuner_of(lo).cpus == 16.0
        cpus[0] = 2.0                      # cap 8: 12 workers are shed at once
        wait_for(lambda: autotune.tuner_of(lo).cpus == 2.0 and lo.num_workers == 8, what="the new CPUs")
        assert autotune.tuner_of(lo).cap == autotune.worker_cap(2.0, None)
    finally:
        autotune.detach(lo)


class _SimulatedLoader:
    """A loader whose ``stats()`` totals grow by one ``simulated_window`` at its current worker count per
    call; the calls numbered in ``absurd`` add a step of ~31 years (past the observation limits)."""
    max_workers = None

    def __init__(self, workers, cpus, absurd=()):
        self.num_workers, self.cpus, self.absurd, self.calls = workers, cpus, set(absurd), 0
        self.totals = _totals(0, 0, 0, workers, 0.0)

    def stats(self):
        self.calls += 1
        t = self.totals
        if self.calls > 1:
            o = simulated_window(self.num_workers, self.cpus, **getattr(self, "simulate", {}))
            n = o.steps
            t["steps"] += n
            t["samples"] += n * o.batch_size
            t["batches"] += n
            t["uptime_s"] += o.duration_s
            t["data_wait_s"] += n * o.data_wait_s_per_step
            t["compute_s"] += n * o.compute_s_per_step + (1e9 if self.calls in self.absurd else 0.0)
            t["worker_cpu_s"] += n * o.cpu_s_per_batch
            t["worker_wall_s"] += n * o.wall_s_per_batch
            t["worker_runq_s"] += n * o.runq_s_per_batch
            t["worker_blocked_s"] += n * o.blocked_s_per_batch
        t["workers"] = t["live_workers"] = self.num_workers
        return dict(t)

    def resize(self, n):
        self.resized_to = getattr(self, "resized_to", []) + [n]      # (before num_workers: tests wait on that)
        self.num_workers = n
        self.totals["resizes"] += 1

    def worker_pids(self):
        return []


def test_a_window_the_observation_limits_refuse_is_skipped_not_the_end_of_tuning(monkeypatch):
    """An absurd window (here a step of ~31 years: the observation limits refuse it with BadObservation)
    raised out of observation_from_totals and stopped the tuner's thread for good. It is skipped: the
    tuner goes on with the next windows and still moves a starved job's worker count."""
    a, b = _totals(10, 80, 10, 2, 1.0, compute=0.5), _totals(30, 240, 30, 2, 3.0, compute=1e9)
    assert autotune.observation_from_totals(a, b, cores=1.5) is None
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: 4.0)
    lo = _SimulatedLoader(1, 4.0, absurd={2})     # the first window is absurd
    autotune.attach(lo, window_s=0.02)
    try:
        wait_for(lambda: lo.num_workers > 1, what="a move after the absurd window")
        # the tuner's first recorded move is the loader's first resize (not its count now: the tuner may
        # have moved again since the wait saw the first one)
        assert autotune.tuner_of(lo) is not None and autotune.tuner_of(lo).history[0][1] == lo.resized_to[0]
    finally:
        autotune.detach(lo)


def test_a_resize_warning_made_an_error_does_not_stop_the_tuner(monkeypatch):
    """Under ``python -W error`` the loader's warning that an IterableDataset resizes at the next epoch
    is an exception: raised through the tuner's ``loader.resize``, it stopped the tuner's thread. The
    resize is done when the loader warns: the tuner goes on."""
    import warnings

    class WarnsOnResize(_SimulatedLoader):
        def resize(self, n):
            super().resize(n)
            warnings.warn(f"adloader: resize({n}) on an IterableDataset takes effect at the next epoch")

    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: 4.0)
    lo = WarnsOnResize(1, 4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autotune.attach(lo, window_s=0.02)
        try:
            wait_for(lambda: lo.num_workers > 1, what="the first move")
            moved_at = autotune.tuner_of(lo).history[0][0]
            wait_for(lambda: (t := autotune.tuner_of(lo)) is not None and t.n_windows >= moved_at + 4,
                     what="windows after the move (the tuner's thread alive)")
        finally:
            autotune.detach(lo)


def test_the_tuner_follows_an_affinity_the_training_process_sets_after_it_started():
    """``os.sched_setaffinity(0, {cpu})`` in the training script sets its main thread's mask; the tuner's
    thread, started before, kept its own, and the tuner read that one (2 CPUs for a process pinned to
    1). It reads the process's (main thread's) mask. The workers its resizes start run on that mask
    too, as every worker does whichever thread starts it: the pool's doing (adloader._affinity;
    tests/test_loader.py, test_a_worker_runs_on_the_training_process_cpu_mask_*)."""
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        pytest.skip("needs at least 2 CPUs in this process's affinity mask")
    one = {min(mask)}

    class Loader(_SimulatedLoader):
        pinned = False

        def stats(self):                # no step before the pin: the tuner cannot move before it
            return super().stats() if self.pinned else dict(self.totals)

        def resize(self, n):
            self.resized.append(n)
            super().resize(n)

    lo = Loader(1, 1.0)
    lo.resized = []
    lo.simulate = dict(c=0.001, b=0.05)          # IO-bound: the tuner grows it, also on 1 CPU
    autotune.attach(lo, window_s=0.02)           # (its thread started with the whole mask)
    try:
        os.sched_setaffinity(0, one)
        lo.pinned = True
        wait_for(lambda: lo.resized, what="a resize after the pin")
        tuner = autotune.tuner_of(lo)
        assert tuner.cpus == 1.0 and tuner.cap == autotune.worker_cap(1.0, None), (tuner.cpus, tuner.cap)
    finally:
        autotune.detach(lo)
        os.sched_setaffinity(0, mask)


@pytest.mark.parametrize("seed", range(8))
def test_tuner_settles_when_noise_moves_the_knee_back_and_forth(seed):
    # an IO-bound job under half a CPU whose knee sits on a flat stretch (3 workers reach 98% of the
    # ceiling, 4 all of it), measured with the noise a CFS quota gives 1 s windows: CPU per batch +-25%,
    # throughput +-10%. The curve's knee then flips between 3 and 4 from window to window; the tuner may
    # turn back once or twice, but each turn doubles the gain it needs, so it stops (before the
    # reversal rule it hopped 3 <-> 4 up to 13 times in 200 windows).
    import dataclasses
    import random

    from predictor.bank import PredictorBank

    rng = random.Random(seed)
    tuner = autotune.AutoTuner(cpus=0.5, cap=autotune.worker_cap(0.5, None), current=1,
                               bank=PredictorBank(prior="default"))
    for _ in range(200):
        o = simulated_window(tuner.current, 0.5, g=0.03, c=0.012 * rng.uniform(0.8, 1.25), b=0.08, bs=16, dur=1.0)
        tuner.window(dataclasses.replace(o, samples_per_s=o.samples_per_s * rng.uniform(0.9, 1.1)))
    assert tuner.current in (3, 4), tuner.history
    assert sum(tuner.reversals.values()) <= 2, (tuner.reversals, tuner.history)
    assert len(tuner.history) <= 6, tuner.history


def test_initial_workers_and_cap():
    class L:
        max_workers = None
    n = autotune.initial_workers(L())
    assert 1 <= n <= math.floor(autotune.usable_cpus() + 1e-9) or n == 1
    L.max_workers = 1
    assert autotune.initial_workers(L()) == 1


def test_initial_workers_share_the_cpus_among_the_jobs_ranks_on_the_node(monkeypatch):
    class L:
        max_workers = None
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: 48.0)
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    assert autotune.initial_workers(L()) == 48
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert autotune.initial_workers(L()) == 12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")              # torchrun's figure first
    assert autotune.initial_workers(L()) == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")             # more ranks than CPUs: one worker each
    assert autotune.initial_workers(L()) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")          # unreadable: the next source
    assert autotune.initial_workers(L()) == 12
    L.max_workers = 5
    assert autotune.initial_workers(L()) == 5
    assert autotune.worker_cap(2.0, None) == 8
    assert autotune.worker_cap(2.0, 3) == 3


def test_node_gpu_count_reads_the_drivers_gpu_directory(tmp_path):
    for pci in ("0000:18:00.0", "0000:3b:00.0", "0000:86:00.0"):
        (tmp_path / pci).mkdir()
    (tmp_path / "not-a-gpu").write_text("")
    assert autotune.node_gpu_count(str(tmp_path)) == 3
    assert autotune.node_gpu_count(str(tmp_path / "missing")) == 0     # no driver: unknown


def test_gpu_part_is_the_jobs_gpus_over_the_nodes():
    part = autotune.gpu_part
    assert part({"CUDA_VISIBLE_DEVICES": "5"}, node_gpus=8) == 1 / 8
    assert part({"CUDA_VISIBLE_DEVICES": "2,3"}, node_gpus=8, ranks=2) == 2 / 8
    # a launcher that shows each of the job's 4 ranks its own GPU: the job has 4
    assert part({"CUDA_VISIBLE_DEVICES": "1"}, node_gpus=8, ranks=4) == 4 / 8
    assert part({"SLURM_JOB_GPUS": "0,1"}, node_gpus=4) == 2 / 4
    assert part({}, node_gpus=8) == 1.0                                 # names none: sees them all
    assert part({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, node_gpus=8) == 1.0
    assert part({"CUDA_VISIBLE_DEVICES": "0"}, node_gpus=0) == 1.0      # no driver: unknown
    assert part({"CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b,MIG-c"}, node_gpus=2) == 1.0   # never above 1


def _shared_gpu_node(monkeypatch, tmp_path, gpus: int, cpus: int) -> None:
    """A node of ``cpus`` CPUs, all usable by this process, whose driver shows ``gpus`` GPUs (a fake
    /proc/driver/nvidia/gpus); no launcher's rank count, no Slurm GPUs."""
    for i in range(gpus):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    monkeypatch.setattr(autotune, "NVIDIA_GPUS_DIR", str(tmp_path))
    monkeypatch.setattr(autotune.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: float(cpus))
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)


def test_initial_workers_take_the_jobs_gpu_part_of_a_node_nobody_partitioned(monkeypatch, tmp_path):
    """One process with 1 of 8 GPUs on a shared 48-CPU node starts at 6 workers, not 48; where a
    scheduler gave the process CPUs of its own (a cpuset, a quota), those are its part already."""
    class L:
        max_workers = None
    _shared_gpu_node(monkeypatch, tmp_path, gpus=8, cpus=48)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert autotune.initial_workers(L()) == 6
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")                          # 12 CPUs for the job, 6 a rank
    assert autotune.initial_workers(L()) == 6
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")                            # every GPU: the whole node
    assert autotune.initial_workers(L()) == 24
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: 12.0)   # a cpuset of 12: its own part
    assert autotune.initial_workers(L()) == 12


def test_a_dropped_loader_is_collected_and_its_tuner_thread_ends():
    # the tuner holds its loader weakly: a loader the script drops without close() is collected
    # (before, the thread kept it alive, and kept tuning it, for the life of the process)
    import gc
    import threading
    import weakref

    class Loader:
        num_workers, max_workers = 1, None

        def stats(self):
            return _totals(0, 0, 0, 1, 1.0)

        def resize(self, n):
            self.num_workers = n

    def tuner_threads():
        return {t for t in threading.enumerate() if t.name == "adloader-autotune"}

    before = tuner_threads()
    lo = Loader()
    autotune.attach(lo, window_s=0.02)
    ours = tuner_threads() - before
    assert len(ours) == 1
    ref = weakref.ref(lo)
    del lo
    gc.collect()
    assert ref() is None
    ours.pop().join(2.0)
    assert not (tuner_threads() - before)


class _OneCurveBank:
    """A bank whose curve is fixed: what the predictor said in a CI run that moved a CPU-bound job."""

    def __init__(self, curve):
        self.c = curve

    def observe(self, job, obs):
        pass

    def curve(self, job):
        return self.c

    def phase_changes(self, job):
        return 0


@pytest.mark.parametrize("configs,grows", [(1, False), (2, True)])
def test_tuner_does_not_grow_on_the_priors_term_ratio_alone(configs, grows):
    # A CPU-bound job on one CPU (c = 12.9 ms, b = 0.13 ms per batch): measured at 1 worker only, the
    # prior put 0.929 on the worker term and 0.981 on the core term, so the curve promised +5.6% for a
    # second worker that first principles say gains 1% (b / c). From one configuration the job's windows
    # cannot tell the two corrections apart; the tuner must stay. With the ratio learned from two of
    # the job's own configurations it is the job's evidence, and the tuner acts on it.
    from predictor.curve import ThroughputCurve

    curve = ThroughputCurve(job="self", batch_size=16, compute_s_per_step=0.0052, cpu_s_per_batch=0.0129,
                            blocked_s_per_batch=0.00013, correction=0.929, core_correction=0.981,
                            observed_configs=configs)
    tuner = autotune.AutoTuner(cpus=1.0, cap=4, current=1, bank=_OneCurveBank(curve))
    for _ in range(6):
        tuner.window(simulated_window(tuner.current, 1.0, g=0.0052, c=0.0129, b=0.00013, bs=16, dur=1.0))
    assert (tuner.current > 1) == grows, tuner.history


def test_an_auto_loader_on_a_shared_gpu_node_starts_at_its_gpus_part(monkeypatch, tmp_path):
    """The real ``adloader.DataLoader``: ``num_workers="auto"`` with 1 of 4 GPUs (the driver's GPU
    directory faked, CUDA_VISIBLE_DEVICES set) on an 8-CPU node nobody partitioned starts at 2 workers
    and delivers every sample once, in order; naming no GPU it starts at 8 (max_workers 8)."""
    import torch

    from adloader import DataLoader

    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.tensor([i])

    _shared_gpu_node(monkeypatch, tmp_path, gpus=4, cpus=8)
    monkeypatch.setenv("ADLOADER_DISABLE", "1")          # no agent client: the loader's own start
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    dl = DataLoader(Ids(), batch_size=4, num_workers="auto", max_workers=8)
    try:
        assert dl.num_workers == 2 and dl.requested_workers == 2
        assert torch.cat(list(dl)).flatten().tolist() == list(range(16))
    finally:
        dl.close()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    dl = DataLoader(Ids(), batch_size=4, num_workers="auto", max_workers=8)
    try:
        assert dl.num_workers == 8
    finally:
        dl.close()


def _ids_on_two_cpus(monkeypatch):
    """A 64-item dataset class, with the loader and the tuner seeing 2 CPUs and the whole node's GPUs."""
    import torch

    from adloader import dataloader

    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.tensor([i])

    monkeypatch.setattr(dataloader, "_available_cpus", lambda: 2)
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: 2.0)
    monkeypatch.setattr(autotune, "gpu_part", lambda *a, **k: 1.0)
    return Ids


def test_an_auto_loader_without_max_workers_grows_an_io_bound_job_past_its_cpus(monkeypatch):
    """The real ``adloader.DataLoader`` with ``num_workers="auto"`` and no ``max_workers`` on 2 CPUs, tuned
    on the windows of an IO-bound job (50 ms blocked, 1 ms CPU a batch, 10 ms step: 5 workers keep up).
    The loader's default bound was its CPUs, below the tuner's own (4 workers per CPU: blocked time needs
    workers, not cores): the job was held at 2 workers, its CPUs idle and its GPU waiting 60% of the
    time. A fixed ``num_workers`` keeps the CPUs as its default bound."""
    from adloader import DataLoader
    from predictor.curve import ThroughputCurve

    Ids = _ids_on_two_cpus(monkeypatch)
    monkeypatch.setenv("ADLOADER_DISABLE", "1")
    knee = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=0.001,
                           blocked_s_per_batch=0.05).knee_workers(2.0)
    assert knee == 5
    dl = DataLoader(Ids(), batch_size=8, num_workers="auto")
    try:
        assert dl.num_workers == 2
        tuner = autotune._Thread(dl, 2.0, 1.0).tuner      # the thread's tuner for this loader (not started)
        for _ in range(30):
            want = tuner.window(simulated_window(tuner.current, 2.0, g=0.01, c=0.001, b=0.05))
            if want is not None:
                tuner.current = dl.resize(want)            # what the loader takes of it
        assert tuner.current == knee, tuner.history
    finally:
        dl.close()
    fixed = DataLoader(Ids(), batch_size=8, num_workers=1)
    assert fixed.max_workers == 2
    fixed.close()


@pytest.mark.parametrize("cpu_used,grows", [(1.0, False), (0.97, False), (0.5, True), (None, True)])
def test_tuner_does_not_grow_a_job_that_already_used_all_its_cpus(cpu_used, grows):
    # One CPU, one worker, 5% of each batch's wall time neither CPU nor run-queue wait: real IO, or the
    # CPU taken from the worker by interrupts or the hypervisor (on one CPU both read as blocked). The
    # curve says a second worker gains b / c. When the job's own processes used that CPU whole in the
    # window, there is nothing for a second worker to run on: stay. When a neighbour had half of it, or
    # the use is unknown, the curve decides (it grows).
    from predictor.curve import ThroughputCurve

    c, b = 0.0129, 0.0129 * 0.05
    curve = ThroughputCurve(job="self", batch_size=16, compute_s_per_step=0.0052, cpu_s_per_batch=c,
                            blocked_s_per_batch=b, observed_configs=1)
    tuner = autotune.AutoTuner(cpus=1.0, cap=4, current=1, bank=_OneCurveBank(curve), cpu_used=cpu_used)
    for _ in range(6):
        tuner.window(simulated_window(tuner.current, 1.0, g=0.0052, c=c, b=b, bs=16, dur=1.0))
    assert (tuner.current > 1) == grows, tuner.history


def test_tuner_still_sheds_when_its_cpus_are_used():
    # the saturation rule holds growth only: a count above the knee is still shed
    from predictor.curve import ThroughputCurve

    curve = ThroughputCurve(job="self", batch_size=16, compute_s_per_step=0.0052, cpu_s_per_batch=0.0129,
                            blocked_s_per_batch=0.0, observed_configs=2)
    tuner = autotune.AutoTuner(cpus=1.0, cap=4, current=3, bank=_OneCurveBank(curve), cpu_used=1.0)
    for _ in range(6):
        tuner.window(simulated_window(tuner.current, 1.0, g=0.0052, c=0.0129, b=0.0, bs=16, dur=1.0))
    assert tuner.current == 1, tuner.history


@pytest.mark.parametrize("trainer_s", [0.0, 0.0007, 0.003])
def test_a_busy_trainer_never_makes_the_tuner_want_more_workers_than_its_curve(trainer_s):
    # A CPU-bound job on 2 CPUs that neighbours share (measured on the loaded 2-CPU dev VM: c = 17 ms a
    # batch, 0.5 of the 2 CPUs used): its own windows put both corrections at 0.275, so the curve has
    # the loader at most 0.275 x 2 / c, reached with 2 workers. The shared-CPU model (a trainer busy
    # past TRAINER_BUSY_MIN of its step: 8% here) has no core-bound term: it read the correction as
    # slow workers on idle CPUs and wanted 7, so a trainer using 0.7 ms of a 9-ms step took the job
    # from 2 workers to 4, then 7. Sharing the CPUs with the trainer can only cost throughput.
    from predictor.curve import ThroughputCurve

    g, c, b = 0.0089, 0.0172, 0.0005
    curve = ThroughputCurve(job="self", batch_size=8, compute_s_per_step=g, cpu_s_per_batch=c, blocked_s_per_batch=b,
                            correction=0.275, core_correction=0.275, observed_configs=2)
    tuner = autotune.AutoTuner(cpus=2.0, cap=8, current=2, bank=_OneCurveBank(curve), trainer_cpu_s_per_step=trainer_s)
    assert all(tuner.predict(curve, w) <= curve.throughput(w, 2.0) * (1 + 1e-9) for w in range(1, 9))
    for _ in range(8):
        tuner.window(simulated_window(tuner.current, 2.0, g=g, c=c, b=b))
    assert tuner.current <= curve.knee_workers(2.0) == 2, tuner.history


def test_processes_cpu_sums_the_cpu_of_processes_read_at_both_ends():
    import subprocess
    import sys
    import time

    import psutil

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    late = None
    try:
        ticks = iter([10.0, 12.0, 13.0])
        meter = autotune.ProcessesCpu(clock=lambda: next(ticks))
        assert meter.read([busy.pid, idle.pid, 999999999]) is None          # the first read: no window yet
        start = psutil.Process(busy.pid).cpu_times()
        while sum(psutil.Process(busy.pid).cpu_times()[:2]) - sum(start[:2]) < 0.3:
            time.sleep(0.05)
        late = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        used = meter.read([busy.pid, idle.pid, late.pid])
        # the busy one's CPU over the 2-s (fake) window; the idle one adds ~0; the late one is not counted
        assert 0.3 / 2.0 <= used <= 0.3 / 2.0 + 0.5, used
        idle.kill(); idle.wait()
        busy.kill(); busy.wait()
        assert meter.read([busy.pid, idle.pid]) is None                    # both gone: nothing read at both ends
    finally:
        for p in (busy, idle, late):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


class _Rows:
    """A dataset as ``loader_signature`` sees one: a type and a length."""

    def __len__(self):
        return 640


class _OtherRows(_Rows):
    pass


class _EpochLoader(_SimulatedLoader):
    """A simulated IO-bound job (50 ms blocked, 1 ms CPU a batch, 10 ms step: 5 workers keep up on 2
    CPUs) that looks like a DataLoader over ``dataset`` to ``loader_signature``."""
    batch_size, collate_fn, worker_init_fn = 8, None, None
    simulate = {"g": 0.01, "c": 0.001, "b": 0.05}

    def __init__(self, dataset, workers, cpus=2.0):
        super().__init__(workers, cpus)
        self.dataset = dataset


def test_a_new_auto_loader_over_the_same_data_starts_where_the_last_one_was_tuned(monkeypatch):
    """A script that builds a new ``num_workers="auto"`` loader every epoch: each one started from
    ``initial_workers`` with an empty curve, and an epoch shorter than the climb never reached the count.
    The next loader over the same data (dataset type and length, batch size, collate and init functions)
    starts at the count the last one was tuned to, with a copy of what it measured; a loader over other
    data, or on other CPUs, starts afresh."""
    from predictor.curve import ThroughputCurve

    cpus = [2.0]
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a, **k: cpus[0])
    monkeypatch.setattr(autotune, "gpu_part", lambda *a, **k: 1.0)
    monkeypatch.setattr(autotune, "_carry", {})
    knee = ThroughputCurve(job="t", batch_size=8, compute_s_per_step=0.01, cpu_s_per_batch=0.001,
                           blocked_s_per_batch=0.05).knee_workers(2.0)
    ds = _Rows()
    first = _EpochLoader(ds, 1)
    fresh = autotune.initial_workers(first)
    assert fresh == 2 and knee == 5                   # nothing carried yet: one worker per CPU
    autotune.attach(first, window_s=0.02)
    try:
        wait_for(lambda: first.num_workers == knee and autotune.tuner_of(first).windows_here >= 2,
                 what=f"the first loader tuned to {knee} workers")
        first_tuner = autotune.tuner_of(first)
    finally:
        autotune.detach(first)
    learned = dict(autotune._carry[autotune.loader_signature(first)].tuner.measured)
    assert {1, knee} <= set(learned)

    second = _EpochLoader(ds, 0)
    assert autotune.initial_workers(second) == knee
    second.num_workers = knee                         # (what the DataLoader starts at)
    autotune.attach(second, window_s=0.02)
    try:
        t = autotune.tuner_of(second)
        assert t is not None and t.measured == learned and t.current == knee and t.windows_here == 0
        assert t is not first_tuner                     # a copy: the first loader's tuner is its own
        assert autotune._carry[autotune.loader_signature(second)] is autotune._tuners[id(second)]   # the latest
        wait_for(lambda: t.windows_here >= 3, what="three windows of the second loader")
        assert second.num_workers == knee and second.totals["resizes"] == 0   # no climb again
    finally:
        autotune.detach(second)
    # other data (another dataset type, or the same type of another length) or other CPUs: afresh
    assert autotune.initial_workers(_EpochLoader(_OtherRows(), 0)) == fresh
    cpus[0] = 4.0
    assert autotune.initial_workers(_EpochLoader(ds, 0)) == 4


def test_the_real_auto_loader_starts_from_the_count_its_predecessor_was_tuned_to(monkeypatch):
    """The same through ``adloader.DataLoader``: a second ``num_workers="auto"`` loader over the same
    dataset and batch size starts at the count the first one's tuner reached; one with another batch
    size does not."""
    from adloader import DataLoader

    Ids = _ids_on_two_cpus(monkeypatch)
    monkeypatch.setattr(autotune, "_carry", {})
    monkeypatch.setenv("ADLOADER_DISABLE", "1")
    ds = Ids()
    dl = DataLoader(ds, batch_size=8, num_workers="auto")
    try:
        assert dl.num_workers == 2
        thread = autotune._Thread(dl, 2.0, 1.0)           # the thread's tuner for this loader (not started)
        for _ in range(30):
            want = thread.tuner.window(simulated_window(thread.tuner.current, 2.0, g=0.01, c=0.001, b=0.05))
            if want is not None:
                thread.tuner.current = dl.resize(want)
        assert thread.tuner.current == 5, thread.tuner.history
    finally:
        dl.close()
    again = DataLoader(ds, batch_size=8, num_workers="auto")
    other = DataLoader(ds, batch_size=16, num_workers="auto")
    try:
        assert again.num_workers == 5 and other.num_workers == 2
    finally:
        again.close()
        other.close()


def test_tuner_stops_adding_workers_that_only_queue_at_a_shared_source():
    """A loader reading a source that serves 100 batches/s however many workers ask (a shared disk's
    bandwidth), the GPU able to take 200: each added worker only waits longer at the source. Before the
    predictor's supply cap the tuner read every window's blocked time as a latency more workers would
    hide and grew to its cap of workers, each measured at the same throughput; now it stays within a
    worker of the one that reaches the source's rate."""
    from predictor.bank import PredictorBank

    cpus, g, c, rate, bs = 8.0, 0.005, 0.002, 100.0, 8

    def window(workers: int) -> Observation:
        bps = min(rate, workers / (c + 0.008), 1 / g, cpus / c)
        wall = max(workers / bps, c + 0.008)
        return Observation(workers=workers, cores=cpus, batch_size=bs, compute_s_per_step=g,
                           data_wait_s_per_step=max(0.0, 1 / bps - g), cpu_s_per_batch=c, wall_s_per_batch=wall,
                           runq_s_per_batch=0.0, blocked_s_per_batch=wall - c, samples_per_s=bps * bs,
                           duration_s=2.0, steps=int(bps * 2.0))

    tuner = autotune.AutoTuner(cpus=cpus, cap=autotune.worker_cap(cpus, None), current=1,
                               bank=PredictorBank(prior="default"))
    seen = []
    for _ in range(40):
        tuner.window(window(tuner.current))
        seen.append(tuner.current)
    assert tuner.cap >= 8 and max(seen) <= 3, seen      # 1 worker reaches 100 batches/s
