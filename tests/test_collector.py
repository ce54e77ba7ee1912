"""agent/collector.py: counters -> rates per rank (resets, smoothing), a job's ranks aggregated by
the max stall, NVML preferred to the client's estimate when present."""
from __future__ import annotations

import dataclasses
import os

import pytest

from agent.collector import Collector, RankRates
from agent.nvml import GpuSampler
from agent.registry import Registry
from agent.security import Peer
from tests.fakes import FakeNvml

pytestmark = pytest.mark.unit


def _totals(t, steps, wait, compute, batches=None, cpu=0.0, samples=None):
    return {"uptime_s": t, "steps": steps, "samples": samples if samples is not None else steps * 8,
            "batches": batches if batches is not None else steps, "data_wait_s": wait, "compute_s": compute,
            "worker_cpu_s": cpu, "worker_wall_s": cpu * 2, "worker_runq_s": 0.0, "worker_blocked_s": cpu}


def _two_rank_job() -> tuple[Collector, int]:
    """A job "j" of two ranks (this process's pid, one GPU each) registered, and its collector on 2 CPUs."""
    reg = Registry()
    me = os.getpid()
    for rank in (0, 1):
        reg.hello(Peer(os.getuid(), 0, me), b"id%d" % rank, {"job": "j", "rank": rank, "pid": me, "gpus": [str(rank)],
                                                           "batch_size": 8, "workers": 2}, 0.0)
    return Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1)), me


def test_rank_rates_from_counters_reset_and_smoothing():
    rr = RankRates()
    assert not rr.update(_totals(10, 100, 3, 7, cpu=5), 0.0)          # first report: baseline only
    assert rr.update(_totals(11, 120, 3.2, 7.8, cpu=5.5), 1.0)
    assert rr.rates["samples_per_s"] == pytest.approx(160)
    assert rr.rates["data_wait_s_per_step"] == pytest.approx(0.01)
    assert rr.rates["data_wait_frac"] == pytest.approx(0.2)
    assert rr.rates["cpu_s_per_batch"] == pytest.approx(0.025)
    assert rr.rates["worker_cpu_cores"] == pytest.approx(0.5)
    # a new loader in the same process: counters restart -> new baseline, no window, rates kept
    assert not rr.update(_totals(1, 5, 0.1, 0.1), 2.0)
    assert rr.rates["samples_per_s"] == pytest.approx(160)
    # a window twice as fast moves the smoothed figure part of the way (EWMA, tau 3 s)
    assert rr.update(_totals(2, 45, 0.1, 0.9), 3.0)
    assert 160 < rr.rates["samples_per_s"] < 320
    # a counter garbage value (negative, string) is clamped / ignored, never raises
    rr.update({"uptime_s": 3, "steps": "x", "samples": -4, "data_wait_s": None}, 4.0)


def test_a_figure_too_large_to_be_a_count_never_makes_a_rate_inf_or_nan():
    """A well-formed report whose totals are near a float's range (1.7e308 samples, two ranks at 1e308
    CPU seconds) over a short window: the difference over 0.06 s overflowed to an inf rate, the
    smoothing turned it into NaN at the next window, and NaN stayed in the job's figures for good, after
    the client went back to honest totals. Such a figure is taken as not reported."""
    import math

    col, me = _two_rank_job()
    for rank in (0, 1):
        col.on_report("j", rank, me, _totals(0, 0, 0, 0), 0.0)
        col.on_report("j", rank, me, dict(_totals(0.06, 1, 0.0, 0.05, cpu=1e308), samples=1.7e308), 0.06)
        col.on_report("j", rank, me, dict(_totals(1.06, 11, 0.1, 0.9, cpu=1e308), samples=1.7e308), 1.06)
        for t in (2.06, 3.06):                                          # honest again
            col.on_report("j", rank, me, _totals(t, 10 * t, 0.1 * t, 0.9 * t, cpu=0.4 * t), t)
    js = col.snapshot(4.0).jobs["j"]
    figures = {k: v for k, v in vars(js).items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in figures.values()), figures
    for rr in col.rank_rates.values():
        assert all(math.isfinite(v) for v in rr.rates.values()), rr.rates
    assert js.samples_per_s > 0 and js.cpu_s_per_batch > 0


def test_job_stats_aggregate_ranks_max_stall_and_count_the_jobs_batch_and_workers():
    """Two ranks of batch 8 (2 and 3 workers): the job's step stalls by its worst rank, and its loader is
    both ranks' together: a batch of 16 (one of each rank), 5 workers, each batch costing both ranks'
    CPU, so the curve's ceiling (batch over step) is the job's, as its summed samples/s are."""
    reg = Registry()
    me = os.getpid()
    for rank in (0, 1):
        reg.hello(Peer(os.getuid(), 0, me), b"id%d" % rank, {"job": "j", "rank": rank, "pid": me, "gpus": [str(rank)],
                                                           "batch_size": 8, "workers": 2 + rank}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))
    col.on_report("j", 0, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 1, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 0, me, _totals(1, 10, 0.1, 0.9, cpu=0.4), 1.0)    # 10% stall
    col.on_report("j", 1, me, _totals(1, 10, 0.5, 0.5, cpu=0.2), 1.0)    # 50% stall
    snap = col.snapshot(2.0)
    js = snap.jobs["j"]
    assert js.ranks == 2 and js.gpus == 2 and js.workers == 5
    assert js.batch_size == 16 and js.samples_per_step == pytest.approx(16) and js.window_steps == 10
    assert js.cpu_s_per_batch == pytest.approx(0.04 + 0.02)              # rank batches 0.04 and 0.02 CPU s
    assert js.samples_per_s / js.samples_per_step * js.cpu_s_per_batch == pytest.approx(js.worker_cpu_cores)
    assert js.data_wait_frac == pytest.approx(0.5)                        # max over ranks
    assert js.data_wait_s_per_step == pytest.approx(0.05)
    assert js.compute_s_per_step == pytest.approx(0.07)                   # mean over ranks
    assert js.samples_per_s == pytest.approx(160)                         # sum over ranks
    assert js.worker_cpu_cores == pytest.approx(0.6)
    assert js.gpu_idle_frac == pytest.approx(0.5) and js.gpu_idle_source == "client"
    assert snap.loader_cpus == 2.0 and snap.cpu_ids == (0, 1)


def test_steps_left_is_the_most_over_ranks_from_the_latest_reports_and_none_when_not_said():
    """A loader told its job's remaining steps reports ``steps_left``: the job's figure is the most over
    its ranks (the slowest rank finishes last), from each rank's latest report; a report without it
    (the hint withdrawn) or with a value that is no count (negative, not a number) says nothing."""
    col, me = _two_rank_job()
    col.on_report("j", 0, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 1, me, _totals(0, 0, 0, 0), 0.0)
    assert col.snapshot(0.5).jobs["j"].steps_left is None                 # nobody said
    col.on_report("j", 0, me, {**_totals(1, 10, 0.1, 0.9), "steps_left": 90}, 1.0)
    assert col.snapshot(1.5).jobs["j"].steps_left == 90                   # one rank said
    col.on_report("j", 1, me, {**_totals(1, 8, 0.1, 0.9), "steps_left": 92}, 1.0)
    assert col.snapshot(2.0).jobs["j"].steps_left == 92
    col.on_report("j", 1, me, {**_totals(2, 18, 0.2, 1.8), "steps_left": 82}, 2.0)
    assert col.snapshot(2.5).jobs["j"].steps_left == 90                   # rank 0's latest is the most now
    for bad in (-5, "many", float("nan"), True):
        col.on_report("j", 0, me, {**_totals(3, 20, 0.2, 1.8), "steps_left": bad}, 3.0)
        assert col.snapshot(3.5).jobs["j"].steps_left == 82, bad
    col.on_report("j", 1, me, _totals(3, 28, 0.3, 2.7), 3.0)             # the hint withdrawn
    assert col.snapshot(4.0).jobs["j"].steps_left is None


def test_away_s_is_the_least_over_ranks_from_their_latest_reports_and_0_when_not_said():
    """A job is away from its loader (``JobStats.away_s``) as long as its least-away rank: ranks step in
    lockstep, and one that steps keeps the job stepping. A rank that does not say (a client older than
    ``away_s``), or says something that is no duration, counts as stepping."""
    col, me = _two_rank_job()
    col.on_report("j", 0, me, {**_totals(0, 0, 0, 0), "away_s": 5.0}, 0.0)
    assert col.snapshot(0.5).jobs["j"].away_s == 0.0                      # rank 1 has not reported
    col.on_report("j", 1, me, {**_totals(0, 0, 0, 0), "away_s": 12.0}, 0.0)
    assert col.snapshot(0.5).jobs["j"].away_s == 5.0
    col.on_report("j", 0, me, {**_totals(1, 10, 0.1, 0.9), "away_s": 14.0}, 1.0)
    assert col.snapshot(1.5).jobs["j"].away_s == 12.0
    for bad in (-5, "long", float("inf"), None):
        col.on_report("j", 1, me, {**_totals(1, 10, 0.1, 0.9), "away_s": bad}, 1.0)
        assert col.snapshot(1.5).jobs["j"].away_s == 0.0, bad
    col.on_report("j", 1, me, _totals(2, 20, 0.2, 1.8), 2.0)             # an older client: never away
    assert col.snapshot(2.5).jobs["j"].away_s == 0.0


def test_away_cpu_is_what_the_ranks_used_inside_the_pause_not_the_smoothed_figure():
    """``JobStats.away_cpu_cores``: while away, the job's CPU from each rank's reports inside the pause (its
    client's ``job_cpu_s``, raw), the most over any 3 s of them, summed over ranks: 0.5 cores a rank when
    the smoothed ``job_cpu_cores`` still carries the 2 cores a rank of training before, and still 0.5 once
    squeezed to 0.1 (what the cores it lent leave it is not what it needs). None when not away, or over under
    ``AWAY_SPAN_MIN_S`` of reports inside the pause, or where a rank does not count it."""
    col, me = _two_rank_job()
    cpu = {0: 0.0, 1: 0.0}
    for t in range(0, 11):                              # training: 2 cores a rank
        for r in (0, 1):
            col.on_report("j", r, me, {**_totals(t, 10 * t, 0.1 * t, 0.9 * t), "job_cpu_s": cpu[r]}, float(t))
            cpu[r] += 2.0
    assert col.snapshot(10.5).jobs["j"].away_cpu_cores is None
    for k, t in enumerate((10.4, 11, 12, 13, 14)):     # away from t=10 (its last report): 0.5 cores a rank
        for r in (0, 1):
            cpu[r] += (0.5 * 0.4 - 2.0) if k == 0 else 0.5 * (0.6 if k == 1 else 1.0)
            col.on_report("j", r, me, {**_totals(t, 100, 1.0, 9.0), "job_cpu_s": cpu[r], "away_s": t - 10.0}, float(t))
        if k == 0:       # 0.4 s of reports inside the pause: under AWAY_SPAN_MIN_S
            assert col.snapshot(t + 0.1).jobs["j"].away_cpu_cores is None
    s = col.snapshot(14.5).jobs["j"]
    assert s.away_s == 4.0 and s.away_cpu_cores == pytest.approx(1.0)
    assert s.job_cpu_cores > 1.5                        # the smoothed figure, still decaying from 4 cores
    for t in range(15, 21):                             # squeezed by the neighbours it lent its cores: 0.1 a rank
        for r in (0, 1):
            cpu[r] += 0.1
            col.on_report("j", r, me, {**_totals(t, 100, 1.0, 9.0), "job_cpu_s": cpu[r], "away_s": t - 10.0}, float(t))
    s = col.snapshot(20.5).jobs["j"]
    assert s.away_cpu_cores == pytest.approx(1.0)       # the most over any 3 s of the pause, not its mean (0.52)
    assert s.job_cpu_cores < 0.5
    col.on_report("j", 1, me, {**_totals(21, 100, 1.0, 9.0), "away_s": 11.0}, 21.0)   # rank 1 stops counting
    assert col.snapshot(21.5).jobs["j"].away_cpu_cores is None


def test_a_steps_left_that_does_not_count_down_is_not_taken(caplog):
    """A job's ``steps_left`` is its claim, and the finish guard feeds the job with the most work left
    first. An honest loader's ``steps_left + steps`` stays put but when the job re-sets its count (a new
    ``fit``); a rank whose claim stays at 1000 as it steps is refused once that mark has risen three
    times in ``STEPS_LEFT_RESET_S`` (a warning says so), and taken again when the rises age out and it
    counts down. Two re-sets are taken; a new loader in the rank (its step counter back at 0) starts a
    new mark."""
    from agent.collector import STEPS_LEFT_RESET_S, STEPS_LEFT_RESETS

    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"id0", {"job": "j", "rank": 0, "pid": me, "gpus": ["0"],
                                                "batch_size": 8, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))

    def say(t, steps, left):
        col.on_report("j", 0, me, {**_totals(t, steps, 0.1 * steps, 0.9 * steps), "steps_left": left}, float(t))
        js = col.snapshot(t + 0.5).jobs["j"]
        assert js.steps_left_refused == (js.steps_left is None and left is not None)   # status shows it
        return js.steps_left

    assert STEPS_LEFT_RESETS == 2
    assert say(0, 0, 500) == 500
    assert say(1, 10, 490) == 490                      # counts down: the mark stays at 500
    assert say(2, 20, 800) == 800                      # a re-set (a new fit): taken
    assert say(3, 30, 790) == 790
    assert say(4, 40, 900) == 900                      # a second re-set: taken
    with caplog.at_level("WARNING", logger="agent.collector"):
        assert say(5, 50, 900) is None                 # the mark rose a third time: refused
        assert say(6, 60, 900) is None
        assert say(7, 70, 0) is None                   # at 0 it claims nothing, still refused
    assert [r.getMessage() for r in caplog.records if "does not count down" in r.getMessage()] == [
        "job j rank 0: its steps_left does not count down as it steps (steps_left + steps rose 3 times in 300 s): "
        "not taken until that ages out"]
    t = 6 + STEPS_LEFT_RESET_S + 1                     # every rise older than the window
    assert say(t, 80, 880) == 880                      # counts down from the last mark (960): taken again
    assert say(t + 1, 90, 870) == 870
    assert say(t + 2, 0, 5000) == 5000                 # a new loader (steps back at 0): a new mark, no rise
    assert say(t + 3, 10, 4990) == 4990
    # withdrawing the hint between claims does not start afresh: a claim back above the mark is a rise
    t += 10 + STEPS_LEFT_RESET_S
    for i, left in enumerate((4980, None, 6000, None, 7000, None, 8000)):
        got = say(t + i, 20 + 10 * i, left)
        assert got == (left if i < 6 else None), (i, got)


def test_collector_prefers_nvml_when_present():
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me, "gpus": ["1"]}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1), gpu_sampler=GpuSampler(FakeNvml()))
    col.on_report("j", 0, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 0, me, _totals(1, 10, 0.5, 0.5), 1.0)
    js = col.snapshot(1.0).jobs["j"]
    assert js.gpu_idle_frac == pytest.approx(0.10) and js.gpu_idle_source == "nvml" and js.data_wait_frac == 0.5



def _stat(path, busy_ticks: dict, idle_ticks: int = 1000) -> None:
    """A /proc/stat with one ``cpuN`` line per entry: user ticks = busy, idle = idle_ticks."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{c} {b} 0 0 {idle_ticks} 0 0 0 0 0 0" for c, b in busy_ticks.items()]
    (path / "stat").write_text("\n".join(lines) + "\nintr 0\n")


def _one_job_node(tmp_path):
    """(a /proc to write /proc/stat into, a registry holding job "j" as this process's rank 0, its pid)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me, "gpus": ["0"]}, 0.0)
    return proc, reg, me


def test_foreign_cpu_is_what_the_node_used_beyond_the_jobs_and_the_agent(tmp_path):
    """Node busy (the agent's CPUs in /proc/stat) over the snapshot interval, less the jobs' trainer and
    worker CPU and the agent's own: what other processes used. CPUs outside the agent's set do not
    count; the first snapshot has no rate yet (None)."""
    proc, reg, me = _one_job_node(tmp_path)
    own = iter([10.0, 10.1])                            # the agent: 0.1 s of CPU over the second interval
    col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(proc), own_cpu_s=lambda: next(own))
    col.on_report("j", 0, me, {**_totals(0, 0, 0, 0), "main_cpu_s": 0.0}, 0.0)
    col.on_report("j", 0, me, {**_totals(1, 10, 0.1, 0.9, cpu=0.6), "main_cpu_s": 0.3}, 1.0)
    _stat(proc, {0: 1000, 1: 2000, 2: 5000})
    first = col.snapshot(1.0)
    assert first.busy_cpu_cores is None and first.foreign_cpu_cores is None
    # one second later: cpu0 +100 ticks, cpu1 +100 ticks (2 cores busy), cpu2 (not ours) +100
    _stat(proc, {0: 1100, 1: 2100, 2: 5100})
    s = col.snapshot(2.0)
    assert s.busy_cpu_cores == pytest.approx(2.0)
    # jobs: 0.6 worker + 0.3 trainer cores; the agent 0.1 -> 1.0 core of others
    assert s.foreign_cpu_cores == pytest.approx(1.0)


def _pid_stats(proc, parents: dict) -> None:
    """/proc/<pid>/stat for each pid -> its parent (a command name with a space and parentheses)."""
    for pid, ppid in parents.items():
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (py (x) y) S {ppid} {pid} {pid} 0 -1 0 " + "0 " * 40 + "\n")


def test_a_rank_that_another_rank_started_is_counted_once_in_the_jobs_cpu(tmp_path):
    """Rank 1 a child of rank 0 (Lightning's DDP launcher starts the other local ranks from rank 0), rank 2
    its grandchild through a process that is no rank: rank 0's client counts its whole process tree
    (``adloader.proctree``), theirs included, so the job's ``job_cpu_cores`` and ``away_cpu_cores`` leave
    their own counts out: 3 cores, not 5. Where rank 0's client does not count its tree (an older one),
    theirs are the job's. Ranks that descend from none add up (``nested_ranks`` finds no descent)."""
    from agent.collector import nested_ranks

    proc = tmp_path / "proc"
    _pid_stats(proc, {4242: 1, 4243: 4242, 4244: 4242, 4245: 4244, 5000: 1})
    assert nested_ranks((4242, 4243, 4245), str(proc)) == {4243: 4242, 4245: 4242}
    assert nested_ranks((4243, 4245, 5000), str(proc)) == {} and nested_ranks((4242, 9999), str(proc)) == {}
    for tree in (True, False):
        reg = Registry()
        pids = {0: 4242, 1: 4243, 2: 4245}
        for rank, pid in pids.items():
            reg.hello(Peer(os.getuid(), 0, pid), b"id%d" % rank, {"job": "j", "rank": rank, "pid": pid,
                                                                 "gpus": [str(rank)], "batch_size": 8, "workers": 2}, 0.0)
        col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1), proc_root=str(proc))
        for t in range(0, 6):
            away = {"away_s": t - 2.0} if t > 2 else {}
            for rank, pid in pids.items():
                cores = 3.0 if rank == 0 else 1.0
                counts = {"job_cpu_s": cores * t} if tree or rank else {}
                col.on_report("j", rank, pid, {**_totals(t, 10 * min(t, 2), 0.1, 0.9), **away, **counts}, float(t))
        s = col.snapshot(5.5).jobs["j"]
        assert s.job_cpu_cores == pytest.approx(3.0 if tree else 2.0), tree
        assert s.away_s == 3.0 and s.away_cpu_cores == (pytest.approx(3.0) if tree else None), tree


def test_a_validation_pass_the_client_counts_is_the_jobs_cpu_not_other_processes(tmp_path):
    """The client's ``job_cpu_s`` (its process's CPU and every loader's workers: a validation pass, whose
    loop is out of the training loader, so its steps' CPU and its workers' are not there) is the job's:
    ``job_cpu_cores``, left out of the foreign figure. A client that does not say it: the steps' CPU and
    the workers' as before, and ``job_cpu_cores`` 0. More than the job's own figures is taken; less is not."""
    for i, (job_cpu, foreign, job_cores) in enumerate(((1.5, 0.4, 1.5), (None, 1.0, 0.0), (0.5, 1.0, 0.5))):
        (tmp_path / str(i)).mkdir()
        proc, reg, me = _one_job_node(tmp_path / str(i))
        own = iter([10.0, 10.1])
        col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(proc), own_cpu_s=lambda: next(own))
        extra = lambda x: {} if job_cpu is None else {"job_cpu_s": 100.0 + x}
        col.on_report("j", 0, me, {**_totals(0, 0, 0, 0), "main_cpu_s": 0.0, **extra(0.0)}, 0.0)
        col.on_report("j", 0, me, {**_totals(1, 10, 0.1, 0.9, cpu=0.6), "main_cpu_s": 0.3, **extra(job_cpu or 0)}, 1.0)
        _stat(proc, {0: 1000, 1: 2000})
        col.snapshot(1.0)
        _stat(proc, {0: 1100, 1: 2100})
        s = col.snapshot(2.0)
        # 2 cores busy, the agent 0.1: the job 1.5 (its count) -> 0.4 of others; or 0.9 (steps and workers)
        assert s.foreign_cpu_cores == pytest.approx(foreign), job_cpu
        assert s.jobs["j"].job_cpu_cores == pytest.approx(job_cores)
        assert s.jobs["j"].cpu_cores == pytest.approx(max(0.9, job_cores))


def test_foreign_cpu_is_never_negative_and_unknown_without_proc_stat(tmp_path):
    proc, reg, me = _one_job_node(tmp_path)
    col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(proc), own_cpu_s=lambda: 0.0)
    assert col.snapshot(0.0).foreign_cpu_cores is None                   # no /proc/stat at all
    col.on_report("j", 0, me, {**_totals(0, 0, 0, 0), "main_cpu_s": 0.0}, 0.0)
    col.on_report("j", 0, me, {**_totals(1, 10, 0.1, 0.9, cpu=1.5), "main_cpu_s": 0.5}, 1.0)
    _stat(proc, {0: 0, 1: 0})
    col.snapshot(1.0)
    _stat(proc, {0: 50, 1: 50})                          # the node says 1 core, the jobs 2: a lag, not -1
    assert col.snapshot(2.0).foreign_cpu_cores == 0.0


def test_a_departed_jobs_cpu_is_not_read_as_other_processes(tmp_path):
    """The node's busy figure is smoothed, the jobs' sum drops at once when one leaves: without counting
    the departed job's decaying CPU, each departure read as a tenant's and stopped the loaders' yield
    (dynamic bench: 0.46 "foreign" cores after the last departure)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    reg = Registry()
    me = os.getpid()
    for j, ident in (("j", b"a"), ("k", b"b")):
        reg.hello(Peer(os.getuid(), 0, me), ident, {"job": j, "rank": 0, "pid": me, "gpus": ["0"]}, 0.0)
    col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(proc), own_cpu_s=lambda: 0.0)
    busy = [0]

    def second(t, node_cores, jobs):
        for j in jobs:   # each job: 0.6 worker + 0.3 trainer cores
            col.on_report(j, 0, me, {**_totals(t, 10 * t, 0.1 * t, 0.9 * t, cpu=0.6 * t), "main_cpu_s": 0.3 * t}, t)
        busy[0] += int(round(node_cores * 100 / 2))
        _stat(proc, {0: busy[0], 1: busy[0]})
        return col.snapshot(float(t))

    for t in range(0, 6):                                   # both jobs and 0.2 core of others
        s = second(t, 2.0, ("j", "k"))
    assert s.foreign_cpu_cores == pytest.approx(0.2, abs=0.01)
    reg.bye(b"b", Peer(os.getuid(), 0, me), {"job": "k", "rank": 0})
    for t in range(6, 12):                                  # k gone: the node drops to 1.1 cores
        s = second(t, 1.1, ("j",))
        if t < 8:
            assert s.busy_cpu_cores > 1.5                   # the smoothed busy figure is still decaying
        assert s.foreign_cpu_cores == pytest.approx(0.2, abs=0.01), t


def test_held_foreign_cpu_is_the_least_over_the_last_seconds(tmp_path):
    """``foreign_held_cpu_cores``: None until the readings span FOREIGN_HOLD_S; a burst that rises and
    falls within the span leaves it low; a figure that stays up lifts it."""
    from agent.collector import FOREIGN_HOLD_S, Collector
    from agent.registry import Registry

    col = Collector(Registry(), loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(tmp_path))
    held = lambda t, f: col._held_foreign(t, f)
    assert held(0.0, 0.1) is None and held(1.0, 0.1) is None
    assert held(FOREIGN_HOLD_S, 0.1) == pytest.approx(0.1)
    for t, f in ((4.0, 0.6), (5.0, 0.8), (6.0, 0.5)):          # a burst: up for 2 s
        assert held(t, f) == pytest.approx(0.1), t
    assert held(7.0, 0.1) == pytest.approx(0.1)
    for t in (8.0, 9.0, 10.0):                                   # a tenant from t=8 on
        held(t, 0.9)
    assert held(11.0, 0.9) == pytest.approx(0.9)
    assert held(12.0, None) is None and held(13.0, 0.9) is None     # unknown: the span starts again


def test_a_starting_jobs_cpu_before_its_reports_is_not_read_as_other_processes(tmp_path):
    """A job's imports and set-up before its hello are CPU no report covers: without counting them each
    arrival read as 0.5-0.7 cores of other processes and stopped the loaders' yield (dynamic bench).
    Counted from the process's own CPU time (``/proc/<pid>/stat``), they decay out of the foreign figure
    as they decay out of the busy figure. (Between the hello and the first rates the job's CPU is still
    unreported: that shows at t=7 here, under the limit.)"""
    import agent.psi as psi

    proc = tmp_path / "proc"
    proc.mkdir()
    me = os.getpid()
    (proc / str(me)).mkdir()
    tck = psi.CLK_TCK
    boot = 1000.0

    def process(now, cpu_s, started):             # the new job's training process, as /proc shows it
        (proc / "uptime").write_text(f"{boot + now:.2f} 0.0\n")
        rest = ["R"] + ["0"] * 10 + [str(int(round(cpu_s * tck))), "0"] + ["0"] * 6 + [str(int((boot + started) * tck))]
        (proc / str(me) / "stat").write_text(f"{me} (python train.py) " + " ".join(rest) + "\n")

    reg = Registry()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me, "gpus": ["0"]}, 0.0)
    col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1), proc_root=str(proc), own_cpu_s=lambda: 0.0)
    busy = [0.0]
    process(0.0, 0.0, 0.0)          # (both jobs run in this test's process; j's start-up used nothing)

    def second(t, node_cores, reports):
        for j, pid, cores in reports:               # each reporting job: cores worker CPU, 0.1 trainer
            col.on_report(j, 0, pid, {**_totals(t, 10 * t, 0.1 * t, 0.9 * t, cpu=cores * t), "main_cpu_s": 0.1 * t}, t)
        busy[0] += node_cores * 100 / 2
        _stat(proc, {0: int(busy[0]), 1: int(busy[0])})
        return col.snapshot(float(t))

    for t in range(0, 6):                             # j: 0.9 cores; others 0.2
        s = second(t, 1.1, [("j", me, 0.8)])
    assert s.foreign_cpu_cores == pytest.approx(0.2, abs=0.01)
    # t=4..6: job n starts (imports: 1.6 s of CPU over 2 s), says hello at 6, reports from 7 (rates at 8)
    process(6.0, 1.6, 4.0)
    reg.hello(Peer(os.getuid(), 0, me), b"n", {"job": "n", "rank": 0, "pid": me, "gpus": ["0"]}, 6.0)
    busy[0] += 0.8 * 100 / 2 * 2                      # the node saw those 1.6 CPU-s (t=4..6) ...
    foreign = [second(6, 1.1, [("j", me, 0.8)]).foreign_cpu_cores]
    for t in (7, 8, 9, 10, 11):                      # ... then n runs at 0.5 cores (0.4 workers + 0.1 trainer)
        process(float(t), 1.6 + 0.5 * (t - 6), 4.0)
        reps = [("j", me, 0.8)] + ([("n", me, 0.4)] if t >= 7 else [])
        foreign.append(second(t, 1.6, reps).foreign_cpu_cores)
    assert max(foreign) < 0.45, foreign               # without the start-up: 0.65, 0.67 at t=6, 7
    # once n's rates count (in full at once, while the busy figure rises slowly) the figure errs low, towards
    # yielding, and climbs back to the other processes' 0.2
    assert all(f <= 0.25 for f in foreign[2:]) and foreign[2] < foreign[3] < foreign[4] < foreign[5], foreign


# -- the predictor's windows: raw totals between reports (settled_window) ---------------------------

def _report(recv_t, steps, *, wait_per_step=0.05, compute_per_step=0.15, workers=2, live=None, bs=8,
            cpu_per_batch=0.1):
    """A report at ``recv_t`` (agent and client clocks agree) after ``steps`` steps of a steady pace."""
    from agent.model import Report
    totals = {"steps": steps, "samples": steps * bs, "batches": steps, "data_wait_s": steps * wait_per_step,
              "compute_s": steps * compute_per_step, "worker_cpu_s": steps * cpu_per_batch,
              "worker_wall_s": steps * cpu_per_batch * 1.5, "worker_runq_s": steps * cpu_per_batch * 0.5,
              "worker_blocked_s": 0.0, "main_cpu_s": None, "main_runq_s": None}
    return Report(recv_t=recv_t, uptime_s=recv_t, totals=totals, workers=workers,
                  live_workers=workers if live is None else live)


def test_settled_window_is_total_time_over_total_steps_where_the_smoothed_figure_overstates_the_step():
    """Steps of 0.1 s and 0.3 s alternate second by second (a pace that varies with contention): the
    mean step is 2 s / 13 steps = 0.154 s. The smoothed per-step figure averages the windows' own
    step times (0.1 and 0.3) and reads about 0.2 s: the loader looked a quarter slower than it was."""
    from agent.collector import settled_window
    rr = RankRates()
    steps, compute = 1, 0.0                    # the loop's first step was taken before t = 0
    for t in range(7):
        if t:
            n = 10 if t % 2 else 3             # this second: n steps of 1/n s each
            steps, compute = steps + n, compute + 1.0
        rr.update({"uptime_s": float(t), "steps": steps, "samples": steps * 8, "batches": steps,
                   "data_wait_s": 0.0, "compute_s": compute, "worker_cpu_s": steps * 0.01,
                   "worker_wall_s": steps * 0.01, "worker_runq_s": 0.0, "worker_blocked_s": 0.0,
                   "workers": 2, "live_workers": 2}, float(t))
    w = settled_window((tuple(rr.history),), since=4.0, span_s=2.0, min_s=0.9)
    true_step = 2.0 / 13                      # (4, 6]: 10 steps, then 3, in 2 s
    assert w is not None and w.start_t == 4.0 and w.end_t == 6.0 and w.duration_s == pytest.approx(2.0)
    assert w.compute_s_per_step == pytest.approx(true_step)
    assert w.samples_per_s * w.compute_s_per_step / 8 == pytest.approx(1.0)    # consistent with the rate
    assert rr.rates["compute_s_per_step"] > 1.2 * true_step                    # what the smoothing said


def test_settled_window_never_spans_a_change_an_unfinished_resize_or_the_first_batch():
    from agent.collector import settled_window
    # the first report has no step yet (workers starting): the window begins at the first step
    hist = [_report(0.0, 0), _report(1.0, 4), _report(2.0, 9), _report(3.0, 14)]
    w = settled_window((tuple(hist),), since=-1.0, span_s=10.0, min_s=0.9)
    assert w.start_t == 1.0 and w.steps == 10
    assert w.compute_s_per_step == pytest.approx(0.15) and w.data_wait_s_per_step == pytest.approx(0.05)
    assert w.data_wait_s_per_step / (w.data_wait_s_per_step + w.compute_s_per_step) == pytest.approx(0.25)
    assert w.cpu_s_per_batch == pytest.approx(0.1) and w.runq_s_per_batch == pytest.approx(0.05)
    assert w.worker_cpu_cores == pytest.approx(0.5) and w.samples_per_s == pytest.approx(40.0)
    # never from before `since` (the last allocation change, or the end of the last window)
    assert settled_window((tuple(hist),), since=2.0, span_s=10.0, min_s=0.9).start_t == 2.0
    assert settled_window((tuple(hist),), since=2.5, span_s=10.0, min_s=0.9) is None     # 0 s left
    # the worker count changed at the report of t=2: the window starts there
    hist2 = [_report(1.0, 4, workers=4), _report(2.0, 9), _report(3.0, 14), _report(4.0, 19)]
    assert settled_window((tuple(hist2),), since=0.0, span_s=10.0, min_s=0.9).start_t == 2.0
    # a resize the loader has not finished (live workers != target) is not the new configuration
    hist3 = [_report(1.0, 4), _report(2.0, 9, live=3), _report(3.0, 14), _report(4.0, 19)]
    assert settled_window((tuple(hist3),), since=0.0, span_s=10.0, min_s=0.9).start_t == 3.0
    assert settled_window((tuple(hist3[:2]),), since=0.0, span_s=10.0, min_s=0.9) is None
    # at most span_s long when that holds enough steps ...
    long = [_report(float(t), 1 + 5 * t) for t in range(10)]
    w = settled_window((tuple(long),), since=0.0, span_s=3.0, min_s=0.9)
    assert w.start_t == 6.0 and w.steps == 15
    # ... longer for a slow job, until it holds min_steps steps; none when there are not that many
    slow = [_report(float(t), 1 + t // 2, compute_per_step=2.0) for t in range(8)]
    w = settled_window((tuple(slow),), since=0.0, span_s=3.0, min_s=0.9, min_steps=2)
    assert w.steps >= 2 and w.start_t <= 3.0
    assert settled_window((tuple(slow[:3]),), since=0.0, span_s=3.0, min_s=0.9, min_steps=2) is None


def test_settled_window_never_reaches_back_past_a_resume_from_a_pause():
    """The loop stopped (a validation pass, a checkpoint save) from t=3 to t=8 and resumed before the
    report of t=9 (the loader's ``paused_s`` rose there): a window reaching back over the stop held its
    seconds but none of its steps (3 s of which 2 were the stop: a third of the job's pace at its
    configuration). It starts at the report after the resume, once that holds enough."""
    from agent.collector import settled_window

    def rep(t, steps, paused):
        r = _report(float(t), steps)
        return dataclasses.replace(r, totals={**r.totals, "paused_s": paused})

    hist = [rep(t, 1 + 5 * min(t, 3), 0.0) for t in range(9)] + [rep(9, 21, 5.0), rep(10, 26, 5.0)]
    assert settled_window((tuple(hist[:-1]),), since=0.0, span_s=3.0, min_s=0.9) is None
    w = settled_window((tuple(hist),), since=0.0, span_s=3.0, min_s=0.9)
    assert w is not None and w.start_t == 9.0 and w.samples_per_s == pytest.approx(5 * 8)
    # a client without the counter: as before
    plain = [_report(float(t), 1 + 5 * t) for t in range(6)]
    assert settled_window((tuple(plain),), since=0.0, span_s=3.0, min_s=0.9).start_t == 2.0


def test_settled_window_ends_at_the_last_report_with_a_step():
    """The loop stopped after its report of t=5 (a validation pass, a debugger; the loader counts the
    stop only when it resumes): the reports of t=6..9 add seconds and no step. The window [4, 9] said the
    job delivered 5 steps in 5 s at its configuration, a fifth of its pace (5 a second); it ends at t=5,
    and after it, while the loop stands still, there is none."""
    from agent.collector import settled_window

    hist = [_report(float(t), 1 + 5 * min(t, 5)) for t in range(10)]
    w = settled_window((tuple(hist),), since=0.0, span_s=3.0, min_s=0.9)
    assert w is not None and w.end_t == 5.0 and w.samples_per_s == pytest.approx(5 * 8)
    assert settled_window((tuple(hist),), since=5.0, span_s=3.0, min_s=0.9) is None


def test_settled_window_aggregates_ranks_like_job_stats_and_needs_every_rank():
    from agent.collector import settled_window
    r0 = tuple(_report(float(t), 1 + 10 * t, wait_per_step=0.01, compute_per_step=0.09) for t in range(4))
    r1 = tuple(_report(float(t), 1 + 10 * t, wait_per_step=0.05, compute_per_step=0.05) for t in range(4))
    w = settled_window((r0, r1), since=0.0, span_s=3.0, min_s=0.9)
    assert w.data_wait_s_per_step == pytest.approx(0.05)          # max over ranks: a stall stalls all
    assert w.compute_s_per_step == pytest.approx(0.07)            # mean over ranks
    assert w.samples_per_s == pytest.approx(160.0)                # summed
    assert w.steps == 30 and w.workers == 4                      # the job's: both ranks' workers
    assert w.cpu_s_per_batch == pytest.approx(2 * 0.1)           # the job's batch: one of each rank
    assert w.samples_per_s / w.stats_fields(16)["samples_per_step"] * w.cpu_s_per_batch == pytest.approx(w.worker_cpu_cores)
    assert settled_window((r0, r1[:1]), since=0.0, span_s=3.0, min_s=0.9) is None


def test_job_stats_carry_each_ranks_recent_reports_and_a_restart_clears_them():
    from agent.collector import HISTORY_S
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"id0", {"job": "j", "rank": 0, "pid": me, "batch_size": 8, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))
    for t in range(40):
        col.on_report("j", 0, me, {**_totals(t, 10 * t, 0.1 * t, 0.9 * t), "workers": 2, "live_workers": 2}, float(t))
    (hist,) = col.snapshot(40.0).jobs["j"].history
    assert hist[-1].recv_t == 39.0 and hist[0].recv_t >= 39.0 - HISTORY_S and len(hist) > 20
    assert hist[-1].workers == 2 and hist[-1].live_workers == 2 and hist[-1].totals["steps"] == 390
    col.on_report("j", 0, me, _totals(1, 3, 0.0, 0.1), 40.0)           # a new loader: counters restart
    (hist,) = col.snapshot(41.0).jobs["j"].history
    assert len(hist) == 1 and hist[0].totals["steps"] == 3 and hist[0].live_workers is None


def test_a_ranks_allowed_cpus_are_read_again_when_they_change():
    """A rank's placement (its CPUs, when narrower than the agent's) is read again every
    ``PLACEMENT_REFRESH_S``: an operator's taskset while the job runs reaches the plans (before, the
    first reading held for the life of the process). Real affinity of this test's own process."""
    from agent.collector import PLACEMENT_REFRESH_S

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip(f"needs 2 CPUs in this process's affinity to narrow it, has {mine}")
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"id0", {"job": "j", "rank": 0, "pid": me, "gpus": ["0"],
                                                "batch_size": 8, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=tuple(mine))
    try:
        assert col.snapshot(1.0).jobs["j"].allowed_cpus == ()                 # every CPU: not narrower
        os.sched_setaffinity(0, {mine[0]})
        assert col.snapshot(1.0 + PLACEMENT_REFRESH_S / 2).jobs["j"].allowed_cpus == ()    # not read again yet
        assert col.snapshot(1.0 + PLACEMENT_REFRESH_S).jobs["j"].allowed_cpus == (mine[0],)
        os.sched_setaffinity(0, set(mine))
        assert col.snapshot(1.0 + 2 * PLACEMENT_REFRESH_S).jobs["j"].allowed_cpus == ()
    finally:
        os.sched_setaffinity(0, set(mine))


def test_a_jobs_cpu_quota_is_its_ranks_quotas_one_per_cgroup(tmp_path):
    """Each rank says its cgroup's CPU quota (a container's CPU limit; the agent cannot read it where the
    container has its own cgroup namespace); the job's is one per group its ranks are in (torchrun's ranks
    in one pod share one), summed over groups; a rank without a quota leaves the job unbounded; a report
    moves it (an in-place resize). Groups are told apart by /proc/<pid>/cgroup as the agent reads it."""
    import subprocess

    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    me, a, b = os.getpid(), kids[0].pid, kids[1].pid
    try:
        groups = {me: "0::/../../kubepods.slice/pod1/c1.scope\n", a: "0::/../../kubepods.slice/pod1/c1.scope\n",
                  b: "0::/../../kubepods.slice/pod2/c2.scope\n"}
        for pid, text in groups.items():
            (tmp_path / str(pid)).mkdir()
            (tmp_path / str(pid) / "cgroup").write_text(text)
        reg = Registry()
        for rank, pid in enumerate((me, a)):
            reg.hello(Peer(os.getuid(), 0, pid), b"id%d" % rank, {"job": "j", "rank": rank, "pid": pid,
                      "gpus": [str(rank)], "batch_size": 8, "workers": 2, "cpu_quota": 2.0}, 0.0)
        col = Collector(reg, loader_cpus=8.0, cpu_ids=tuple(range(8)), proc_root=str(tmp_path))
        assert col.snapshot(1.0).jobs["j"].cpu_quota_cores == 2.0        # one pod, one quota
        reg.hello(Peer(os.getuid(), 0, b), b"id2", {"job": "j", "rank": 2, "pid": b, "gpus": ["2"],
                  "batch_size": 8, "workers": 2, "cpu_quota": 1.5}, 2.0)
        assert col.snapshot(3.0).jobs["j"].cpu_quota_cores == 3.5        # another pod: its own quota too
        reg.report(b"id2", Peer(os.getuid(), 0, b), {"job": "j", "rank": 2, "pid": b, "worker_pids": [],
                   "stats": {}, "cpu_quota": None}, 4.0)
        assert col.snapshot(5.0).jobs["j"].cpu_quota_cores is None        # a rank with no quota: unbounded
        reg.report(b"id2", Peer(os.getuid(), 0, b), {"job": "j", "rank": 2, "pid": b, "worker_pids": [],
                   "stats": {}, "cpu_quota": "lots"}, 6.0)                 # nonsense: ignored, as no quota
        assert reg.jobs["j"].ranks[2].cpu_quota is None
    finally:
        for k in kids:
            k.kill()
            k.wait()


# -- a window's own batch size: samples over steps (window_batch_size) -------------------------------

def test_a_windows_batch_size_is_its_samples_over_its_steps_and_refused_with_the_reason_where_absurd():
    from agent.collector import BATCH_SIZE_DISAGREE, window_batch_size
    assert window_batch_size(325.0, 10.0, 1, 33) == (32.5, True, "")     # a wobbling sampler: the exact mean
    assert window_batch_size(640.0, 10.0, 1, 33) == (64.0, True, "")     # 32 -> 64: the new size at once
    assert window_batch_size(1280.0, 20.0, 2, 64) == (64.0, True, "")    # two ranks: one rank's batch
    assert window_batch_size(320.0, 10.0, 1, 60) == (32.0, True, "")     # a real drop, the report lagging
    assert window_batch_size(32 * 29 + 10.0, 30.0, 1, 32)[0] == pytest.approx(31.27, abs=0.01)   # within tolerance
    per, stands, why = window_batch_size(0.0, 0.0, 1, 32)
    assert per is None and not stands and "no step" in why
    per, stands, why = window_batch_size(0.0, 10.0, 1, 32)
    assert per is None and stands and "no samples" in why
    per, stands, why = window_batch_size(5.0, 10.0, 1, 32)                 # a lying client's counters
    assert per is None and not stands and "under one" in why
    for samples in (10 * 32 * (BATCH_SIZE_DISAGREE + 1), 10 * 32 / (BATCH_SIZE_DISAGREE + 1), 2.0 ** 53):
        per, stands, why = window_batch_size(samples, 10.0, 1, 32)
        assert per is None and not stands and "off the reported batch size 32" in why, samples
    # an epoch's short last batch (drop_last=False) in a window of three steps of a fixed 256: not a new size
    per, stands, why = window_batch_size(256 + 256 + 10.0, 3.0, 1, 256)
    assert per is None and stands and "short last batch" in why
    per, stands, why = window_batch_size(2 * (256 + 10.0), 4.0, 2, 256)    # one on each rank
    assert per is None and stands and "short last batch" in why


def test_job_stats_carry_the_last_windows_batch_size_a_change_seen_in_the_first_window_after_it():
    """The client reports its mean batch since the start (a batch sampler's, rounded): after 32 -> 64 it
    creeps up a report at a time; the job's figures take the window's own samples over steps at once."""
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"id0", {"job": "j", "rank": 0, "pid": me, "batch_size": 32, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))
    assert col.snapshot(0.0).jobs["j"].samples_per_step is None       # no window yet
    steps = samples = 0
    for t in range(1, 8):
        size = 32 if t <= 4 else 64                                    # the batches doubled after t = 4
        steps, samples = steps + 10, samples + 10 * size
        col.on_report("j", 0, me, {**_totals(float(t), steps, 0.1 * t, 0.9 * t, samples=samples),
                                   "batch_size": round(samples / steps)}, float(t))
        job = col.snapshot(float(t)).jobs["j"]
        if t >= 2:
            assert job.samples_per_step == size and job.window_steps == 10 and job.samples_per_step_note == ""
        assert job.batch_size == 32                                    # the reported one, as status shows it
    # a window without a step: the reported size stands, with the reason
    col.on_report("j", 0, me, _totals(8.0, steps, 0.8, 6.3, samples=samples), 8.0)
    job = col.snapshot(8.0).jobs["j"]
    assert job.samples_per_step is None and job.window_steps is None and "no step" in job.samples_per_step_note


def test_settled_windows_batch_size_is_its_own_over_the_ranks():
    from agent.collector import settled_window
    r0 = tuple(_report(float(t), 1 + 10 * t, bs=8) for t in range(4))
    r1 = tuple(_report(float(t), 1 + 10 * t, bs=9) for t in range(4))
    w = settled_window((r0, r1), since=0.0, span_s=3.0, min_s=0.9)
    f = w.stats_fields(17)                     # the job's reported size: the ranks' summed
    assert f["samples_per_step"] == pytest.approx(17) and f["window_steps"] == 30.0
    assert f["samples_per_step_note"] == ""
    f = w.stats_fields(17 * 18)                # a reported size 18x the window's: no loader's counters
    assert f["samples_per_step"] is None and f["window_steps"] is None
    assert "off the reported" in f["samples_per_step_note"]


def _job_at_its_ceiling(ranks: int):
    """A job of ``ranks`` ranks (batch 32, 2 workers each), each stepping every 0.1 s with data always
    ready, its workers paying 0.05 CPU s a batch: reports for 6 s, its stats at the end."""
    reg = Registry()
    me = os.getpid()
    for rank in range(ranks):
        reg.hello(Peer(os.getuid(), 0, me), b"id%d" % rank, {"job": "j", "rank": rank, "pid": me, "gpus": [str(rank)],
                                                           "batch_size": 32, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=4.0, cpu_ids=(0, 1, 2, 3))
    for t in range(7):
        for rank in range(ranks):
            col.on_report("j", rank, me, {**_totals(float(t), 10 * t, 0.0, 0.1 * 10 * t, cpu=0.05 * 10 * t,
                                                    samples=320 * t), "workers": 2}, float(t))
    snap = col.snapshot(6.0)
    return snap.jobs["j"], snap


def test_a_multi_rank_jobs_curve_is_the_jobs_not_one_ranks():
    """Each rank of a 2-rank job makes 320 samples/s on half a core: the job makes 640 on one core. The
    predictor's curve from the job's figures must say so (ceiling 640, useful cores 1), twice a 1-rank
    job's. Counting one rank's batch beside both ranks' samples gave a ceiling of 320 and 0.5 useful
    cores: a plan that held the job at half its speed and called it saturated."""
    from agent.controller import observation_from_stats
    from predictor.bank import PredictorBank
    curves = {}
    for ranks in (1, 2):
        js, snap = _job_at_its_ceiling(ranks)
        assert js.samples_per_s == pytest.approx(320 * ranks)
        obs = observation_from_stats(js, snap)
        assert obs.workers == 2 * ranks and obs.batch_size == 32 * ranks and obs.steps == 10
        bank = PredictorBank()
        for _ in range(4):
            bank.observe("j", obs)
        curves[ranks] = bank.curve("j")
    one, two = curves[1], curves[2]
    assert one.ceiling_samples_per_s == pytest.approx(320, rel=0.02)
    assert two.ceiling_samples_per_s == pytest.approx(640, rel=0.02)
    assert one.max_useful_cores == pytest.approx(0.5, rel=0.1)
    assert two.max_useful_cores == pytest.approx(1.0, rel=0.1)
    assert two.throughput(4, 1.0) == pytest.approx(640, rel=0.05) and two.normalized(4, 0.5) < 0.6


def test_a_process_that_no_longer_holds_its_rank_leaves_no_rates_behind():
    """Rates are kept per (job, rank, pid). A registered job that outlives its processes (one Slurm step
    after another in one allocation, a rank restarted by torchrun) kept every former process's rates and
    reports until the job left (found reading ``rank_rates`` after ranks were replaced). Those of a
    process whose rank another process holds now go at the next snapshot; a rank that is only away keeps
    its rates, and a departed job's go too."""
    reg = Registry()
    me = os.getpid()
    reg.register(Peer(0, 0, 1), {"job": "j", "uid": os.getuid()}, 0.0)
    reg.hello(Peer(os.getuid(), 0, me), b"id0", {"job": "j", "rank": 0, "pid": me, "batch_size": 8}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))
    rank = reg.jobs["j"].ranks[0]
    for step in range(50):                      # fifty processes in turn hold rank 0 (the registry's view)
        rank.pid = 10_000 + step
        for t in range(3):
            col.on_report("j", 0, rank.pid, _totals(t, 10 * t, 0.1 * t, 0.9 * t), float(step * 3 + t))
        col.snapshot(float(step * 3 + 3))
    assert list(col.rank_rates) == [("j", 0, 10_049)]
    del reg.jobs["j"].ranks[0]                  # away (its job registered): kept for its return
    col.snapshot(200.0)
    assert list(col.rank_rates) == [("j", 0, 10_049)]
    del reg.jobs["j"]
    col.snapshot(201.0)
    assert col.rank_rates == {}


def test_job_stats_carry_each_workers_recorded_start_time():
    """The actuators check each worker pid against the start time the registry recorded for it before they
    move it (a pid reused since the client's last report is another process): the collector hands those
    on, every rank's, for every worker pid it lists."""
    import subprocess

    from agent.security import pid_start_ticks

    reg = Registry()
    me = os.getpid()
    workers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for rank, w in enumerate(workers):
            reg.hello(Peer(os.getuid(), 0, me), b"id%d" % rank, {"job": "j", "rank": rank, "pid": me,
                                                               "worker_pids": [w.pid]}, 0.0)
        js = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1)).snapshot(1.0).jobs["j"]
        assert js.worker_pids == tuple(sorted(w.pid for w in workers))
        assert dict(js.worker_starts) == {w.pid: pid_start_ticks(w.pid) for w in workers}
        assert all(v is not None for v in js.worker_starts.values())
    finally:
        for w in workers:
            w.kill()
            w.wait()


def test_a_jobs_worker_cost_never_falls_below_the_most_seen_until_its_loader_is_replaced():
    """One worker's cost (``JobStats.worker_memory_bytes``) from a client that does not report its own
    peak (``worker_cost_peak_bytes``: an older one): its workers grew to 30 MiB each, then a new epoch's
    workers measured 10 MiB: the cost stays at 30 (it fell to 10, and the plan made room for workers the
    node could not hold by the epoch's end). Over ranks: the most of any. A new loader in the process
    (its counters start again) starts afresh; a loader's own peak counts too."""
    MiB = 1 << 20
    col, me = _two_rank_job()

    def report(rank, t, steps, uss_per_worker, **extra):
        col.on_report("j", rank, me, {**_totals(t, steps, 0.0, 0.1 * steps), "memory_workers": 2,
                                      "worker_uss_bytes": 2 * uss_per_worker, "shm_inflight_bytes": 0, **extra}, t)
        return col.snapshot(t).jobs["j"].worker_memory_bytes / MiB

    assert report(0, 1.0, 10, 10 * MiB) == pytest.approx(10)
    assert report(0, 2.0, 20, 30 * MiB) == pytest.approx(30)          # grown as they read
    assert report(0, 3.0, 30, 10 * MiB) == pytest.approx(30)          # a new epoch's workers: not 10
    assert report(1, 3.0, 30, 12 * MiB) == pytest.approx(30)          # the other rank: the most of any
    assert report(0, 4.0, 5, 8 * MiB) == pytest.approx(12)            # rank 0's new loader: afresh (rank 1's 12)
    assert report(0, 5.0, 6, 8 * MiB, worker_cost_peak_bytes=40 * MiB) == pytest.approx(40)


def test_what_a_ranks_other_loaders_hold_is_the_jobs_loader_memory_not_a_workers_cost():
    """``other_loader_memory_bytes`` (the workers of a rank's loaders the agent does not size: a validation
    loader's) is in the job's ``loader_memory_bytes`` and its own figure, summed over the ranks, the latest
    report's each (a gauge: it falls when the validation workers stop); one worker's cost stays the
    sized loader's. A client that does not report it counts 0."""
    MiB = 1 << 20
    col, me = _two_rank_job()

    def report(rank, t, steps, **extra):
        col.on_report("j", rank, me, {**_totals(t, steps, 0.0, 0.1 * steps), "memory_workers": 2,
                                      "worker_uss_bytes": 20 * MiB, "shm_inflight_bytes": 4 * MiB, **extra}, t)
        js = col.snapshot(t).jobs["j"]
        return js.loader_memory_bytes / MiB, js.other_loader_memory_bytes / MiB, js.worker_memory_bytes / MiB

    assert report(0, 1.0, 10) == pytest.approx((24, 0, 12))
    assert report(1, 1.0, 10, other_loader_memory_bytes=100 * MiB) == pytest.approx((148, 100, 12))
    assert report(0, 2.0, 20, other_loader_memory_bytes=50 * MiB) == pytest.approx((198, 150, 12))
    assert report(1, 2.0, 20, other_loader_memory_bytes=0) == pytest.approx((98, 50, 12))
