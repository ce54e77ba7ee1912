"""Component tests: the bench harness with real job processes on a tiny configuration.

Real processes (``evaluation.jobproc`` with real DataLoader workers); the only thing made small is
the work (tiny JPEGs, short phases). No timing assertions: only that the run produced the records and
metrics it should, and left no process behind.
"""
from __future__ import annotations

import io
import dataclasses
import json
import math
import os
import re
from pathlib import Path

import psutil
import pytest

from evaluation import report, setup
from evaluation.catalog import CatalogError, load_catalog

pytestmark = pytest.mark.component

TINY = """
reference_cores = 4.0
min_step_s = 0.01
max_step_s = 0.5

[jobs.heavy]
cores_per_gpu = 2.0
batch_size = 8
image_px = 48
crop_px = 16

[jobs.light]
cores_per_gpu = 0.5
batch_size = 8
image_px = 32
crop_px = 16

[mixes]
heterogeneous = ["heavy", "light"]
dynamic = ["heavy", "light"]

[dynamic]
arrivals_s = [0.0, 1.0]
work_s = [3.0, 2.0]
"""


@pytest.fixture
def tiny_catalog(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return str(p)


def _live_children() -> set:
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                out.add(c)
        except psutil.NoSuchProcess:
            pass
    return out


def _no_children_left():
    """Processes under this one that the last ``_run`` started and left alive. (Children that were
    there before it are not its own: multiprocessing's resource tracker and forkserver, which earlier
    tests in this process started and which live until the interpreter exits.)"""
    return sorted((c.pid for c in _live_children() - _before_run), key=int)


_before_run: set = set()


def _run(tmp_path, catalog, scenario, policies, **kw):
    global _before_run
    _before_run = _live_children()
    stream = io.StringIO()
    result = setup.run(out_dir=tmp_path / "out", scenarios=[scenario], policies=policies, reps=1, quick=True,
                       catalog_path=catalog, loader_cpus=1.0, cgroup_mode="off", tick_s=0.5,
                       device="emulated", sweep_segment_s=1.0, progress=report.Progress(stream), **kw)
    return result, stream.getvalue()


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    """One bench of the heterogeneous mix under ``none`` (calibrated in 2 fresh processes; the catalogue's
    [windows] gives the mix a 1.5 s warm-up over the 0.5 s asked for), shared by the tests that read a
    finished run: (result, progress text, the directory it ran in, the processes it left alive). Read
    only: a test that runs again copies the directory first."""
    tmp = tmp_path_factory.mktemp("static")
    cat = tmp / "tiny.toml"
    cat.write_text(TINY + '\n[windows]\nheterogeneous = {warmup_s = 1.5}\n')
    result, progress = _run(tmp, str(cat), "heterogeneous", ["none"], warmup_s=0.5, measure_s=2.0,
                            calibration_processes=2)
    return result, progress, tmp, _no_children_left()


def test_static_scenario_one_policy_end_to_end(static_run):
    result, progress, tmp_path, left = static_run
    (ph,) = result["phases"]
    assert ph["error"] is None
    m = ph["metrics"]
    assert set(m["jobs"]) == {"hete-0-heavy", "hete-1-light"}
    assert m["agg_normalised"] > 0 and m["samples_per_s"] > 0
    assert 0.0 <= m["gpu_idle_frac"] <= 1.0
    assert 0.0 < m["jain"] <= 1.0
    for j in m["jobs"].values():
        assert j["workers_end"] == setup.node_cores()          # `none`: num_workers = cores
    assert "[1/1] heterogeneous none rep 1:" in progress
    assert "the least of 2 fresh processes" in progress
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["summary"]["heterogeneous"]["none"]["reps"] == 1
    meta = doc["meta"]     # when it ran: started before the phases, finished after (not both at the end)
    for c in meta["calibration"].values():     # each kind measured in two fresh processes, the least taken
        assert len(c["cpu_s_per_sample_runs"]) == 2 and c["cpu_s_per_sample"] == min(c["cpu_s_per_sample_runs"])
    import datetime

    span = (datetime.datetime.fromisoformat(meta["finished"]) - datetime.datetime.fromisoformat(meta["started"]))
    assert abs(span.total_seconds() - meta["wall_s"]) <= 1.5 and meta["wall_s"] > 2.0 and meta["command"]
    assert "| none | 1 |" in (tmp_path / "out" / "bench.md").read_text()
    # the workload check: each job's workers' CPU per sample over its calibration, in the JSON and the table
    check = doc["workload_check"]["heterogeneous"]
    assert set(check) == set(m["jobs"]) and all(c["phases"] == 1 and c["x_median"] > 0 for c in check.values())
    assert "Workload check, the loader CPU per sample the workers paid" in (tmp_path / "out" / "bench.md").read_text()
    assert set(doc["cost_index"]["heterogeneous"]) == {"none"} and len(doc["cost_index"]["heterogeneous"]["none"]) == 1
    assert doc["delivery"] == {}          # no agent, no plan: nothing to compare
    assert "Cost per phase, the median over its jobs" in (tmp_path / "out" / "bench.md").read_text()
    assert (tmp_path / "out" / "policies.png").stat().st_size > 0
    assert (tmp_path / "out" / "timeline_heterogeneous.png").stat().st_size > 0
    assert left == []


@pytest.mark.slow     # four bench phases (~30 s); test_colocated_probes_make_the_oracles_curves runs the same path
def test_oracle_curves_come_from_colocated_probes_of_the_mix(tmp_path, tiny_catalog):
    """The oracle's points are measured with the whole mix running, under fixed probe plans that the real
    agent applies (the even split, then each job given 3/4 of the loader cores): one point per job and
    plan, the cores its workers really used, and the cores all loaders got as the plan's budget.
    Slow: its path through the harness is test_colocated_probes_make_the_oracles_curves's (the phases
    faked), a real phase under a fixed plan applied by the real agent test_a_plan_policy_runs_the_agent_
    with_that_fixed_plan's, the probe plans and the oracle's use of the points tests/test_bench_metrics.py's."""
    result, progress = _run(tmp_path, tiny_catalog, "heterogeneous", ["oracle"], warmup_s=0.5, measure_s=1.5,
                            oracle_probe_reps=1)
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["metrics"]["agg_normalised"] > 0
    doc = json.loads((tmp_path / "out" / "runs" / "heterogeneous" / "oracle-curves.json").read_text())
    assert "co-located probes" in doc["note"] and doc["budget_cores"] > 0
    assert set(doc["jobs"]) == {"hete-0-heavy", "hete-1-light"}
    for pts in doc["jobs"].values():
        assert len(pts) == 3                                   # even, heavy-skewed, light-skewed
        assert all(w >= 2 and c >= 0 and 0 <= v <= 1 for w, c, v in pts)
    probes = sorted(p.name for p in (tmp_path / "out" / "runs" / "heterogeneous" / "probes").iterdir() if p.is_dir())
    assert probes == ["probe0-rep1", "probe1-rep1", "probe2-rep1"]
    assert "oracle probe 3/3 rep 1" in progress
    assert all(j["reason"].startswith("oracle:") for j in ph["agent_status"]["jobs"].values())
    assert _no_children_left() == []


def test_colocated_probes_make_the_oracles_curves(tmp_path, monkeypatch):
    """``run_bench`` with the oracle on a static mix, its phases faked (``run_phase`` and ``phase_metrics``:
    no process): every probe plan runs as an oracle phase on its own plan file, in probe<k>-rep<r>,
    ``oracle_probe_reps`` times in rotated order; per job one point per plan, (the plan's workers, the
    median of the cores its workers used, the median normalised throughput); the budget the median of
    the phases' total cores; a job's memory the largest worker seen; all in oracle-curves.json, which
    the oracle's own phase then runs on."""
    from evaluation import harness
    from evaluation.catalog import JobSpec

    wl = dict(name="l", num_images=8, length=1 << 20, image_px=32, crop_px=16, aug_multiplier=1, seed=1)
    specs = [JobSpec(job_id=j, kind="l", batch_size=8, step_s=0.01, demand_cores=0.5, cpu_s_per_sample=0.001,
                     workload=wl) for j in ("a", "b")]
    sc = harness.Scenario("mix", [harness.Launch(sp) for sp in specs], "static", 0.5, 1.5)
    cfg = harness.BenchConfig(catalog=None, calib={}, loader_cpus=1.0, node_cores=2, out_dir=tmp_path,
                              oracle_probe_reps=2)
    plans = harness.probe_plans(specs, 1.0)
    assert len(plans) == 3
    ran = []

    def run_phase(cfg, sc, policy, rep, run_dir, curves_path=None, tick=None):
        doc = json.loads(curves_path.read_text())
        ran.append((policy, rep, run_dir.name, curves_path.name, doc))
        if "plan" not in doc:          # the oracle's own phase, on the curves
            return {"policy": policy, "rep": rep, "plan": None}
        return {"policy": policy, "rep": rep, "plan": doc["plan"],
                "memory": [{"largest": {j: (100 + rep) << 20 for j in doc["plan"]}}]}

    def phase_metrics(ph):
        if ph["plan"] is None:
            return {"agg_normalised": 1.0, "gpu_idle_frac": 0.0}
        # a job's workers use 0.9 of the cores the plan gives it, +0.1 in the second repeat
        return {"jobs": {j: {"worker_cpu_cores": 0.9 * p["cpus"] + 0.1 * ph["rep"], "normalised": p["cpus"]}
                         for j, p in ph["plan"].items()}}

    monkeypatch.setattr(harness, "run_phase", run_phase)
    monkeypatch.setattr(harness, "phase_metrics", phase_metrics)
    stream = io.StringIO()
    result = harness.run_bench(cfg, [sc], ["oracle"], 1, report.Progress(stream))
    probes = [r for r in ran if "plan" in r[4]]
    assert [r[2] for r in probes] == ["probe0-rep1", "probe1-rep1", "probe2-rep1",      # rotated per repeat
                                      "probe1-rep2", "probe2-rep2", "probe0-rep2"]
    assert all(r[0] == "oracle" and r[3] == f"probe{r[2][5]}.json" and r[4]["plan"] == plans[int(r[2][5])]
               for r in probes)
    assert "oracle probe 3/3 rep 2" in stream.getvalue()
    (last,) = [r for r in ran if "plan" not in r[4]]
    assert last[3] == "oracle-curves.json" and last[0] == "oracle"
    doc = json.loads((tmp_path / "runs" / "mix" / "oracle-curves.json").read_text())
    assert doc == last[4] and "co-located probes" in doc["note"]
    for j in ("a", "b"):
        want = [[p[j]["workers"], round(0.9 * p[j]["cpus"] + 0.05, 4), round(min(1.0, p[j]["cpus"]), 4)]
                for p in plans]
        assert doc["jobs"][j] == want, (j, doc["jobs"][j], want)
    totals = sorted(sum(0.9 * p[j]["cpus"] + 0.1 * rep for j in ("a", "b")) for p in plans for rep in (0, 1))
    assert doc["budget_cores"] == pytest.approx((totals[2] + totals[3]) / 2)
    assert doc["memory"] == {"a": 101 << 20, "b": 101 << 20}
    (ph,) = result["phases"]
    assert ph["policy"] == "oracle" and json.loads(json.dumps(ph["oracle_curves"])) == doc["jobs"]


def test_dynamic_scenario_reports_makespan_and_jct(tmp_path, tiny_catalog):
    result, _ = _run(tmp_path, tiny_catalog, "dynamic", ["none"])
    (ph,) = result["phases"]
    m = ph["metrics"]
    assert m["unfinished"] == 0, ph["error"]
    assert m["makespan_s"] > 0 and m["jct_mean_s"] > 0
    assert m["jct_p95_s"] >= m["jct_mean_s"] - 1e-9 or math.isclose(m["jct_p95_s"], m["jct_mean_s"])
    gpus = [v["gpus"] for v in m["jobs"].values()]
    if all(g == 1 for g in gpus):         # one GPU each: the GPU-weighted mean is the plain one
        assert m["jct_gpu_mean_s"] == pytest.approx(m["jct_mean_s"])
    else:
        assert m["jct_gpu_mean_s"] > 0
    kinds = [e["kind"] for e in ph["events"]]
    assert kinds.count("arrival") == 1 and kinds.count("finish") == 2
    assert "reactions" in m
    assert _no_children_left() == []


def test_catalog_errors_name_the_problem(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[jobs.x]\nbatch_size = 4\n')
    with pytest.raises(CatalogError, match=r"\[jobs.x\] needs cores_per_gpu"):
        load_catalog(str(p))
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\nspeed = 3\n[mixes]\nm = ["x"]\n')
    with pytest.raises(CatalogError, match="unknown keys: speed"):
        load_catalog(str(p))
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = ["y"]\n')
    with pytest.raises(CatalogError, match="unknown kinds: y"):
        load_catalog(str(p))


@pytest.mark.parametrize("text,err", [
    ('[jobs.x]\ncores_per_gpu = "x"\n', r"\[jobs.x\] cores_per_gpu must be a finite number, got 'x'"),
    ('[jobs.x]\ncores_per_gpu = 1.0\nbatch_size = 6.5\n', r"\[jobs.x\] batch_size must be an integer, got 6.5"),
    ('[jobs.x]\ncores_per_gpu = 1.0\ngpus = true\n', r"\[jobs.x\] gpus must be an integer, got True"),
    ('[jobs.x]\ncores_per_gpu = nan\n', r"\[jobs.x\] cores_per_gpu must be a finite number, got nan"),
    ('[jobs.x]\ncores_per_gpu = 1.0\nphase_kind = 3\n', r"\[jobs.x\] phase_kind must be a string, got 3"),
    ('reference_cores = "x"\n[jobs.x]\ncores_per_gpu = 1.0\n', "reference_cores must be a finite number, got 'x'"),
    ('mixs = ["x"]\n[jobs.x]\ncores_per_gpu = 1.0\n', "unknown top-level keys: mixs"),
    ('jobs = 5\n', r"jobs must be a table \(\[jobs\]\), got 5"),
    ('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = "x"\n', "mix 'm' must be a list of kinds, got 'x'"),
    ('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{kind = "x", num_workers = "8"}]\n',
     "mix 'm': num_workers of x must be an integer, got '8'"),
    ('[jobs.x]\ncores_per_gpu = 1.0\n[dynamic]\narrivals_s = "0, 4"\n', r"\[dynamic\] arrivals_s must be a list"),
    ('[jobs.x]\ncores_per_gpu = 1.0\n[dynamic]\nwork_s = ["a"]\n', r"\[dynamic\] work_s must be a finite number"),
    ('[jobs.x]\ncores_per_gpu = 1.0\n[dynamic]\narrival_s = [1]\n', r"\[dynamic\] has unknown keys: arrival_s"),
])
def test_a_catalog_value_of_the_wrong_type_or_an_unknown_table_is_named(tmp_path, text, err):
    """Before: a value of the wrong type (``cores_per_gpu = "x"``, ``[mixes] m = 5``, ``jobs = 5``) was a
    TypeError, ValueError or AttributeError traceback from `adloader bench/demo/simulate --catalog`,
    and a misspelt table or key outside [jobs.*] (``mixs``, ``[dynamic] arrival_s``) was ignored
    without a word. Now each is a CatalogError naming the entry."""
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(CatalogError, match=f"catalogue {re.escape(str(p))}: {err}"):
        load_catalog(str(p))


def test_simulate_names_a_catalog_value_of_the_wrong_type_without_a_traceback(tmp_path):
    import subprocess

    from tests.conftest import adloader_cmd, repo_env

    p = tmp_path / "c.toml"
    p.write_text('[jobs.x]\ncores_per_gpu = "x"\n')
    out = subprocess.run(adloader_cmd("simulate", "--curves", "builtin", "--catalog", str(p), "--nodes", "1"),
                         env=repo_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == (f"adloader simulate: catalogue {p}: [jobs.x] cores_per_gpu must "
                                                  f"be a finite number, got 'x'\n"), out.stderr


def test_a_catalog_that_cannot_be_read_is_a_catalog_error_and_simulate_says_so(tmp_path):
    # (before: a catalogue that is not UTF-8 was a bare UnicodeDecodeError, without the file's name, and
    # `adloader simulate --catalog` with a missing or unreadable one a traceback)
    import subprocess

    from tests.conftest import adloader_cmd, repo_env

    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe[jobs]\n")
    with pytest.raises(CatalogError, match=f"catalogue {re.escape(str(p))}: not valid TOML: not UTF-8"):
        load_catalog(str(p))
    for bad in (p, tmp_path / "missing.toml"):
        out = subprocess.run(adloader_cmd("simulate", "--curves", "builtin", "--catalog", str(bad)), env=repo_env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and f"catalogue {bad}" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_catalog_windows_name_their_problems(tmp_path):
    p = tmp_path / "w.toml"
    base = '[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = ["x"]\n[windows]\n'
    p.write_text(base + 'm = {warmup_s = 20, measure_s = 30.5}\n')
    assert load_catalog(str(p)).windows == {"m": {"warmup_s": 20.0, "measure_s": 30.5}}
    for line, err in (('q = {warmup_s = 2}', "unknown mix 'q'"), ('m = {warm = 2}', "unknown keys: warm"),
                      ('m = {measure_s = 0}', r"m.measure_s must be a number of seconds > 0"),
                      ('m = {warmup_s = "long"}', "m.warmup_s must be a number"), ('m = 3', "must be {warmup_s")):
        p.write_text(base + line + "\n")
        with pytest.raises(CatalogError, match=err):
            load_catalog(str(p))
    assert load_catalog().windows["oversubscribed"]["measure_s"] >= 30     # the packaged catalogue's


def test_a_mix_window_lengthens_its_phases_and_says_so(static_run):
    """The catalogue's [windows] warm-up for the mix (1.5 s, ``static_run``'s) over the 0.5 s asked for."""
    result, progress, _, left = static_run
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["warmup_s"] == 1.5
    a, b = ph["window"]
    assert b - a == pytest.approx(2.0, abs=0.3)             # the window is not raised: no minimum given
    assert a - ph["origin"] == pytest.approx(1.5, abs=0.3)   # it starts after the mix's warm-up
    assert "heterogeneous: warm-up 1.5 s, window 2 s (the catalogue's [windows] minimum" in progress
    assert left == []


def test_packaged_catalog_loads_with_every_scenario_mix():
    cat = load_catalog()
    for mix in ("heterogeneous", "homogeneous", "light", "dynamic", "reaction", "hog"):
        assert mix in cat.mixes
    demands = sorted(k.cores_per_gpu for k in cat.kinds.values())
    assert demands[0] <= 1.0 and demands[-1] >= 12.0       # spans NLP-like .. AlexNet-like


def test_cuda_device_without_cuda_fails_with_a_clear_message(tmp_path):
    import subprocess

    import torch

    from tests.conftest import adloader_cmd, repo_env

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal path is not reachable")
    p = subprocess.run(adloader_cmd("bench", "--device", "cuda", "--out", str(tmp_path)), env=repo_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "--device cuda needs a CUDA GPU" in p.stderr and "sees no CUDA device" in p.stderr


@pytest.mark.slow     # redundant: the policy-variant test runs `even` on these jobs and asserts the same
def test_agent_policy_phase_directs_the_real_jobs(tmp_path, tiny_catalog):
    """The real agent (policy `even`, worker counts only) resizes the real jobs' loaders: two jobs that
    start at num_workers = node cores end at the even split of 1 loader core: one worker each."""
    if setup.node_cores() < 2:
        pytest.skip("needs >= 2 cores so that the jobs start above the even split")
    result, _ = _run(tmp_path, tiny_catalog, "heterogeneous", ["even"], warmup_s=2.0, measure_s=2.0)
    (ph,) = result["phases"]
    assert ph["error"] is None
    m = ph["metrics"]
    for j in m["jobs"].values():
        assert j["workers_end"] == 1
        assert j["resizes"] >= 1
    assert set(ph["agent_status"]["jobs"]) == set(m["jobs"])
    assert m["agent_cpu_cores"] >= 0
    assert _no_children_left() == []


def test_policy_variants_parse_and_bad_ones_are_refused():
    from evaluation.harness import BenchError, parse_policy, split_policies

    assert split_policies("none,adaptive[loaders_yield=never,hysteresis=0.05],even") == [
        "none", "adaptive[loaders_yield=never,hysteresis=0.05]", "even"]
    assert parse_policy("adaptive[loaders_yield=never,hysteresis=0.05]") == (
        "adaptive", {"loaders_yield": "never", "hysteresis": "0.05"})
    assert parse_policy("none") == ("none", {})
    for bad, why in (("none[hysteresis=0.1]", "only the agent's own policies"),
                     ("oracle[hysteresis=0.1]", "only the agent's own policies"),
                     ("adaptive[bogus=1]", "not an agent config key"),
                     ("adaptive[endpoint=ipc:///x]", "not an agent config key"),
                     ("adaptive[hysteresis]", "not key=value"),
                     ("adaptive[hysteresis=0.1", "name[key=value"),
                     ("adaptive[tick_s=abc]", "'tick_s'"),          # (before: refused by the agent, after
                     ("even[hysteresis=2]", "'hysteresis'")):       # the calibration: a bench of failures)
        with pytest.raises(BenchError, match=re.escape(why)):
            parse_policy(bad)


def test_a_policy_variant_runs_the_agent_with_its_config_keys(tmp_path, tiny_catalog):
    """``even[loaders_yield=never]``: the real agent runs with that key (its status says so). It is the
    `even` policy, which resizes the real jobs' loaders (what test_agent_policy_phase_directs_the_real_jobs,
    now slow, checks with the plain policy): two jobs that start at num_workers = node cores end at the
    even split of 1 loader core, one worker each (on a node of 2 or more cores: below that they start there)."""
    result, progress = _run(tmp_path, tiny_catalog, "heterogeneous", ["even[loaders_yield=never]"],
                            warmup_s=2.0, measure_s=2.0)
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["policy"] == "even[loaders_yield=never]"
    m = ph["metrics"]
    if setup.node_cores() >= 2:
        for j in m["jobs"].values():
            assert j["workers_end"] == 1
            assert j["resizes"] >= 1
    assert set(ph["agent_status"]["jobs"]) == set(m["jobs"])
    assert m["agent_cpu_cores"] >= 0
    doc = json.loads((tmp_path / "out" / "runs" / "heterogeneous" / "even[loaders_yield=never]-rep1"
                      / "agent-status.json").read_text())
    assert doc["agent"]["policy"] == "even"
    assert "loaders_yield = never" in doc["node"]["reason"]
    assert "[1/1] heterogeneous even[loaders_yield=never] rep 1:" in progress
    assert _no_children_left() == []


def test_catalog_workload_model_fields_and_variants(tmp_path):
    from evaluation.catalog import habitual_workers, make_job

    cat = load_catalog()
    for mix in ("gpu-weighted", "trainer-cpu", "oversubscribed", "nothing-to-arbitrate"):
        assert mix in cat.mixes
    two = cat.kinds["resnet18x2"]
    assert two.gpus == 2 and 0 < two.trainer_cpu_frac < 1
    fracs = [cat.kinds[k].trainer_cpu_frac for k in cat.mixes["trainer-cpu"]]
    assert all(0.2 <= f <= 0.4 for f in fracs)
    over = [habitual_workers(cat.kinds[k], 2) for k in cat.mixes["oversubscribed"]]
    assert sum(over) >= 3 * 2 * 2                                   # several times a 2-core node
    assert habitual_workers(cat.kinds["alexnet"], 8) == 8           # unset: cpus // ranks
    assert habitual_workers(two, 8) == 4
    calib = {two.name: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}}
    spec = make_job(cat, calib, two.name, "x", seed=1, node_cores=8)
    assert spec.batch_size == 2 * two.batch_size and spec.gpus == 2 and spec.num_workers == 4
    assert spec.trainer_cpu_cores == pytest.approx(2 * two.trainer_cpu_frac)
    # a variant is written inline in a mix, and its unknown keys are named
    p = tmp_path / "v.toml"
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{kind = "x", num_workers = 8}, "x"]\n')
    c = load_catalog(str(p))
    assert c.mixes["m"] == ["x[num_workers=8]", "x"] and c.kinds["x[num_workers=8]"].num_workers == 8
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{kind = "x", speed = 8}]\n')
    with pytest.raises(CatalogError, match="unknown keys for x: speed"):
        load_catalog(str(p))
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\ntrainer_cpu_frac = 1.5\n')
    with pytest.raises(CatalogError, match="trainer_cpu_frac must be in"):
        load_catalog(str(p))


def test_emulated_step_burns_the_trainers_cpu_per_rank():
    import time

    import torch

    from adloader.synthetic import emulated_step

    batch = (torch.zeros(2, 3, 4, 4), 0)
    c0 = time.process_time()
    emulated_step(batch, 0.06, cpu_s=0.02, ranks=2)
    used = time.process_time() - c0
    assert used >= 2 * 0.02 * 0.9                                   # two rank threads, 20 ms each



TINY_MEMORY = TINY.replace("[mixes]", """[jobs.fat]
cores_per_gpu = 0.5
batch_size = 8
image_px = 32
crop_px = 16
worker_ram_mb = 200

[mixes]
memory = ["fat", "light"]""")


def test_worker_memory_reports_the_largest_worker_beside_the_total():
    """``worker_memory``: a job process's children, their unique memory in total and the largest one's.
    The oracle's sweep takes one worker's memory from the largest: a sample taken as the sweep adds a
    worker counts one still starting, and the mean (what it took before) read 129 MiB for 208-MiB workers,
    so the budget oracle planned two of them under a 350-MiB budget. Real processes: a parent whose one
    child holds 64 MiB (every page touched) and whose other child holds nothing of its own."""
    import subprocess
    import sys
    import time

    from evaluation.harness import loader_memory_sample, worker_memory

    code = (
        "import os, sys, time\n"
        "def child(mb):\n"
        "    buf = bytearray(mb << 20); buf[::4096] = b'\\x01' * len(range(0, mb << 20, 4096))\n"
        "    print('ready', flush=True); time.sleep(60)\n"
        "for mb in (64, 0):\n"
        "    if os.fork() == 0:\n"
        "        child(mb); os._exit(0)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready" and parent.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        n, total, largest = worker_memory(parent.pid)
        assert n == 2
        assert 64 << 20 <= largest <= total < (64 << 20) + (48 << 20), (n, total, largest)
        assert largest > total / n * 1.5              # the mean would understate the big worker
        smp = loader_memory_sample({"j": parent}, 1.0)   # what the bench's phases record (measure_colocated)
        assert smp["t"] == 1.0 and smp["total"] == smp["jobs"]["j"]
        assert 64 << 20 <= smp["largest"]["j"] <= smp["jobs"]["j"] < (64 << 20) + (48 << 20), smp
    finally:
        try:
            kids = psutil.Process(parent.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for k in kids:
            k.kill()
        parent.kill()
        parent.wait()
        psutil.wait_procs(kids, timeout=5)


def test_a_solo_sweep_measures_each_worker_count_and_the_largest_workers_memory(tmp_path):
    """``measure_sweeps``, what the budget oracle plans from (the memory scenario's oracle curves): each
    kind alone on the node in a real job process, at 1 .. ceil(loader CPUs) + 1 workers (2 here), one
    sweep per kind whatever the number of its jobs; per job one point per worker count, and one worker's
    memory the most a single worker held: the fat kind's 200 MiB and more (a mean over a sample taken as
    the second worker starts would read less)."""
    from evaluation import harness
    from evaluation.catalog import calibrate, make_job

    global _before_run
    p = tmp_path / "mem.toml"
    p.write_text(TINY_MEMORY)
    cat = load_catalog(str(p))
    calib = calibrate(cat, 1.0, ["fat"])
    specs = [make_job(cat, calib, "fat", f"memo-{i}-fat", seed=100 + i, node_cores=setup.node_cores()) for i in (0, 1)]
    cfg = harness.BenchConfig(catalog=cat, calib=calib, loader_cpus=1.0, node_cores=setup.node_cores(),
                              out_dir=tmp_path / "out", sweep_segment_s=1.0)
    _before_run = _live_children()
    stream = io.StringIO()
    memory: dict = {}
    points = harness.measure_sweeps(cfg, specs, tmp_path / "sweep", report.Progress(stream), memory_out=memory)
    assert stream.getvalue().count("oracle sweep: fat alone at 1,2 workers") == 1      # one sweep for both jobs
    assert set(points) == set(memory) == {"memo-0-fat", "memo-1-fat"}
    assert points["memo-0-fat"] == points["memo-1-fat"] and memory["memo-0-fat"] == memory["memo-1-fat"]
    assert [w for w, _, _ in points["memo-0-fat"]] == [1, 2], points
    assert all(c >= 0 and 0 <= v <= 1 for _, c, v in points["memo-0-fat"]), points
    assert 200 << 20 < memory["memo-0-fat"] < 400 << 20, memory        # one worker: its 200 MiB and more
    assert _no_children_left() == []


@pytest.mark.parametrize("policy", ["none", "adaptive",
                                    # slow: ~30 s (sweeps, then the phase); its parts are default tests (docstring)
                                    pytest.param("oracle", marks=pytest.mark.slow)])
def test_memory_scenario_budget_is_kept_by_the_agent_and_reported(tmp_path, policy):
    """A job whose workers hold 200 MiB each beside a light one, under a 350 MiB loader memory budget:
    `none` (two habitual workers each, no agent) goes over it; the agent's plan keeps every sample of
    the measured window under it, and so does the budget oracle's (its sweeps measure each worker's
    memory). The harness reads the workers' memory itself (smaps_rollup). [oracle] is slow: its sweeps
    are test_a_solo_sweep_measures_each_worker_count_and_the_largest_workers_memory, its planning within
    the budget from them tests/test_oracle_memory.py's (the bench oracle agent, the solver against brute
    force), and the scenario under the budget end to end is [adaptive]'s."""
    if setup.node_cores() < 2:
        pytest.skip("needs >= 2 cores so that `none` starts two workers per job")
    cat = tmp_path / "mem.toml"
    cat.write_text(TINY_MEMORY)
    # (`none`: no agent to wait for, and a worker holds its 200 MiB from its start: a short warm-up)
    result, _ = _run(tmp_path, str(cat), "memory", [policy], warmup_s=6.0 if policy != "none" else 1.0,
                     measure_s=4.0, loader_memory=350 << 20)
    (ph,) = result["phases"]
    assert ph["error"] is None
    m = ph["metrics"]
    assert m["loader_memory_budget_bytes"] == 350 << 20 and m["loader_memory_samples"] >= 1
    if policy == "none":
        assert m["loader_memory_max_bytes"] > 350 << 20 and m["loader_memory_over_budget_samples"] >= 1
    else:
        assert m["loader_memory_over_budget_samples"] == 0, ph["memory"]
        assert m["jobs"]["memo-0-fat"]["workers_end"] == 1
    if policy == "oracle":
        curves = json.loads((tmp_path / "out" / "runs" / "memory" / "oracle-curves.json").read_text())
        assert 200 << 20 < curves["memory"]["memo-0-fat"] < 400 << 20      # one worker: its 200 MiB and more
        assert "within the loader memory budget" in ph["agent_status"]["jobs"]["memo-0-fat"]["reason"]
    assert "samples over the budget" in (tmp_path / "out" / "bench.md").read_text()
    assert _no_children_left() == []


def test_the_gpu_study_script_runs_end_to_end_with_an_emulated_step(tmp_path):
    """``evaluation/gpu_study.sh`` (run on a lent GPU node) without a GPU: its bench options come after
    its own ``--device cuda``, so ``--device emulated`` replaces it, and a missing ``nvidia-smi`` only
    leaves dmon.log without readings. It writes its catalogue (images twice as wide, min_step_s 0.01),
    the bench's JSON and markdown, and the runs' logs as runs.tgz. (Calibrated in this process, not in
    the default three fresh ones: what this checks is the script; the fresh-process calibration is
    test_static_scenario_one_policy_end_to_end's and tests/test_bench_metrics.py's.)"""
    import subprocess
    import sys
    import tarfile
    import tomllib
    from pathlib import Path

    from tests.conftest import REPO, repo_env

    # the script's own test: cgroup.controllers at /sys/fs/cgroup is there only on the unified layout
    if os.geteuid() == 0 and Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("cgroup v2 as root: the script would move this test into a new top-level group "
                    "(/sys/fs/cgroup/adl-study-PID), which a test must not do to the machine")
    out = tmp_path / "study"
    p = subprocess.run(
        ["bash", str(Path(REPO, "evaluation", "gpu_study.sh")), str(out), "--device", "emulated",
         "--scenarios", "nothing-to-arbitrate", "--policies", "none", "--reps", "1", "--warmup-s", "1",
         "--measure-s", "2", "--cgroup-mode", "off", "--calibration-processes", "1"],
        env=repo_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    shipped = tomllib.loads(Path(REPO, "evaluation", "catalog.toml").read_text())
    ran = tomllib.loads((out / "catalog.toml").read_text())
    assert ran["min_step_s"] == 0.01
    assert {k: v["image_px"] for k, v in ran["jobs"].items()} == \
        {k: 2 * v["image_px"] for k, v in shipped["jobs"].items()}
    doc = json.loads((out / "bench.json").read_text())
    (ph,) = doc["phases"]
    assert ph["scenario"] == "nothing-to-arbitrate" and ph["error"] is None
    assert (out / "bench.md").read_text().strip()
    with tarfile.open(out / "runs.tgz") as t:
        names = t.getnames()
    assert any(n.startswith("runs/nothing-to-arbitrate/none-rep1/") and n.endswith(".jsonl") for n in names)
    assert (out / "dmon.log").exists()


def test_a_bench_killed_before_its_cleanup_leaves_no_child_running(tmp_path):
    """An agent or job runs in its own session (so ``stop`` can end its whole group); a bench killed with
    SIGKILL never reaches its finally blocks, and its children used to run on (found on the lent GPU node:
    an agent left from a bench that a timeout ended kept its cgroup, and the next bench could not start).
    Now each child gets SIGTERM when the bench process dies."""
    import subprocess
    import sys

    from tests.conftest import REPO, repo_env

    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from evaluation.harness import Proc\n"
              "p = Proc([sys.executable, '-c', 'import time; time.sleep(120)'], {}, Path(sys.argv[1]))\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(120)\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "child.log")], cwd=REPO,
                             env=repo_env(), stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(bench.stdout.readline()))
        assert child.is_running() and child.ppid() == bench.pid
        bench.kill()
        bench.wait(timeout=30)
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert not alive, f"child {child.pid} outlived the bench killed with SIGKILL"
    finally:
        bench.kill()
        if "child" in locals() and child.is_running():
            child.kill()


def test_a_second_run_into_the_same_directory_reads_only_its_own_records(tmp_path, tiny_catalog, static_run):
    """`adloader demo` twice writes to the same bench-out/demo: the jobs append to their progress files,
    and the second run measured the first run's records (a phase ended at once with a window of hours).
    The first run is ``static_run``'s (the same scenario and policy), copied here."""
    import shutil
    import time
    shutil.copytree(static_run[2] / "out", tmp_path / "out")
    first = sorted((tmp_path / "out" / "runs" / "heterogeneous" / "none-rep1").glob("*.jsonl"))
    assert len(first) == 2 and all(f.read_text().strip() for f in first)     # the first run's records are there
    t_second = time.monotonic()
    result, _ = _run(tmp_path, tiny_catalog, "heterogeneous", ["none"], warmup_s=0.5, measure_s=2.0)
    (ph,) = result["phases"]
    assert ph["error"] is None
    files = sorted((tmp_path / "out" / "runs" / "heterogeneous" / "none-rep1").glob("*.jsonl"))
    assert len(files) == 2
    for f in files:
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        starts = [r for r in recs if r.get("event") == "start"]
        assert len(starts) == 1 and starts[0]["t"] >= t_second, f     # this run's start only
        assert all(r["t"] >= t_second for r in recs if "t" in r)
    assert ph["metrics"]["window_s"] < time.monotonic() - t_second
    assert _no_children_left() == []


def test_a_phase_in_the_catalogue_and_its_errors(tmp_path):
    from evaluation.catalog import make_job, workload_for

    cat = load_catalog()
    first, *_ = cat.mixes["phase"]
    kind = cat.kinds[first]
    assert kind.phase_kind == "alexnet" and kind.phase_after_s > 0
    calib = {first: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}}
    spec = make_job(cat, calib, first, "x", seed=3, node_cores=2)
    assert spec.phases == [{"after_s": kind.phase_after_s, "workload": workload_for(cat.kinds["alexnet"], 3)}]
    assert spec.step_s == 0.1 and spec.workload == workload_for(kind, 3)     # its step stays its first phase's
    assert make_job(cat, {"alexnet": calib[first]}, "alexnet", "y", seed=3).phases == []
    p = tmp_path / "p.toml"
    for member, err in (('{kind = "x", phase_kind = "nope", phase_after_s = 2}', "phase_kind must name a kind"),
                        ('{kind = "x", phase_kind = "x"}', "phase_after_s be > 0")):
        p.write_text(f'[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{member}]\n')
        with pytest.raises(CatalogError, match=err):
            load_catalog(str(p))


def test_a_pause_in_the_catalogue_and_its_errors(tmp_path):
    from evaluation.catalog import make_job

    cat = load_catalog()
    first, *_ = cat.mixes["validating"]
    kind = cat.kinds[first]
    assert kind.pause_every_s > 0 and kind.pause_s > 0 and kind.gpus == 2
    spec = make_job(cat, {first: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}}, first, "x",
                    seed=3, node_cores=2)
    assert (spec.pause_every_s, spec.pause_s) == (kind.pause_every_s, kind.pause_s)
    assert json.loads(spec.to_json())["pause_s"] == kind.pause_s
    p = tmp_path / "p.toml"
    for member in ('{kind = "x", pause_s = 5.0}', '{kind = "x", pause_every_s = 5.0}',
                   '{kind = "x", pause_every_s = -1.0, pause_s = 5.0}'):
        p.write_text(f'[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{member}]\n')
        with pytest.raises(CatalogError, match="pause_every_s and pause_s must be >= 0 and set together"):
            load_catalog(str(p))
    for member, err in (('{kind = "x", pause_loader = true}', "pause_loader needs a pause"),
                        ('{kind = "x", pause_every_s = 5.0, pause_s = 5.0, pause_loader = 1}',
                         "pause_loader of x must be true, false or a string, got 1"),
                        ('{kind = "x", pause_every_s = 5.0, pause_s = 5.0, pause_loader = "tf"}',
                         "pause_loader must be true, false or \"torch\", got 'tf'")):
        p.write_text(f'[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{member}]\n')
        with pytest.raises(CatalogError, match=err):
            load_catalog(str(p))
    first, *_ = cat.mixes["validating-loader"]
    spec = make_job(cat, {first: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}}, first, "x",
                    seed=3, node_cores=2)
    assert spec.pause_loader and spec.pause_s > 0 and json.loads(spec.to_json())["pause_loader"] is True
    # a mix whose job pauses needs a measured window that holds a whole pause and the training before it
    member = '{kind = "x", pause_every_s = 20.0, pause_s = 10.0}'
    for windows, err in (("", "needs measure_s >= 30 .* got none"),
                         ("[windows]\nm = {warmup_s = 5, measure_s = 29}\n", "needs measure_s >= 30 .* got 29")):
        p.write_text(f'[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{member}]\n{windows}')
        with pytest.raises(CatalogError, match=r"mix 'm': x\[pause_every_s=20.0,pause_s=10.0\] pauses 10 s after every 20 s of training: \[windows\] m " + err):
            load_catalog(str(p))
    p.write_text(f'[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{member}]\n[windows]\nm = {{measure_s = 30}}\n')
    assert load_catalog(str(p)).windows["m"]["measure_s"] == 30
    first, *_ = cat.mixes["validating-torch-loader"]
    spec = make_job(cat, {first: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}}, first, "x",
                    seed=3, node_cores=2)
    assert json.loads(spec.to_json())["pause_loader"] == "torch" and spec.pause_s > 0
    assert not make_job(cat, {kind.name: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1}},
                        kind.name, "y", seed=3, node_cores=2).pause_loader


def test_a_job_process_pauses_away_from_its_loader_and_records_either_side(tmp_path):
    """A real job process whose loop stops 1 s after every 1 s of training: the pause is recorded, no sample
    is taken in it, a progress record lies at each end of it (a measured window's edge inside it counts
    none)."""
    import subprocess
    import sys

    from evaluation.harness import child_env

    wl = dict(name="l", num_images=8, length=1 << 20, image_px=64, crop_px=16, aug_multiplier=1, seed=1)
    spec = {"job_id": "pz", "kind": "l", "batch_size": 4, "step_s": 0.01, "demand_cores": 1.0,
            "cpu_s_per_sample": 0.001, "workload": wl, "pause_every_s": 1.0, "pause_s": 1.0}
    prog = tmp_path / "progress.jsonl"
    subprocess.run([sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec), "--progress", str(prog),
                    "--workers", "1", "--duration-s", "3.5"], env=child_env(), check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    recs = [json.loads(x) for x in prog.read_text().splitlines()]
    start = next(r["t"] for r in recs if r.get("event") == "start")
    pauses = [r for r in recs if r.get("event") == "pause"]
    assert 1 <= len(pauses) <= 2 and pauses[0]["t"] - start >= 1.0 and pauses[0]["pause_s"] == 1.0
    rows = [r for r in recs if "event" not in r]
    for p in pauses:
        before = max((r for r in rows if r["t"] <= p["t"]), key=lambda r: r["t"])
        after = min((r for r in rows if r["t"] > p["t"]), key=lambda r: r["t"])
        assert before["t"] == p["t"] and after["t"] - p["t"] >= 1.0
        assert after["samples"] == before["samples"]          # nothing taken while away


@pytest.mark.parametrize("pause_loader", [True, "torch"])
def test_a_job_process_validates_with_a_loader_of_its_own_in_its_pause(tmp_path, pause_loader):
    """``pause_loader``: the pause is a validation pass over a second loader (the user's one worker, a real
    process started for the pass; A-Dloader's or torch's own) of a fixed number of batches, what
    ``pause_s`` holds on an idle node (``validation_batches``): it takes them all (a "validated" record),
    none of the training loader's (the job's samples stand still across the pause), the loop is away as
    long as the pass takes, and the job ends cleanly."""
    import subprocess
    import sys

    from evaluation.harness import child_env
    from evaluation.jobproc import validation_batches

    assert validation_batches(1.0, 0.03, 4, 0.002, 1) == 100       # the forward step (0.01 s) sets the pace
    assert validation_batches(1.0, 0.03, 4, 0.005, 1) == 50        # the loader's 0.02 s a batch does
    assert validation_batches(1.0, 0.03, 4, 0.005, 2) == 100       # ... over two workers, 0.01 s
    assert validation_batches(1.0, 0.03, 4, 0.005, 0) == 33        # in-process: both, one after the other
    assert validation_batches(0.001, 0.03, 4, 0.005, 1) == 1
    wl = dict(name="l", num_images=8, length=4000, image_px=64, crop_px=16, aug_multiplier=1, seed=1)
    spec = {"job_id": "pv", "kind": "l", "batch_size": 4, "step_s": 0.03, "demand_cores": 1.0,
            "cpu_s_per_sample": 0.002, "workload": wl, "pause_every_s": 1.0, "pause_s": 1.0,
            "pause_loader": pause_loader, "num_workers": 1}
    prog = tmp_path / "progress.jsonl"
    subprocess.run([sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec), "--progress", str(prog),
                    "--workers", "1", "--duration-s", "3.0"], env=child_env(), check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    recs = [json.loads(x) for x in prog.read_text().splitlines()]
    pauses = [r for r in recs if r.get("event") == "pause"]
    done = [r for r in recs if r.get("event") == "validated"]
    assert pauses and len(done) == len(pauses)
    assert all(d["val_batches"] == 100 and d["val_samples"] == 400 for d in done)
    rows = [r for r in recs if "event" not in r]
    p, d = pauses[0], done[0]
    before = max((r for r in rows if r["t"] <= p["t"]), key=lambda r: r["t"])
    after = min((r for r in rows if r["t"] > p["t"]), key=lambda r: r["t"])
    assert after["samples"] == before["samples"] and after["t"] - p["t"] >= d["val_s"]
    assert any(r.get("event") == "done" for r in recs)


def test_a_job_process_takes_its_next_phase_pipeline_in_every_worker(tmp_path):
    """A real job process, two real DataLoader workers: a light pipeline, then 1.5 s in a heavy one (7x
    the pixels, 4 augmentation passes). The phase is recorded once, and the workers' CPU per sample
    after it is several times what it was before (a ratio of CPU costs, not a speed). The heavy kind's
    crop is larger: its samples keep the first phase's size, or a batch that straddles the change
    (each worker is mid-batch when the flag appears) does not collate and the job dies."""
    import subprocess
    import sys

    from evaluation.harness import child_env

    light = dict(name="l", num_images=8, length=1 << 20, image_px=96, crop_px=16, aug_multiplier=1, seed=1)
    heavy = dict(light, name="h", image_px=256, crop_px=64, aug_multiplier=4)
    # (a step far shorter than a batch: the workers are never idle, so each is mid-batch at the change)
    spec = {"job_id": "ph", "kind": "l", "batch_size": 8, "step_s": 0.0005, "demand_cores": 1.0,
            "cpu_s_per_sample": 0.001, "workload": light, "phases": [{"after_s": 1.5, "workload": heavy}]}
    prog = tmp_path / "progress.jsonl"
    subprocess.run([sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec), "--progress", str(prog),
                    "--workers", "2", "--duration-s", "4"], env=child_env(), check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    recs = [json.loads(x) for x in prog.read_text().splitlines()]
    (ev,) = [r for r in recs if r.get("event") == "phase"]
    start = next(r["t"] for r in recs if r.get("event") == "start")
    assert ev["index"] == 1 and ev["t"] - start >= 1.5
    rows = [r for r in recs if "event" not in r]
    before = [r for r in rows if r["t"] <= ev["t"]]
    after = [r for r in rows if r["t"] >= ev["t"] + 0.5]
    assert before and len(after) >= 2

    def cpu_per_sample(a, b):
        return (b["cpu_s"] - a["cpu_s"]) / max(1, b["samples"] - a["samples"])

    assert cpu_per_sample(after[0], after[-1]) > 3 * cpu_per_sample(rows[0], before[-1])
    assert not (tmp_path / "progress.jsonl.phase.2").exists() and (tmp_path / "progress.jsonl.phase.1").exists()


def test_a_phase_scenario_records_each_pipeline_change_as_an_event(tmp_path, tiny_catalog):
    p = tmp_path / "phase.toml"
    p.write_text(open(tiny_catalog).read().replace(
        "[mixes]\n", '[mixes]\nphase = [{kind = "light", phase_kind = "heavy", phase_after_s = 1.0}, "heavy"]\n'))
    result, _ = _run(tmp_path, str(p), "phase", ["none"], warmup_s=2.0, measure_s=1.5)
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["metrics"]["agg_normalised"] > 0
    (ev,) = [e for e in ph["events"] if e["kind"] == "phase"]
    assert ev["job"] == "phas-0-light" and "pipeline changes (phase 1)" in ev["label"]
    assert [x["index"] for x in ph["jobs"]["phas-0-light"]["phases"]] == [1] and not ph["jobs"]["phas-1-heavy"]["phases"]
    assert any(r["kind"] == "phase" for r in ph["metrics"]["reactions"])
    assert _no_children_left() == []


def test_steps_known_tells_a_job_with_fixed_work_its_steps(tmp_path, monkeypatch):
    """``adloader bench --steps-known``: a job with a fixed amount of work (the dynamic scenario's) is
    started with its steps (the samples it runs over its batch size, rounded up), and the job process
    tells its loader (``set_total_steps``), whose count down the progress records carry. Without the
    flag, or for a job without fixed work, nothing is said."""
    import subprocess
    import sys

    from evaluation import harness
    from evaluation.catalog import JobSpec

    wl = dict(name="l", num_images=8, length=1 << 20, image_px=32, crop_px=16, aug_multiplier=1, seed=1)
    spec = JobSpec(job_id="s", kind="l", batch_size=8, step_s=0.002, demand_cores=0.1, cpu_s_per_sample=0.001,
                   workload=wl, samples=100)
    cfg = harness.BenchConfig(catalog=None, calib={}, loader_cpus=1.0, node_cores=2, out_dir=tmp_path)

    class Recorded:                 # what start_job would run (nothing started)
        def __init__(self, argv, env, log_path):
            self.argv = argv

    monkeypatch.setattr(harness, "Proc", Recorded)

    def argv(c, sp):
        return harness.start_job(c, sp, tmp_path, 1, None)[0].argv

    known = dataclasses.replace(cfg, steps_known=True)
    a = argv(known, spec)
    assert a[a.index("--total-steps") + 1] == "13"                    # 100 samples / 8 a batch
    assert "--total-steps" not in argv(cfg, spec)
    assert "--total-steps" not in argv(known, dataclasses.replace(spec, samples=None))
    prog = tmp_path / "p.jsonl"
    subprocess.run([sys.executable, "-m", "evaluation.jobproc", "--spec", spec.to_json(), "--progress", str(prog),
                    "--workers", "1", "--total-steps", "13"], env=harness.child_env(ADLOADER_DISABLE="1"),
                   check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = [r for r in map(json.loads, prog.read_text().splitlines()) if "event" not in r]
    assert rows and all(r["steps_left"] == max(0, 13 - r["steps"]) for r in rows), rows
    assert rows[-1]["steps"] == 13 and rows[-1]["steps_left"] == 0


def test_free_port_is_free_and_outside_the_ephemeral_range():
    """``evaluation.slurm_cluster.free_port`` (rendezvous and daemon ports of the test harnesses): a
    port that binds now and lies below the kernel's ephemeral range, so that no ``bind(0)`` and no
    client's ``connect()`` is handed it before the server binds it."""
    import socket

    from evaluation.slurm_cluster import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low <= 2048:
        pytest.skip(f"ip_local_port_range starts at {low}: no room below it (free_port falls back to bind(0))")
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_bench_and_demo_refuse_bad_numbers_before_any_job_starts(tmp_path, capsys):
    """`adloader bench --reps 0` ran a whole repeat (0 read as "the default"), `--warmup-s -1` ran, and
    `--loader-cpus 0` ended in a ZeroDivisionError after the calibration: each is refused with exit 2
    and a message naming the option, before anything is written."""
    from agent.cli import build_parser

    out = tmp_path / "out"
    for argv, words in ((["--reps", "0"], "--reps must be at least 1"),
                        (["--warmup-s", "-1"], "--warmup-s must be 0 or more"),
                        (["--measure-s", "0"], "--measure-s must be positive"),
                        (["--tick-s", "0"], "--tick-s must be positive"),
                        (["--sweep-segment-s", "-2"], "--sweep-segment-s must be positive"),
                        (["--loader-cpus", "0"], "--loader-cpus must be in (0, "),
                        (["--loader-cpus", "100000"], "this node's CPUs"),
                        (["--loader-cpus", "many"], "'auto' or a number of cores"),
                        (["--calibration-processes", "0"], "--calibration-processes must be >= 1"),
                        (["--foreign-cores", "-0.5"], "--foreign-cores must be in [0, "),
                        (["--foreign-cores", "100000"], "--foreign-cores must be in [0, "),
                        (["--foreign-bursts", "5,10"], "--foreign-bursts needs --foreign-cores"),
                        (["--foreign-cores", "0.5", "--foreign-bursts", "5"], "two positive numbers"),
                        (["--foreign-cores", "0.5", "--foreign-bursts", "5,0"], "two positive numbers"),
                        (["--foreign-cores", "0.5", "--foreign-bursts", "5,inf"], "two positive numbers"),
                        (["--foreign-cores", "0.5", "--foreign-bursts", "a,b"], "two positive numbers")):
        args = build_parser().parse_args(["bench", "--out", str(out), *argv])
        assert args.func(args) == 2, argv
        assert words in capsys.readouterr().err, argv
    for argv, words in ((["--measure-s", "0"], "--measure-s must be positive"),
                        (["--warmup-s", "-2"], "--warmup-s must be 0 or more"),
                        (["--calibration-processes", "-1"], "--calibration-processes must be >= 1")):
        args = build_parser().parse_args(["demo", "--out", str(out), *argv])
        assert args.func(args) == 2, argv
        assert words in capsys.readouterr().err, argv
    for argv in (["bench", "--tick-s", "nan"], ["demo", "--warmup-s", "inf"]):   # refused as they are read
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([argv[0], "--out", str(out), *argv[1:]])
        assert e.value.code == 2 and f"argument {argv[1]}: a finite number expected" in capsys.readouterr().err
    assert not out.exists()


def test_bench_and_demo_refuse_an_unusable_output_directory_before_the_calibration(tmp_path, capsys, monkeypatch):
    """`adloader bench --out /proc/x` was a FileNotFoundError traceback, `--out FILE` a FileExistsError, and
    `--out /proc` (a directory that exists but takes no files) ran the calibration and the phases before
    it failed: each is now one line naming --out, exit 2, before anything runs."""
    from agent.cli import build_parser

    def must_not_run(**_):
        raise AssertionError("the run started")
    monkeypatch.setattr(setup, "run", must_not_run)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out, words in (("/proc/x", "cannot create the directory"), (str(a_file), "not a directory"),
                       ("/proc", "cannot write in it"), (str(a_file / "sub"), "cannot create the directory")):
        for command in ("bench", "demo"):
            args = build_parser().parse_args([command, "--out", out])
            assert args.func(args) == 2, (command, out)
            err = capsys.readouterr().err
            assert err.startswith(f"adloader {command}: --out {out}: ") and words in err, err
            assert err.count("\n") == 1, err
    assert a_file.read_text() == "" and list(tmp_path.iterdir()) == [a_file]


def test_plan_files_load_in_both_forms_and_bad_ones_are_refused(tmp_path, capsys):
    """``plan:FILE``: best_plan's output gives per scenario the repeat whose plan has the median
    aggregate; a hand-written plan is taken as it is; a bad file, or one without a plan for a scenario
    asked for, is refused with exit 2 and a message naming it, before anything runs."""
    from agent.cli import build_parser
    from evaluation.harness import BenchError, load_plans, plan_file, policy_dirname

    rows = [{"scenario": "oversubscribed", "rep": r, "best_plan_agg": agg, "loaders_yield": r != 1,
             "best_plan": {"a": [1, w], "b": [2, 1.8 - w]}} for r, agg, w in ((0, 1.30, 0.4), (1, 1.20, 0.5), (2, 1.25, 0.6))]
    rows.append({"scenario": "gpu-weighted", "rep": 0, "best_plan_agg": 2.0, "loaders_yield": True,
                 "best_plan": {"a": [3, 1.0]}})
    searched = tmp_path / "searched.json"
    searched.write_text(json.dumps({"rows": rows, "summary": []}))
    plans = load_plans(searched)
    assert plans["oversubscribed"] == {"plan": {"a": {"workers": 1, "cpus": 0.6}, "b": {"workers": 2, "cpus": 1.8 - 0.6}},
                                       "loaders_yield": True}          # rep 2: 1.25 is the median of 1.20, 1.25, 1.30
    assert plans["gpu-weighted"]["plan"] == {"a": {"workers": 3, "cpus": 1.0}}
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"plans": {"heterogeneous": {"x": {"workers": 2, "cpus": 0.5}}}}))
    assert load_plans(hand) == {"heterogeneous": {"plan": {"x": {"workers": 2, "cpus": 0.5}}, "loaders_yield": None}}
    assert plan_file(f"plan:{hand}") == hand and plan_file("adaptive") is None
    assert policy_dirname(f"plan:{hand}") == "plan-hand" and policy_dirname("none") == "none"
    for doc, why in (("{", "cannot read it as JSON"),
                     (json.dumps({"plan": {}}), "expected evaluation.best_plan's output"),
                     (json.dumps({"plans": {"s": {"x": {"workers": 0, "cpus": 1}}}}), "workers >= 1 and cpus > 0 (not x)"),
                     (json.dumps({"plans": {"s": {"x": {"cpus": 1}}}}), "each job needs workers and cpus"),
                     (json.dumps({"plans": {"s": {}}}), "the plan names no job"),
                     (json.dumps({"plans": {"s": {"x": {"workers": 1, "cpus": 1}}}, "loaders_yield": "yes"}),
                      "loaders_yield must be true or false")):
        bad = tmp_path / "bad.json"
        bad.write_text(doc)
        with pytest.raises(BenchError, match=re.escape(why)):
            load_plans(bad)
    out = tmp_path / "out"
    for argv, words in ((["--scenarios", "trainer-cpu", "--policies", f"none,plan:{searched}"],
                         f"plan file {searched} has no plan for scenario trainer-cpu"),
                        (["--scenarios", "heterogeneous", "--policies", f"plan:{tmp_path / 'absent.json'}"],
                         "cannot read it as JSON"),
                        (["--policies", "plan"], "unknown scenario/policy: plan")):
        args = build_parser().parse_args(["bench", "--out", str(out), *argv])
        assert args.func(args) == 2, argv
        assert words in capsys.readouterr().err, argv
    assert not out.exists()


def test_a_plan_policy_runs_the_agent_with_that_fixed_plan(tmp_path, tiny_catalog):
    """``plan:FILE``: the real agent applies the file's workers and CPU weights to the scenario's jobs
    (the jobs asked for their habitual workers) and the loaders' yield the file says."""
    plan = tmp_path / "myplan.json"
    plan.write_text(json.dumps({"plans": {"heterogeneous": {"hete-0-heavy": {"workers": 1, "cpus": 0.7},
                                                            "hete-1-light": {"workers": 1, "cpus": 0.3}}},
                                "loaders_yield": True}))
    policy = f"plan:{plan}"
    result, progress = _run(tmp_path, tiny_catalog, "heterogeneous", [policy], warmup_s=1.5, measure_s=1.5)
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["policy"] == policy
    # the jobs asked for their habitual workers (the node's CPUs, 2 or more); the plan's are 1
    assert {j: x["workers_end"] for j, x in ph["metrics"]["jobs"].items()} == {"hete-0-heavy": 1, "hete-1-light": 1}
    doc = json.loads((tmp_path / "out" / "runs" / "heterogeneous" / "plan-myplan-rep1" / "agent-status.json").read_text())
    jobs = {j["job"]: j for j in doc["jobs"]}
    for j, want in (("hete-0-heavy", 0.7), ("hete-1-light", 0.3)):
        assert jobs[j]["requested_workers"] >= 2
        assert jobs[j]["cpus"] == pytest.approx(want)
        assert jobs[j]["reason"] == f"fixed plan from {plan}"
    # the plan's yield is applied, and said to be the plan's also on a tick where the agent's own rule
    # agrees (it yields once it measures the trainers at TRAINER_CPU_MIN, 0.05 cores: 2 of 10 runs here did)
    assert doc["node"]["loaders_yield"] is True and doc["node"]["reason"] == "the plan's: loaders yield"
    assert f"[1/1] heterogeneous {policy} rep 1:" in progress
    assert _no_children_left() == []


def test_a_plan_for_other_jobs_is_refused_before_a_phase_runs(tmp_path, tiny_catalog):
    """A plan naming jobs the scenario does not have (searched on another node's mix) would run every
    job at the even share under the plan's name: refused, naming them, before any phase."""
    from evaluation.harness import BenchError

    plan = tmp_path / "other.json"
    plan.write_text(json.dumps({"plans": {"heterogeneous": {"0-heavy[num_workers=8]": {"workers": 1, "cpus": 0.5}}}}))
    with pytest.raises(BenchError, match=re.escape("names job(s) 0-heavy[num_workers=8] it does not have "
                                                   "(its jobs: hete-0-heavy, hete-1-light)")):
        _run(tmp_path, tiny_catalog, "heterogeneous", ["none", f"plan:{plan}"], warmup_s=0.5, measure_s=0.5)
    assert not (tmp_path / "out" / "runs").exists()
    assert _no_children_left() == []
    from evaluation.harness import scenario_plans

    with pytest.raises(BenchError, match=re.escape("share the phase folder(s) plan-other")):
        scenario_plans([], [f"plan:{plan}", f"plan:{tmp_path / 'sub' / 'other.json'}"])


def test_foreign_load_splits_into_duty_cycled_processes_that_sleep():
    """``--foreign-cores``: ceil(CORES) processes sharing CORES in equal duty cycles, none for 0; a
    process runs its busy part of each period and sleeps the rest (it never takes a whole CPU)."""
    import subprocess
    import sys
    import time

    import psutil

    from evaluation import harness

    assert harness.foreign_load(0.0) == [] and harness.foreign_load(-1.0) == []
    assert harness.foreign_load(0.5) == [0.5]
    assert harness.foreign_load(1.0) == [1.0]
    assert harness.foreign_load(1.5) == [0.75, 0.75]
    p = subprocess.Popen([sys.executable, "-c", harness.FOREIGN_SCRIPT, "0.3", "0.05"])
    try:
        proc = psutil.Process(p.pid)
        time.sleep(2.5)
        # over its whole life: a process starved for a while runs its missed periods back to back
        # (it keeps its rate, not each period's shape), so only the whole span is bounded by the duty
        used = sum(proc.cpu_times()[:2]) / (time.time() - proc.create_time())
        assert p.poll() is None
        assert 0.0 < used < 0.6, used           # busy 30% of the wall clock at most, plus slack
    finally:
        p.kill()
        p.wait()


def test_bursts_of_foreign_load_sleep_through_each_off_time():
    """``--foreign-bursts ON_S,OFF_S``: the process is busy in its on-times (a duty of 1: all of it) and
    takes no CPU in its off-times, on a schedule counted from the origin it is given (every process of a
    phase shares one). An off-time is measured right after an on-time in which the process was seen
    spinning (so it is up and in its loop), both inside their times: a sample that fell outside (a slow
    machine) is taken again in a later cycle."""
    import subprocess
    import sys
    import time

    import psutil

    from evaluation import harness

    on, off = 0.3, 0.5
    origin = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", harness.FOREIGN_SCRIPT, "1.0", "0.05", repr(on), repr(off),
                          repr(origin)])
    try:
        proc = psutil.Process(p.pid)
        cpu = lambda: sum(proc.cpu_times()[:2])     # noqa: E731
        quiet = busy = None
        for k in range(1, 16):              # cycle k: [origin + k (on + off), ... + on) on, then off
            start = origin + k * (on + off)
            # an on-time first (it spins: the process is up and in its loop), then the off-time after it
            time.sleep(max(0.0, start + 0.02 - time.monotonic()))
            t0, c0 = time.monotonic(), cpu()
            time.sleep(max(0.0, start + on - 0.02 - time.monotonic()))
            t1, c1 = time.monotonic(), cpu()
            if busy is None and start <= t0 and t1 <= start + on:
                busy = (c1 - c0) / (t1 - t0)
            if busy is None or busy <= 0.05:   # not up yet (or starved): another cycle
                busy = None
                continue
            time.sleep(max(0.0, start + on + 0.08 - time.monotonic()))
            t0, c0 = time.monotonic(), cpu()
            time.sleep(max(0.0, start + on + off - 0.05 - time.monotonic()))
            t1, c1 = time.monotonic(), cpu()
            if start + on + 0.05 <= t0 and t1 <= start + on + off:    # both samples inside the off-time
                quiet = c1 - c0
                break
        assert p.poll() is None
        assert busy is not None, "never seen spinning in an on-time"    # (any share of a CPU it gets)
        assert quiet is not None and quiet < 0.03, quiet        # asleep (clock ticks: 10 ms steps)
    finally:
        p.kill()
        p.wait()


def test_a_bench_with_foreign_load_runs_it_beside_the_jobs_and_stops_it(tmp_path, tiny_catalog):
    """``adloader bench --foreign-cores 0.5 --foreign-bursts 1,0.5``: the load runs through the phase, on
    and off (the bench sees the node busier than its jobs and agent: ``node_other_cores``), the JSON says
    how much and how, and nothing it started is left running."""
    result, _ = _run(tmp_path, tiny_catalog, "heterogeneous", ["none"], warmup_s=0.5, measure_s=2.0,
                     foreign_cores=0.5, foreign_bursts=(1.0, 0.5))
    (ph,) = result["phases"]
    assert ph["error"] is None and ph["metrics"]["agg_normalised"] > 0
    assert ph["metrics"]["node_other_cores"] > 0.02
    assert (Path(ph["run_dir"]) / "foreign0.log").exists()
    assert not (Path(ph["run_dir"]) / "foreign1.log").exists()
    meta = json.loads((tmp_path / "out" / "bench.json").read_text())["meta"]
    assert meta["foreign_cores"] == 0.5 and meta["foreign_bursts"] == [1.0, 0.5]
    assert _no_children_left() == []
