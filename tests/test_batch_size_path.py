"""A custom batch_sampler's batch size through the real path (unit tier): the loader's rounded mean
delivered batch (``DataLoader._stats_batch_size``) in each report -> Registry -> Collector -> Controller ->
the real PredictorBank. The agent takes each window's batch size from its own counters (samples over
steps, ``predictor.bank.window_batch_size``), so a mean near x.5 that the rounding flips from report to
report is the window's exact mean (the job's windows and curve kept), and a real change of batch size
(32.5 -> 65 samples a batch) is the new size from the first window after it, while the reported mean
(over every batch since the start) has crept a fraction of the way."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from adloader import protocol
from adloader.dataloader import DataLoader
from agent.collector import Collector
from agent.controller import Controller
from agent.policies import PolicyConfig, get_policy
from agent.registry import Registry
from agent.security import Peer
from predictor.bank import PredictorBank
from tests.fakes import RecordingActuator

pytestmark = pytest.mark.unit


def test_a_flipping_rounded_mean_batch_keeps_the_curve_and_a_real_change_starts_a_new_one():
    me, peer = os.getpid(), Peer(os.getuid(), 0, os.getpid())
    reg = Registry()
    reg.hello(peer, b"c", protocol.make("hello", job="j", rank=0, pid=me, gpus=["0"], batch_size=None,
                                        workers=2, requested_workers=2), 0.0)
    col = Collector(reg, loader_cpus=4.0, cpu_ids=(0, 1, 2, 3))
    bank = PredictorBank(prior="default")
    ctl = Controller(snapshot_source=col.snapshot, policy=get_policy("even"), policy_config=PolicyConfig(),
                     predictor=bank, actuators=[RecordingActuator()], observe_interval_s=3.0)
    tot = dict.fromkeys(("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s",
                         "worker_wall_s", "worker_runq_s", "worker_blocked_s", "main_cpu_s", "main_runq_s"), 0.0)
    reported = []
    # a step every 0.1 s; the batches alternate 32 and 33 samples until t=60, then 65 and 65
    for t in range(1, 91):
        sizes = (32, 33) if t <= 60 else (65, 65)
        for i in range(10):
            n = sizes[(t * 10 + i) % 2]
            for k, v in (("steps", 1), ("batches", 1), ("samples", n), ("compute_s", 0.1), ("worker_cpu_s", 0.004 * n), ("worker_wall_s", 0.004 * n)):
                tot[k] += v
        if t <= 60:           # the mean over every batch so far sits a hair above or below 32.5: 33 or 32
            tot["samples"] += 1 if t % 2 else -1
        # the loader's own rule for a batch sampler's loader (torch's batch_size is None)
        bs = DataLoader._stats_batch_size(SimpleNamespace(batch_size=None), SimpleNamespace(**tot))
        reported.append(bs)
        stats = dict(tot, uptime_s=float(t), workers=2, live_workers=2, batch_size=bs)
        r = reg.report(b"c", peer, protocol.make("report", job="j", rank=0, pid=me, worker_pids=[], stats=stats),
                       float(t))
        col.on_report(r.job, r.rank, r.pid, stats, float(t))
        rec = ctl.tick(float(t))
        assert not rec.errors, rec.errors
        if t == 60:
            assert reported[:60] == [33, 32] * 30              # the rounding flipped at every report
            assert bank.phase_changes("j") == 0               # ... and the job's windows were kept
            # each window's mean is 32.5 within the test's +-1 sample a report (32.47 or 32.53 over 30 steps)
            assert all(o.batch_size == pytest.approx(32.5, abs=0.04) and o.steps == 30
                       for o in bank.windows("j")[1:])
            cur = bank.curve("j")
            assert cur.batch_size == pytest.approx(32.5, rel=1e-3)
            assert cur.ceiling_samples_per_s == pytest.approx(325.0, rel=1e-3)    # 32.5 samples / 0.1 s
    # the batches doubled at t=60: the reported mean (over every batch so far) creeps from 32.5 toward 65,
    # a few percent a report, and is still under 44 at the end. The window that spans the change (a mix:
    # 54 samples a step) is one new phase, the first window after it (65) another; every window since is 65
    assert 40 < reported[-1] < 44
    assert bank.phase_changes("j") == 2
    assert [o.batch_size for o in bank.windows("j")] == [65] * len(bank.windows("j"))
    assert all(o.steps == 30 for o in bank.windows("j"))
    assert bank.curve("j").batch_size == 65
    assert bank.curve("j").ceiling_samples_per_s == pytest.approx(650.0, rel=1e-6)
