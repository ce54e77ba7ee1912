"""Unit tests (pure or on tmp_path) for the agent's parts: config precedence and validation, the
collector's counters->rates, NVML with a fake module (NotFound carries forward), PSI parsing, the
atomic journal, the registry's adoption, status rendering, metrics exposition."""
from __future__ import annotations

import json
import os
import socket
import urllib.request
from types import SimpleNamespace

import pytest

from agent import config as configmod
from agent import journal, psi, security
from agent.collector import Collector, RankRates
from agent.model import JobAllocation
from agent.nvml import GpuSampler
from agent.registry import Refused, Registry
from agent.security import Peer, TokenBuckets


# --- config ----------------------------------------------------------------------------------------
def test_config_precedence_defaults_file_env_cli(tmp_path):
    f = tmp_path / "agent.toml"
    f.write_text('policy = "even"\ntick_s = 2\nmetrics_port = 9100\nloader_cpus = 3.5\nfairness_floor = false\n')
    env = {"ADLOADER_TICK_S": "0.5", "ADLOADER_MAX_JOBS": "4", "ADLOADER_JOB_ID": "not-a-key"}
    cfg = configmod.load(str(f), {"metrics_port": 0, "policy": None}, environ=env)
    assert cfg.policy == "even"                 # file (cli None = not given)
    assert cfg.tick_s == 0.5                    # env over file
    assert cfg.max_jobs == 4
    assert cfg.metrics_port == 0                # cli over file
    assert cfg.loader_cpus == 3.5 and cfg.fairness_floor is False
    assert cfg.hysteresis == 0.03 and cfg.cgroup_mode == "auto"    # defaults
    assert configmod.load(None, {}, environ={}).loader_cpus == "auto"


@pytest.mark.parametrize("text,key", [
    ('tick_s = 1\npolcy = "even"\n', "'polcy'"),
    ('tick_s = -1\n', "'tick_s'"),
    ('policy = "fastest"\n', "'policy'"),
    ('cgroup_mode = "v3"\n', "'cgroup_mode'"),
    ('max_jobs = 1.5\n', "'max_jobs'"),
    ('io_weights = "maybe"\n', "'io_weights'"),
    ('endpoint = "http://x"\n', "'endpoint'"),
    ('tick_s = \n', "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, text, key):
    f = tmp_path / "agent.toml"
    f.write_text(text)
    with pytest.raises(configmod.ConfigError) as e:
        configmod.load(str(f), {}, environ={})
    assert key in str(e.value) and str(f) in str(e.value)


def test_config_env_errors_and_missing_explicit_file(tmp_path):
    with pytest.raises(configmod.ConfigError, match="ADLOADER_TICK_S"):
        configmod.load(None, {}, environ={"ADLOADER_TICK_S": "fast"})
    with pytest.raises(configmod.ConfigError, match="cannot read config file"):
        configmod.load(str(tmp_path / "missing.toml"), {}, environ={})


def test_user_defaults_live_under_the_runtime_dir(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    from adloader import env as envmod

    assert envmod.default_endpoint(1000, env) == f"ipc://{tmp_path}/adloader/agent.sock"
    assert envmod.default_state_dir(1000, env) == f"{tmp_path}/adloader/state"
    assert envmod.default_state_dir(0, env) == "/var/lib/adloader"


def test_auto_loader_cpus_keeps_a_reserve():
    n = len(configmod.agent_cpu_ids())
    assert configmod.auto_loader_cpus() == pytest.approx(max(0.5, round(n * 0.9, 2)))


# --- collector -------------------------------------------------------------------------------------
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


# --- NVML ------------------------------------------------------------------------------------------
class FakeNvml:
    """The pynvml functions the sampler uses, with NotFound when no new process sample exists."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.util = {0: 30, 1: 90}
        self.samples = {0: [SimpleNamespace(pid=111, smUtil=25, timeStamp=5)], 1: []}
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.util[h], memory=0)

    def nvmlDeviceGetProcessUtilization(self, h, last_ts):
        new = [s for s in self.samples[h] if s.timeStamp > last_ts]
        if not new:
            raise self.NVMLError_NotFound()
        return new


def test_nvml_per_process_device_and_carry_forward():
    nv = FakeNvml()
    g = GpuSampler(nv)
    g.sample(0.0)
    assert g.available
    assert g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)          # its own SM use: 25%
    assert g.job_idle_frac(["GPU-1"], [111]) == pytest.approx(0.10)      # no per-process sample: device util
    g.sample(1.0)                                                        # NotFound: carry forward
    assert g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)
    assert g.job_idle_frac(["7"], [111]) is None                         # not a device here


def test_nvml_absent_retries_with_backoff_and_says_so_once():
    nv = FakeNvml(fail_init=True)
    g = GpuSampler(nv)
    for t in (0.0, 1.0, 2.0, 4.9):
        g.sample(t)
    assert nv.inits == 1 and not g.available and "Driver Not Loaded" in g.last_error
    g.sample(5.0)
    assert nv.inits == 2
    nv.fail_init = False
    g.sample(14.9)
    assert nv.inits == 2            # backoff doubled to 10 s
    g.sample(15.0)
    assert g.available and g.job_idle_frac(["1"], []) == pytest.approx(0.10)


def test_collector_prefers_nvml_when_present():
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me, "gpus": ["1"]}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1), gpu_sampler=GpuSampler(FakeNvml()))
    col.on_report("j", 0, me, _totals(0, 0, 0, 0), 0.0)
    col.on_report("j", 0, me, _totals(1, 10, 0.5, 0.5), 1.0)
    js = col.snapshot(1.0).jobs["j"]
    assert js.gpu_idle_frac == pytest.approx(0.10) and js.gpu_idle_source == "nvml" and js.data_wait_frac == 0.5


def test_psi_parsing(tmp_path):
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "cpu").write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=1\n"
                                               "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    p = psi.read(str(tmp_path))
    assert p.cpu_some_avg10 == 12.5 and p.io_some_avg10 is None


# --- journal and registry adoption -----------------------------------------------------------------
def test_journal_atomic_roundtrip_and_corrupt_file(tmp_path):
    a = JobAllocation(job="j", workers=3, cpus=1.5, cpuset=(0, 1), reason="r")
    journal.save(str(tmp_path), {"j": a}, {"j": {"uid": 0}})
    doc = journal.load(str(tmp_path))
    assert doc["applied"]["j"] == a and doc["jobs"] == {"j": {"uid": 0}}
    assert [p.name for p in tmp_path.iterdir()] == ["journal.json"]     # no temp file left behind
    assert oct(os.stat(tmp_path / "journal.json").st_mode & 0o777) == "0o600"
    (tmp_path / "journal.json").write_text('{"version": 1, "applied": {"j": ')
    got = journal.load(str(tmp_path))        # set aside and reported (tests/test_security_state.py)
    assert got["jobs"] == {} and got["applied"] == {} and "journal.json" in got["problems"][0]
    assert journal.load(str(tmp_path / "nothing")) is None


def test_registry_adopts_live_and_drops_dead():
    me = os.getpid()
    reg = Registry()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "live", "rank": 0, "pid": me, "worker_pids": [me]}, 0.0)
    doc = reg.to_doc()
    doc["dead"] = json.loads(json.dumps(doc["live"]))
    doc["dead"]["ranks"]["0"]["pid"] = 2 ** 22 + 17          # no such process
    doc["reg-only"] = {"uid": 0, "registered": True, "reg_pids": {}, "ranks": {}}
    doc["garbage"] = {"ranks": "x"}
    fresh = Registry()
    adopted, dead = fresh.adopt(doc, 100.0)
    assert sorted(adopted) == ["live", "reg-only"] and sorted(dead) == ["dead", "garbage"]
    assert fresh.jobs["live"].ranks[0].pid == me and fresh.jobs["live"].source == "journal"


def test_sweep_notices_a_dead_rank_within_two_ticks():
    """A rank heard from since the previous sweep is not re-read from /proc; one that died is dropped
    on the first sweep after its last message, and one that died silently on the next sweep."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        reg = Registry(heartbeat_s=100.0)
        for i, p in enumerate(procs):
            reg.hello(Peer(os.getuid(), 0, p.pid), b"r%d" % i, {"job": f"j{i}", "rank": 0, "pid": p.pid}, 0.0)
        reg.sweep(1.0)                                   # both alive
        assert sorted(reg.jobs) == ["j0", "j1"]
        reg.report(b"r0", Peer(os.getuid(), 0, procs[0].pid),
                   {"job": "j0", "rank": 0, "pid": procs[0].pid, "stats": {}}, 1.5)   # j0 reports, then dies
        for p in procs:
            p.kill()
            p.wait()
        reg.sweep(2.0)      # tick 1 after the deaths: j1 (silent since the last sweep) is read and gone
        assert sorted(reg.jobs) == ["j0"]
        reg.sweep(3.0)      # tick 2: j0's last message is older than the previous sweep -> read, gone
        assert reg.jobs == {}
        assert sorted(reg.take_departed()) == [("j0", "process gone"), ("j1", "process gone")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_registry_ownership_and_idempotence():
    me = os.getpid()
    reg = Registry()
    root, user = Peer(0, 0, 1), Peer(1000, 1000, 4242)
    reg.register(root, {"job": "s1", "uid": 1000, "gpus": ["0"], "cpus": 4, "pids": []}, 0.0)
    reg.register(root, {"job": "s1", "uid": 1000, "gpus": ["0"], "cpus": 4, "pids": []}, 0.0)
    assert reg.jobs["s1"].uid == 1000 and reg.jobs["s1"].registered
    with pytest.raises(Refused) as e:
        reg.register(user, {"job": "s2", "uid": 0}, 0.0)
    assert e.value.code == "not_permitted"
    with pytest.raises(Refused):
        reg.release(Peer(1001, 1001, 5), {"job": "s1", "uid": 1001})
    with pytest.raises(Refused, match="only speak for itself"):
        reg.hello(user, b"x", {"job": "s1", "rank": 0, "pid": me}, 0.0)
    assert reg.release(user, {"job": "s1", "uid": 1000}) is True
    assert reg.release(user, {"job": "s1", "uid": 1000}) is False
    assert reg.take_departed() == [("s1", "released")]
    with pytest.raises(Refused, match="no peer credentials"):
        reg.register(None, {"job": "s3", "uid": 0}, 0.0)


def test_peer_address_parsing_and_token_bucket():
    assert security.parse_peer_address("localhost:1000:100:4242") == Peer(1000, 100, 4242)
    assert security.parse_peer_address("127.0.0.1:5555") is None
    assert security.parse_peer_address("") is None
    tb = TokenBuckets(rate_per_s=10, burst=5)
    assert [tb.take(b"a", 0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert tb.take(b"b", 0.0)                      # other identities unaffected
    assert tb.take(b"a", 0.2) and tb.take(b"a", 0.2) and not tb.take(b"a", 0.2)


# --- status and metrics ----------------------------------------------------------------------------
def _doc():
    return {"version": 1, "agent": {"pid": 1, "policy": "adaptive", "tick_s": 1.0, "last_tick_ms": 0.4,
                                    "loader_cpus": 1.8, "cgroup_mode": "v1", "gpu_source": "client",
                                    "uptime_s": 5, "ticks": 5},
            "jobs": [{"job": "j1", "uid": 0, "ranks": 2, "workers": 2, "desired_workers": 3, "cpus": 1.2,
                      "data_wait_frac": 0.31, "gpu_idle_frac": 0.31, "gpu_idle_source": "client",
                      "samples_per_s": 250.0, "max_useful_workers": 4, "reason": "marginal gain 0.2/core",
                      "unsatisfied": None, "breaker": None}]}


def test_status_table_names_every_column():
    from agent.status import render_table

    t = render_table(_doc())
    for word in ("JOB", "RANKS", "WORKERS", "CPUS", "WAIT", "GPU-IDLE", "SAMPLES/S", "MAX-USEFUL", "REASON",
                 "j1", "2->3", "31%", "marginal gain 0.2/core", "estimated from the job's data wait"):
        assert word in t, word


def test_metrics_exposed_on_localhost():
    pytest.importorskip("prometheus_client")
    from agent.metrics import Metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = Metrics(port)
    m.start()
    try:
        m.update(_doc(), {"report": 7}, {"malformed": 2})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'adloader_job_workers{job="j1"} 2.0' in body
        assert 'adloader_job_data_wait_fraction{job="j1"} 0.31' in body
        assert 'adloader_errors_total{code="malformed"} 2.0' in body
        doc = _doc()
        doc["jobs"] = []
        m.update(doc)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'job="j1"' not in body and "adloader_jobs 0.0" in body
    finally:
        m.stop()
