"""agent/collector.py: counters -> rates per rank (resets, smoothing), a job's ranks aggregated by
the max stall, NVML preferred to the client's estimate when present."""
from __future__ import annotations

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


def test_job_stats_aggregate_ranks_max_stall():
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
    assert js.ranks == 2 and js.gpus == 2 and js.workers == 3
    assert js.data_wait_frac == pytest.approx(0.5)                        # max over ranks
    assert js.data_wait_s_per_step == pytest.approx(0.05)
    assert js.compute_s_per_step == pytest.approx(0.07)                   # mean over ranks
    assert js.samples_per_s == pytest.approx(160)                         # sum over ranks
    assert js.worker_cpu_cores == pytest.approx(0.6)
    assert js.gpu_idle_frac == pytest.approx(0.5) and js.gpu_idle_source == "client"
    assert snap.loader_cpus == 2.0 and snap.cpu_ids == (0, 1)


def test_collector_prefers_nvml_when_present():
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me, "gpus": ["1"]}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1), gpu_sampler=GpuSampler(FakeNvml()))
    col.on_report("j", 0, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 0, me, _totals(1, 10, 0.5, 0.5), 1.0)
    js = col.snapshot(1.0).jobs["j"]
    assert js.gpu_idle_frac == pytest.approx(0.10) and js.gpu_idle_source == "nvml" and js.data_wait_frac == 0.5

