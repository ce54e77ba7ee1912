"""Unit tests for the trace-driven simulator (``evaluation.simulate``): tiny traces, real policy code."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation import simulate as S
from predictor.curve import ThroughputCurve
from tests.conftest import REPO, adloader_cmd, repo_env


def _cv(name, cores_needed, g=0.1, bs=32):
    return ThroughputCurve(job=name, batch_size=bs, compute_s_per_step=g, cpu_s_per_batch=cores_needed * g,
                           blocked_s_per_batch=0.0, confidence=1.0)


CURVES = {"heavy": _cv("heavy", 3.0), "mid": _cv("mid", 1.0), "light": _cv("light", 0.25)}


@pytest.mark.unit
def test_waterfill_respects_caps_and_weights():
    got = S.waterfill(4.0, {"a": 1, "b": 1, "c": 2}, {"a": 0.5, "b": 10, "c": 10})
    assert got["a"] == pytest.approx(0.5)
    assert got["b"] == pytest.approx(3.5 / 3)
    assert got["c"] == pytest.approx(7.0 / 3)
    assert sum(got.values()) == pytest.approx(4.0)
    # everyone capped below capacity: nothing more is handed out
    got = S.waterfill(4.0, {"a": 1, "b": 1}, {"a": 0.5, "b": 1.0})
    assert got == pytest.approx({"a": 0.5, "b": 1.0})


@pytest.mark.unit
def test_trace_files_csv_and_jsonl(tmp_path):
    csv_p = tmp_path / "t.csv"
    csv_p.write_text("node,job,kind,arrival_s,work_s\nn0,a,heavy,0,10\nn0,b,light,5,4\n")
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"node": "n0", "job": "a", "kind": "heavy", "arrival_s": 0, "work_s": 10, "gpus": 2}\n')
    assert [t.job for t in S.read_trace(str(csv_p))] == ["a", "b"]
    assert S.read_trace(str(jl))[0].gpus == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("node,job,arrival_s,work_s\nn0,a,0,1\n")
    with pytest.raises(S.SimError, match="missing column 'kind'"):
        S.read_trace(str(bad))


@pytest.mark.unit
def test_a_trace_row_with_impossible_numbers_or_a_file_that_is_not_text_is_refused(tmp_path):
    # (before: NaN or negative work_s and arrival_s, and 0 GPUs, were simulated and reported as results;
    # a directory or a binary file was a traceback)
    row = {"node": "n0", "job": "a", "kind": "heavy", "arrival_s": 0, "work_s": 10}
    jl = tmp_path / "t.jsonl"
    for key, value, words in (("work_s", "NaN", "work_s must be a finite number > 0"),
                              ("work_s", "-3", "work_s must be"), ("work_s", "1e400", "work_s must be"),
                              ("arrival_s", "-5", "arrival_s must be a finite number >= 0"),
                              ("gpus", "0", "gpus must be at least 1")):
        jl.write_text(json.dumps(row)[:-1] + f', "{key}": {value}}}\n')
        with pytest.raises(S.SimError, match=f"t.jsonl:1: {words}"):
            S.read_trace(str(jl))
    jl.write_text("[1, 2]\n")
    with pytest.raises(S.SimError, match="t.jsonl:1: not a JSON object"):
        S.read_trace(str(jl))
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00")
    for p in (binary, tmp_path):
        with pytest.raises(S.SimError, match="cannot read it as text"):
            S.read_trace(str(p))
    # a file with no job in it is refused, not simulated as nothing (a table of dashes, exit 0)
    for name, text in (("empty.csv", ""), ("header.csv", "node,job,kind,arrival_s,work_s\n"), ("blank.jsonl", "\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(S.SimError, match=f"{name}: no jobs"):
            S.read_trace(str(tmp_path / name))


@pytest.mark.unit
def test_a_node_or_trace_that_cannot_be_simulated_is_refused_with_the_option_named():
    """Bad node shapes and generated-trace sizes are refused before any policy runs (a node of -3 cores
    reached the policy as a ZeroDivisionError); `adloader simulate` exits 2 with the message."""
    for kw, words in (({"cores": -3.0}, r"cores \(--cores\) must be a positive"), ({"cores": 0}, "cores"),
                      ({"gpus": 0}, r"gpus \(--gpus\)"), ({"cores": 4.0, "loader_cpus": 6.0}, r"\(0, cores=4\]"),
                      ({"tick_s": 0.0}, "tick_s"), ({"settle_ticks": -1}, "settle_ticks"),
                      ({"cpu_knob": "cpuset"}, "shares or quota"), ({"steps_known": 1.5}, r"\[0, 1\]"),
                      ({"available_cores": -1.0}, "available_cores")):
        with pytest.raises(S.SimError, match=words):
            S.SimConfig(**kw)
    assert S.SimConfig(cores=2, gpus=1, loader_cpus=2.0).loader == 2.0
    for args, words in (((0, 8, 30.0, 300.0), "at least one node"), ((2, 0, 30.0, 300.0), "one job per node"),
                        ((2, 2, -1.0, 300.0), "--mean-gap-s"), ((2, 2, 30.0, 0.0), "--mean-work-s")):
        with pytest.raises(S.SimError, match=words):
            S.generate_trace(["heavy"], *args)
    with pytest.raises(S.SimError, match="one job kind"):
        S.generate_trace([], 1, 1, 30.0, 300.0)
    p = subprocess.run(adloader_cmd("simulate", "--curves", "builtin", "--cores", "-3"), env=repo_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cores (--cores) must be a positive number" in p.stderr and "Traceback" not in p.stderr


def _trace():
    return [S.TraceJob("n0", "a", "heavy", 0.0, 20.0), S.TraceJob("n0", "b", "mid", 0.0, 20.0),
            S.TraceJob("n0", "c", "light", 5.0, 10.0), S.TraceJob("n1", "d", "mid", 0.0, 8.0),
            S.TraceJob("n1", "e", "mid", 2.0, 8.0)]


@pytest.mark.unit
def test_tiny_trace_every_policy_finishes_and_oracle_is_the_ceiling():
    cfg = S.SimConfig(cores=3.0, gpus=3, loader_cpus=2.0, predictor="perfect")
    res = S.simulate(_trace(), CURVES, ["even-static", "even", "none", "adaptive", "oracle"], cfg, processes=1)
    s = res["summary"]
    assert res["nodes"] == 2 and res["jobs"] == 5
    for p, row in s.items():
        assert 0 < row["agg_normalised"] <= 3.0 + 1e-9, p
        assert 0.0 <= row["gpu_idle_frac"] <= 1.0
        assert row["makespan_mean_s"] > 0 and row["jct_p95_s"] >= row["jct_mean_s"] - 1e-9


@pytest.mark.unit
def test_oracle_plan_is_the_best_instantaneous_allocation_under_the_node_physics(monkeypatch):
    # (the arithmetic below is the curves' own: without the CPU that time slicing 3 workers on 2 CPUs
    # adds, which the oracle's curves do not know; that cost has its own test)
    from evaluation import nodemodel

    monkeypatch.setattr(nodemodel, "OVERSUB_CPU_PER_DOUBLING", 0.0)
    from agent.model import NodeSnapshot
    from tests.fakes import UNMEASURED, job_stats
    from agent.policies import PolicyConfig, get_policy

    def stats(j):
        return job_stats(j, **UNMEASURED, workers=1)

    snap = NodeSnapshot(now=0.0, loader_cpus=2.0, cpu_ids=(0, 1), jobs={j: stats(j) for j in CURVES}, max_jobs=3)

    from evaluation.nodemodel import JobModel, node_rates

    models = {j: JobModel(curve=cv) for j, cv in CURVES.items()}      # no trainer CPU: the loaders alone

    def total(plan):
        rates = node_rates(models, "agent", 2.0, plan.allocations)
        return sum(r.normalised for r in rates.values())

    best = total(S._policy("oracle")(snap, CURVES, PolicyConfig()))
    # light 0.25 + mid 1.0 saturate, heavy gets 0.75 of its 3 cores: 1 + 1 + 0.25
    assert best == pytest.approx(2.25, abs=0.02)
    for name in ("even-static", "even", "none", "adaptive"):
        assert best >= total(get_policy(name)(snap, CURVES, PolicyConfig())) - 0.02, name
    # the even split leaves the heavy and mid jobs 0.875 cores each: 0.29 + 0.875 + 1
    assert total(get_policy("even")(snap, CURVES, PolicyConfig())) == pytest.approx(2.167, abs=0.02)


@pytest.mark.unit
def test_node_arithmetic_of_one_job_alone():
    # one job needing 1 core, 2 loader cores: runs at its ceiling; JCT = work
    cfg = S.SimConfig(cores=2.0, gpus=1, loader_cpus=2.0, predictor="perfect")
    r = S.simulate_node([S.TraceJob("n", "x", "mid", 3.0, 10.0)], CURVES, "even", cfg)
    assert r["jobs"]["x"]["jct_s"] == pytest.approx(10.0, rel=0.002)
    assert r["jobs"]["x"]["norm_mean"] == pytest.approx(1.0, rel=0.002)
    assert r["makespan_s"] == pytest.approx(10.0, rel=0.002)


@pytest.mark.unit
def test_learning_predictor_runs_the_agents_bank():
    cfg = S.SimConfig(cores=3.0, gpus=3, loader_cpus=2.0, predictor="first-principles")
    res = S.simulate(_trace(), CURVES, ["adaptive"], cfg, processes=1)
    assert res["summary"]["adaptive"]["decisions"] > 0
    with pytest.raises(S.SimError, match="unknown kinds: nope"):
        S.simulate([S.TraceJob("n", "x", "nope", 0, 1)], CURVES, ["even"], cfg)


@pytest.mark.component
def test_simulate_command_on_a_tiny_trace(tmp_path):
    tr = tmp_path / "t.csv"
    tr.write_text("node,job,kind,arrival_s,work_s\nn0,a,alexnet,0,10\nn0,b,bert,2,5\nn1,c,resnet50,0,6\n")
    out = tmp_path / "sim.json"
    p = subprocess.run(adloader_cmd("simulate", "--trace", str(tr), "--curves", "builtin", "--policies",
                                    "even,adaptive,oracle", "--cores", "4", "--gpus", "2", "--processes", "1",
                                    "--out", str(out)),
                       env=repo_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| adaptive |" in p.stdout
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"even", "adaptive", "oracle"}
    assert doc["nodes"] == 2 and not math.isnan(doc["summary"]["even"]["agg_normalised"])


@pytest.mark.component
def test_the_simulator_does_not_depend_on_the_string_hash_seed(tmp_path):
    """The simulator's figures are stated as deterministic (any machine gives them): they must not
    depend on the process's string-hash seed. The node model's water-filling iterated a set of job ids,
    and its float sums with it: one generated 48-core node under ``none`` gave figures that differed
    in their 4th digit between seeds. (The three runs go at once: they share nothing but the CPUs.)"""
    runs = {}
    for seed in ("1", "2", "3"):
        out = tmp_path / f"sim{seed}.json"
        runs[seed] = (out, subprocess.Popen(
            adloader_cmd("simulate", "--curves", "builtin", "--nodes", "1", "--jobs-per-node", "10",
                         "--mean-gap-s", "15", "--cores", "48", "--gpus", "16", "--policies", "none",
                         "--seed", "5", "--processes", "1", "--out", str(out)),
            env=repo_env(PYTHONHASHSEED=seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    docs = set()
    try:
        for out, p in runs.values():
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            docs.add(json.dumps(json.loads(out.read_text())["summary"], sort_keys=True))
    finally:
        for _, p in runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(docs) == 1


@pytest.mark.unit
def test_generated_traces_leave_out_a_catalogue_kind_that_changes_phase():
    """The bench's phase kind (BERT-like turning AlexNet-like 5 s in) has a first-phase curve only: a
    generated trace drawing it would run a job that never changes as if it were that kind. Drawing it
    also changed every seed's trace when it was added to the catalogue (the 16-core trace's figures)."""
    curves = S.builtin_curves()
    phased = {k for k, cv in curves.items() if cv.extra.get("phase_kind")}
    assert phased and phased <= set(curves)
    kinds = S.trace_kinds(curves)
    assert set(kinds) == set(curves) - phased and kinds == sorted(kinds)
    trace = S.generate_trace(kinds, 20, 8, 30.0, 300.0, seed=5)
    assert not {tj.kind for tj in trace} & phased


@pytest.mark.unit
def test_simulate_list_kinds_names_every_kind_with_its_demand(capsys):
    # (it called a helper the one-node-model change had removed, and crashed)
    from agent.cli import build_parser

    args = build_parser().parse_args(["simulate", "--curves", "builtin", "--list-kinds"])
    assert args.func(args) == 0
    lines = {ln.split(":")[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(S.builtin_curves())
    assert "6.00 loader cores per GPU at the ceiling, 2 GPU(s)" in lines["resnet18x2"]
    assert "1.00 loader cores per GPU at the ceiling, 1 GPU(s)" in lines["bert"]


@pytest.mark.unit
def test_simulate_s_catalog_picks_the_builtin_kinds_and_is_refused_with_the_corpus(tmp_path, capsys):
    """``--catalog`` with the default ``--curves auto`` was ignored in silence where the corpus exists
    (the corpus's kinds ran); now it means builtin, and with ``--curves corpus`` it is an error."""
    from agent.cli import build_parser

    cat = tmp_path / "one.toml"
    src = (REPO / "evaluation" / "catalog.toml").read_text()
    cat.write_text(src)
    args = build_parser().parse_args(["simulate", "--catalog", str(cat), "--list-kinds"])
    assert args.func(args) == 0
    assert {ln.split(":")[0] for ln in capsys.readouterr().out.splitlines()} == set(S.builtin_curves(str(cat)))
    args = build_parser().parse_args(["simulate", "--curves", "corpus", "--catalog", str(cat), "--list-kinds"])
    assert args.func(args) == 2 and "--catalog is for --curves builtin" in capsys.readouterr().err


@pytest.mark.unit
def test_simulate_refuses_an_unusable_out_file_before_it_simulates(tmp_path, capsys, monkeypatch):
    """`adloader simulate --out /proc/x.json` simulated every node and then died of a FileNotFoundError
    traceback: the file is checked first now (one line, exit 2)."""
    from agent.cli import build_parser

    def must_not_run(*_, **__):
        raise AssertionError("the simulation started")
    monkeypatch.setattr(S, "simulate", must_not_run)
    for out, words in (("/proc/x.json", "cannot write"), (str(tmp_path), "is a directory"),
                       (str(tmp_path / "no" / "x.json"), "no such directory")):
        args = build_parser().parse_args(["simulate", "--curves", "builtin", "--nodes", "1", "--out", out])
        assert args.func(args) == 2, out
        err = capsys.readouterr().err
        assert err.startswith(f"adloader simulate: --out {out}: ") and words in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_memory_per_worker_and_a_node_budget():
    """The simulator models each worker's memory and the node's loader memory budget: without a budget
    the peak says what the trace needs; under one, adaptive stays within it and none does not."""
    import dataclasses

    GiB = 1 << 30
    curves = {k: dataclasses.replace(cv, worker_memory_bytes=(2 * GiB if k == "heavy" else 0.25 * GiB))
              for k, cv in CURVES.items()}
    trace = [S.TraceJob("n0", f"j{i}", kind, arrival_s=i * 5.0, work_s=60.0)
             for i, kind in enumerate(["heavy", "mid", "light", "heavy"])]
    free = S.simulate(trace, curves, ["none", "adaptive"], S.SimConfig(cores=8, gpus=4, requested_workers=4),
                      processes=1)["summary"]
    need = free["adaptive"]["loader_memory_peak_max_bytes"]
    assert need > 6 * GiB and free["none"]["loader_memory_peak_max_bytes"] >= 2 * 4 * 2 * GiB
    budget = 5.5 * GiB                     # the floor is 4.5 GiB: one worker per job (2 + 2 + 0.25 + 0.25)
    tight = S.simulate(trace, curves, ["none", "adaptive"],
                       S.SimConfig(cores=8, gpus=4, requested_workers=4, loader_memory=budget), processes=1)
    s = tight["summary"]
    assert s["adaptive"]["loader_memory_peak_max_bytes"] <= budget
    assert s["adaptive"]["memory_over_budget_frac"] == 0.0 and s["none"]["memory_over_budget_frac"] > 0.5
    assert s["adaptive"]["agg_normalised"] < free["adaptive"]["agg_normalised"]     # the budget costs throughput
    assert "loader memory peak per node" in S.markdown(tight)


@pytest.mark.unit
def test_every_decision_is_a_tick_of_the_agents_controller(monkeypatch):
    """The simulator runs the real Controller.tick (its tolerance, observation spacing, cold start),
    not a copy of it: every decision it counts is one controller tick."""
    from agent.controller import Controller

    ticks = []
    real = Controller.tick

    def counting(self, now):
        ticks.append(now)
        return real(self, now)

    monkeypatch.setattr(Controller, "tick", counting)
    cfg = S.SimConfig(cores=4.0, gpus=2, loader_cpus=3.0, tick_s=1.0)
    res = S.simulate_node(_trace()[:2], CURVES, "adaptive", cfg)
    assert res["decisions"] == len(ticks) > 2 and ticks == sorted(ticks)


@pytest.mark.unit
def test_node_model_modes_on_a_trainer_heavy_mix():
    """The workload model's physics (evaluation.nodemodel): with no agent the kernel shares per job and a
    job's busy workers stretch its trainer's CPU part; static cores idle what a job cannot use; the agent
    keeps the trainers' cores out of the loaders' budget. Every mode stays within the node's CPUs."""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def model(name, loader_cores, trainer_frac, gpus=1, habit=2):
        cv = ThroughputCurve(job=name, batch_size=64 * gpus, compute_s_per_step=0.1,
                             cpu_s_per_batch=loader_cores * 0.1, blocked_s_per_batch=0.0, confidence=1.0)
        return N.JobModel(curve=cv, trainer_cpu_s_per_step=trainer_frac * 0.1, gpus=gpus, habitual_workers=habit)

    models = {"heavy": model("heavy", 1.5, 0.3), "mid": model("mid", 0.45, 0.2), "light": model("light", 0.15, 0.4)}
    for mode in ("none", "autotune", "static"):
        r = N.node_rates(models, mode, 2.0)
        assert sum(x.loader_cores + x.trainer_cores for x in r.values()) <= 2.0 + 1e-6, mode
        assert all(0 < x.normalised <= 1 for x in r.values())
    none = N.node_rates(models, "none", 2.0)
    static = N.node_rates(models, "static", 2.0)
    assert static["light"].loader_cores + static["light"].trainer_cores <= 2.0 / 3 + 1e-6
    assert N.objective(models, static) <= N.objective(models, none) + 1e-9      # hard shares idle cores
    truth = {j: N.curve_with_workload(m.curve, m.trainer_cpu_s_per_step, m.gpus, m.habitual_workers)
             for j, m in models.items()}
    cfg = S.SimConfig(cores=2.0, gpus=3, loader_cpus=1.8, tick_s=1.0, predictor="perfect")
    steady = {p: S.steady_state(truth, p, cfg)["window_agg"] for p in ("none", "static-cores", "even-static", "adaptive")}
    assert steady["none"] == pytest.approx(N.objective(models, none), rel=1e-9)      # the physics alone
    # with the loaders weighted (loaders_yield = never) the agent's trainers are not sheltered on a
    # saturated node: the loaders' subtree weighs its planned cores on the CPUs its busy workers run on,
    # so a trainer waking there waits (the snapshot says so, as the loader reports main_runq_s); with
    # the loaders yielding (the default) a trainer waits only for the other trainers
    never = dataclasses.replace(cfg, loaders_yield="never")
    r = S.steady_state(truth, "adaptive", never)
    assert r["rates"]["light"]["trainer_runq_s_per_step"] > 0
    # the same as a variant's option (``adaptive[loaders_yield=never]``: once a duplicate keyword)
    variant = dataclasses.replace(cfg, policy_options=(("loaders_yield", "never"),))
    assert S.steady_state(truth, "adaptive", variant)["window_agg"] == r["window_agg"]
    assert sum(x["loader_cores"] + x["trainer_cores"] for x in r["rates"].values()) <= 2.0 + 1e-6
    y = S.steady_state(truth, "adaptive", cfg)
    assert y["rates"]["light"]["trainer_runq_s_per_step"] < 0.5 * r["rates"]["light"]["trainer_runq_s_per_step"]
    assert sum(x["loader_cores"] + x["trainer_cores"] for x in y["rates"].values()) <= 2.0 + 1e-6
    assert y["window_agg"] >= r["window_agg"] - 1e-9
    # an unsaturated node: every policy reaches its ceilings but for the trainers' rare wake-ups on a
    # node with no idle CPU (both CPUs busy: 0.15^2 of the time here; the agent's yielding loaders are
    # never in a trainer's way); a hard quota of one core per job is a budget per period that these jobs
    # (0.3 cores each) never spend, not a slower CPU (measured: the quiet 2-core nothing-to-arbitrate
    # mix, static-cores 0.98x none). What a rare wake-up costs is the model's own figure: about 1.4% of
    # the aggregate with the other job's group weighing WAKE_GROUP_WEIGHT (1.5) there, 0.6% at 1.0; the
    # measured quiet nothing-to-arbitrate mix puts none and autotune at 0.95-0.96x even-static
    small = {j: N.curve_with_workload(model(j, 0.2, 0.1).curve, 0.01, 1, 2) for j in ("a", "b")}
    cfg2 = S.SimConfig(cores=2.0, gpus=2, loader_cpus=1.8, tick_s=1.0, predictor="perfect")
    agg = {p: S.steady_state(small, p, cfg2)["window_agg"] for p in ("none", "autotune", "adaptive", "static-cores")}
    assert agg["adaptive"] == pytest.approx(2.0, rel=1e-4)
    assert agg["static-cores"] == pytest.approx(agg["none"], rel=1e-6)
    for p in ("none", "autotune"):
        assert 2.0 * 0.98 < agg[p] < 2.0


@pytest.mark.unit
def test_no_agent_node_is_work_conserving():
    """The kernel gives the CPU a job leaves (its trainer on the GPU, waiting for a CPU) to the jobs that
    can run: on a saturated node with no agent the jobs use every core, and a loader-bound job beside a
    trainer-bound one runs on more than the even water level. (Before: each job held to the level its
    full-speed demand gave, the modelled none left 15% of the 2-core node idle that the bench measured
    busy, issue 11 thirteenth-pass runs: 1.69 of 2 cores simulated, 1.96 measured.)"""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def model(name, loader_cores, trainer_frac, gpus=1, habit=2):
        cv = ThroughputCurve(job=name, batch_size=64 * gpus, compute_s_per_step=0.1,
                             cpu_s_per_batch=loader_cores * 0.1, blocked_s_per_batch=0.0, confidence=1.0)
        return N.JobModel(curve=cv, trainer_cpu_s_per_step=trainer_frac * 0.1, gpus=gpus, habitual_workers=habit)

    models = {"hungry": model("hungry", 2.0, 0.1, gpus=2, habit=1), "bert": model("bert", 0.15, 0.5),
              "alex": model("alex", 1.8, 0.2)}
    for mode in ("none", "autotune"):
        r = N.node_rates(models, mode, 2.0)
        used = sum(x.loader_cores + x.trainer_cores for x in r.values())
        assert used == pytest.approx(2.0, rel=2e-3), mode
        assert r["alex"].loader_cores + r["alex"].trainer_cores > 2.0 / 3, mode
    # a node the jobs cannot fill keeps its idle CPU; the jobs run at their ceilings but for their
    # trainers' run-queue waits: each trainer's own worker, woken with the next index as its step starts,
    # computes beside its CPU part, so the other job's one runnable thread fills both CPUs (twenty-first
    # pass; the average loads alone made that wait rare: 0.99+)
    small = {"a": model("a", 0.3, 0.1), "b": model("b", 0.3, 0.1)}
    r = N.node_rates(small, "none", 2.0)
    assert sum(x.loader_cores + x.trainer_cores for x in r.values()) < 1.0
    for x in r.values():
        assert x.trainer_runq_s_per_step > 0.0 and x.data_wait_s_per_step == pytest.approx(0.0, abs=1e-9)
        assert x.normalised == pytest.approx(0.1 / (0.1 + x.trainer_runq_s_per_step), rel=1e-6)
        assert 0.97 < x.normalised < 0.99


@pytest.mark.unit
def test_the_worker_woken_as_the_step_starts_runs_beside_the_trainers_cpu_part(monkeypatch):
    """A DataLoader dispatches the next index when the training process takes a batch: in a fed job the
    worker that gets it computes while the trainer's CPU part runs. The model counts it runnable then
    (per rank, for the shorter of the two), not at its average load; a loader-bound job's workers are
    busy anyway (their average); a trainer without CPU has nothing to wait for."""
    from evaluation import nodemodel as N
    from predictor.curve import SharedCpuState, ThroughputCurve

    def model(loader_cores, trainer_frac, gpus=1, habit=2):
        cv = ThroughputCurve(job="j", batch_size=64 * gpus, compute_s_per_step=0.1,
                             cpu_s_per_batch=loader_cores * 0.1, blocked_s_per_batch=0.0, confidence=1.0)
        return N.JobModel(curve=cv, trainer_cpu_s_per_step=trainer_frac * 0.1, gpus=gpus, habitual_workers=habit)

    fed = SharedCpuState(640.0, 1.0, 1.0, 0.3)
    # batch 30 ms per rank against a 10 ms part: one worker beside it the whole part
    assert N.woken_beside_trainer(model(0.3, 0.1), 2, fed) == pytest.approx(1.0)
    # two ranks, a batch each of 15 ms against a 20 ms part (stretched to 40 ms at half a CPU)
    assert N.woken_beside_trainer(model(0.3, 0.2, gpus=2), 4, SharedCpuState(640.0, 0.5, 1.0, 0.3)) == \
        pytest.approx(2 * 0.015 / 0.04)
    assert N.woken_beside_trainer(model(0.3, 0.2, gpus=2), 1, fed) == pytest.approx(1.0 * 0.015 / 0.02)
    # loader-bound: its two workers busy all the time
    assert N.woken_beside_trainer(model(3.0, 0.1), 2, SharedCpuState(200.0, 1.0, 1.0, 2.0)) == 2.0
    assert N.woken_beside_trainer(model(0.3, 0.0), 2, fed) == 0.3
    # in the node: two fed jobs on 2 CPUs, each trainer's wait with the woken worker against the same
    # node with its workers at their average load
    jobs = {"a": model(0.3, 0.1), "b": model(0.3, 0.1)}
    woken = N.node_rates(jobs, "none", 2.0)
    monkeypatch.setattr(N, "woken_beside_trainer", lambda m, w, st: st.runnable_workers)
    spread = N.node_rates(jobs, "none", 2.0)
    for j in jobs:
        assert woken[j].trainer_runq_s_per_step > 1.5 * spread[j].trainer_runq_s_per_step > 0
        assert woken[j].normalised < spread[j].normalised


@pytest.mark.unit
def test_trainer_wakes_inside_its_groups_share_of_the_cpu():
    """CFS splits a group's weight over the CPUs by its load on each: a trainer whose job's workers run on
    other CPUs wakes inside a light group entity and gets less of the CPU than a trainer in a group of
    its own (the agent's trainers), and less the more CPUs its group spreads over."""
    from evaluation.nodemodel import own_group_weight, wakeup_share

    assert own_group_weight(2.0, trainers=0.3, workers=0.0) == pytest.approx(1.0)     # all its load is there
    assert own_group_weight(2.0, trainers=0.0, workers=0.0) == 1.0
    two = own_group_weight(2.0, trainers=0.3, workers=1.5)
    sixteen = own_group_weight(16.0, trainers=0.3, workers=1.5)
    assert 0 < sixteen < two < 1
    assert two == pytest.approx((0.3 + 1.5 / 2) / 1.8)
    # two ranks on two CPUs: each carries half the trainers' load
    assert own_group_weight(2.0, trainers=0.6, workers=0.0, ranks=2) == pytest.approx((0.3 + 0.3 / 2) / 0.6)
    alone = wakeup_share(2.0, others_threads=3.0, spread_weight=2.0)
    light = wakeup_share(2.0, others_threads=3.0, spread_weight=2.0, own_weight=two)
    assert light == pytest.approx(two / (two + 1.0)) and light < alone == pytest.approx(0.5)
    # an idle CPU left still gives a whole core
    assert wakeup_share(16.0, others_threads=4.0, spread_weight=4.0, own_weight=sixteen) == 1.0


@pytest.mark.unit
def test_simulator_runs_the_no_agent_baselines_with_the_workload_model():
    curves = S.builtin_curves()
    assert curves["resnet18x2"].batch_size == 128 and curves["resnet18x2"].extra["gpus"] == 2
    trace = [S.TraceJob("n0", "a", "alexnet", 0.0, 5.0), S.TraceJob("n0", "b", "resnet18x2", 1.0, 5.0, gpus=2),
             S.TraceJob("n0", "c", "bert", 2.0, 5.0)]
    cfg = S.SimConfig(cores=4.0, gpus=4, predictor="perfect")
    res = S.simulate(trace, curves, ["none", "autotune", "static-cores", "adaptive"], cfg, processes=1)
    for p, r in res["summary"].items():
        assert r["agg_normalised"] > 0, p
        assert r["jct_mean_s"] > 0, p


@pytest.mark.unit
def test_validate_sim_puts_the_simulator_next_to_a_measured_run():
    """evaluation.validate_sim on a small synthetic bench JSON: every static phase goes through the
    simulator (the controller for the agent policies), one row per policy with the measured and the
    simulated ratios, taken within each repeat; a phase that left a GPU short gets the CPU its jobs used."""
    from evaluation import validate_sim as V

    spec = lambda k, demand, frac, gpus=1: {"kind": k, "batch_size": 64 * gpus, "step_s": 0.1, "demand_cores": demand,
                                            "trainer_cpu_frac": frac, "gpus": gpus, "num_workers": 2}
    specs = {"a": spec("heavy", 1.8, 0.2, gpus=2), "b": spec("mid", 0.5, 0.3), "c": spec("light", 0.15, 0.35)}

    def jobs(cpu):     # per-job figures as the bench writes them; the jobs used `cpu` cores in all
        return {j: {"worker_cpu_cores": cpu / 6, "trainer_cpu_cores": cpu / 6, "normalised": 0.5} for j in specs}

    phases = []
    for rep, vals in enumerate(({"none": 1.5, "adaptive": 1.8, "static-cores": 1.2,
                                 "adaptive[floor_fraction=0.95]": 1.9, "adaptive[cgroup_mode=off]": 1.0},
                                {"none": 1.6, "adaptive": 1.7, "static-cores": 1.1,
                                 "adaptive[floor_fraction=0.95]": 1.8, "adaptive[cgroup_mode=off]": 1.0})):
        for p, v in vals.items():
            phases.append({"scenario": "gpu-weighted", "kind": "static", "policy": p, "rep": rep, "warmup_s": 6,
                           "window": [100.0, 112.0], "metrics": {"agg_normalised": v, "jobs": jobs(2.0)},
                           "specs": specs})
    bench = {"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0}, "phases": phases}
    rows = V.validate(bench, capacity="node")
    by = {r["policy"]: r for r in rows}
    # an agent variant is simulated with its keys; one with a key that is not the policies' (the
    # cgroup mode: the simulator has no cgroups) is left out
    assert set(by) == {"none", "adaptive", "static-cores", "adaptive[floor_fraction=0.95]"}
    assert by["adaptive"]["reps"] == by["adaptive[floor_fraction=0.95]"]["reps"] == 2
    assert by["adaptive[floor_fraction=0.95]"]["measured_best"] == pytest.approx((1.9 / 1.5 + 1.8 / 1.6) / 2)
    by.pop("adaptive[floor_fraction=0.95]")
    assert by["adaptive"]["measured_none"] == pytest.approx((1.8 / 1.5 + 1.7 / 1.6) / 2)
    assert by["adaptive"]["measured_best"] == pytest.approx((1.8 / 1.5 + 1.7 / 1.6) / 2)
    assert by["none"]["measured_best"] == pytest.approx((1.5 / 1.2 + 1.6 / 1.1) / 2)
    # the simulated side: the same jobs in the simulator, the agent ahead of both user baselines here
    assert all(0 < by[p]["sim_agg"] <= 4.0 for p in by)
    assert by["adaptive"]["sim_none"] == pytest.approx(by["adaptive"]["sim_agg"] / by["none"]["sim_agg"])
    assert by["adaptive"]["sim_best"] == pytest.approx(
        by["adaptive"]["sim_agg"] / max(by["none"]["sim_agg"], by["static-cores"]["sim_agg"]))
    assert by["adaptive"]["sim_agg"] == pytest.approx(by["adaptive"]["sim_node_agg"])
    assert "| gpu-weighted | adaptive | 2 |" in V.markdown_validation(rows)
    # measured capacity: a phase in which other tenants took 0.8 of the node's 2 cores (the bench's
    # node_other_cores) is simulated with 1.2 cores, which lowers every simulated aggregate
    for ph in phases:
        ph["metrics"]["node_other_cores"] = 0.8
    low = {r["policy"]: r for r in V.validate(bench)}
    assert low["none"]["capacity"] == low["static-cores"]["capacity"] == pytest.approx(1.2)
    assert all(low[p]["sim_agg"] < by[p]["sim_agg"] for p in by)
    # files without that measurement: the jobs' own use where they kept the node busy and a GPU was
    # short; where they left it largely idle (1.2 of 2 cores) the shortfall was not the CPU they could
    # get: the node's cores
    for ph in phases:
        del ph["metrics"]["node_other_cores"]
        ph["metrics"]["jobs"] = jobs(1.9)
    assert {r["policy"]: r["capacity"] for r in V.validate(bench)}["none"] == pytest.approx(1.9)
    for ph in phases:
        ph["metrics"]["jobs"] = jobs(1.2)
    idle = {r["policy"]: r for r in V.validate(bench)}
    assert all(idle[p]["capacity"] == 2.0 and idle[p]["sim_agg"] == pytest.approx(by[p]["sim_agg"]) for p in by)
    with pytest.raises(ValueError, match="unknown capacity"):
        V.validate(bench, capacity="nope")


@pytest.mark.unit
def test_ideal_bound_fills_the_cores_by_gpu_weight_per_core_and_no_policy_passes_it():
    """evaluation.validate_sim.ideal_bound: jobs needing (loader + trainers) 2.2 cores for 2 GPUs, 0.8
    for one, 0.5 for one, on 2 cores: the two cheap ones whole, the 2-GPU job 0.7 of its 2.2 cores
    (2.636); with cores for all, the GPUs' count; with every job first given 0.9 of its static-cores
    part, less. Every policy's simulated aggregate stays under it, and validate's rows carry both over
    each repeat's measured best baseline."""
    from evaluation import validate_sim as V
    from evaluation.nodemodel import curves_from_bench_specs

    spec = lambda demand, frac, gpus=1: {"batch_size": 64 * gpus, "step_s": 0.1, "demand_cores": demand,
                                         "trainer_cpu_frac": frac, "gpus": gpus, "num_workers": 2}
    specs = {"a": spec(1.8, 0.2, gpus=2), "b": spec(0.5, 0.3), "c": spec(0.15, 0.35)}
    truth = curves_from_bench_specs(specs)
    assert V.ideal_bound(truth, 2.0) == pytest.approx(1 + 1 + 2 * 0.7 / 2.2)
    assert V.ideal_bound(truth, 3.5) == pytest.approx(4.0) == V.ideal_bound(truth, 50)
    assert V.ideal_bound(truth, 0.4) == pytest.approx(0.8)          # the cheapest job's part only
    # each job first 0.9 of its static-cores part (cores x GPUs / 4: 1.0, 0.5, 0.5; b needs 0.8, c 0.5):
    # 0.9, 0.45, 0.45; the 0.2 left: c's last 0.05, then 0.15 to b
    assert V.ideal_bound(truth, 2.0, fairness=0.9) == pytest.approx(2 * 0.9 / 2.2 + 0.6 / 0.8 + 1)
    # the rule with measured static-cores throughputs (a 0.5, b 1.0; c none): a 0.99 and b 0.72
    # cores first, the 0.29 left to c
    static = {"a": 0.5, "b": 1.0}
    assert V.ideal_bound(truth, 2.0, 0.9, static) == pytest.approx(2 * 0.99 / 2.2 + 0.72 / 0.8 + 0.29 / 0.5)
    phases = [{"scenario": "trainer-cpu", "kind": "static", "policy": p, "rep": rep, "warmup_s": 6,
               "window": [100.0, 112.0], "metrics": {"agg_normalised": v}, "specs": specs}
              for rep, vals in enumerate(({"none": 1.5, "adaptive": 1.8}, {"none": 1.6, "adaptive": 1.7}))
              for p, v in vals.items()]
    # repeat 1 has a static-cores phase: its jobs' measured throughputs set that repeat's fair bound
    phases.append({**phases[-1], "policy": "static-cores", "metrics": {
        "agg_normalised": 1.0, "jobs": {j: {"normalised": v} for j, v in static.items()}}})
    rows = V.validate({"meta": {"node_cores": 2, "loader_cpus": 1.8}, "phases": phases}, capacity="node")
    bound = V.ideal_bound(truth, 2.0)
    assert all(r["bound_best"] == pytest.approx((bound / 1.5 + bound / 1.6) / 2) for r in rows)
    fair = (V.ideal_bound(truth, 2.0, fairness=0.9) / 1.5 + V.ideal_bound(truth, 2.0, 0.9, static) / 1.6) / 2
    assert all(r["bound_fair_best"] == pytest.approx(fair) for r in rows)
    assert all(r["sim_agg"] <= bound for r in rows)
    study = V.node_study(16, 8, policies=("none", "even-static", "adaptive"), mixes=("trainer-cpu",),
                         warmup_s=10.0, measure_s=10.0)["trainer-cpu"]
    assert all(study[p] <= study["_bound"] + 1e-9 for p in ("none", "even-static", "adaptive")), study
    assert study["_bound_fair"] < study["_bound"]


@pytest.mark.unit
def test_validate_sim_per_job_view_names_the_mechanism():
    """``validate_jobs``: per scenario, policy and job, the measured figures next to the simulator's
    (medians over repeats); the trainer's run-queue wait per step is the measured run-queue cores over
    each rank's steps/s; the sum of the simulated jobs' GPU-weighted normalised throughput is the
    simulated aggregate ``validate`` compares."""
    from evaluation import validate_sim as V

    spec = lambda demand, frac, gpus=1: {"batch_size": 64 * gpus, "step_s": 0.1, "demand_cores": demand,
                                         "trainer_cpu_frac": frac, "gpus": gpus, "num_workers": 8}
    specs = {"a": spec(1.8, 0.25, gpus=2), "b": spec(0.45, 0.15)}
    phases = []
    for rep, wait in enumerate((0.2, 0.4, 0.3)):
        jobs = {"a": {"normalised": 0.25, "samples_per_s": 0.25 * 1280, "worker_cpu_cores": 0.7,
                      "trainer_cpu_cores": 0.1, "trainer_runq_cores": wait * 2 * 2.5, "workers_end": 16,
                      "throttled_frac": 0.2 + wait},
                "b": {"normalised": 0.6, "samples_per_s": 384.0, "worker_cpu_cores": 0.2,
                      "trainer_cpu_cores": 0.1, "trainer_runq_cores": 0.6, "workers_end": 8}}
        phases.append({"scenario": "oversubscribed", "kind": "static", "policy": "none", "rep": rep, "warmup_s": 6,
                       "window": [0.0, 12.0], "metrics": {"agg_normalised": 1.1, "jobs": jobs}, "specs": specs})
    bench = {"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0}, "phases": phases}
    rows = {r["job"]: r for r in V.validate_jobs(bench, capacity="node")}
    assert set(rows) == {"a", "b"} and rows["a"]["reps"] == 3 and rows["a"]["gpus"] == 2
    # a: 320 samples/s = 2.5 batches/s = 1.25 steps/s per rank; runq cores = wait * 2 ranks * 2.5 -> wait * 2 s/step
    assert rows["a"]["measured_wait"] == pytest.approx(0.3 * 2)
    assert rows["b"]["measured_wait"] == pytest.approx(0.6 / 6.0)
    assert rows["a"]["measured_norm"] == 0.25 and rows["b"]["workers"] == 8
    assert rows["a"]["measured_throttled"] == pytest.approx(0.5) and rows["b"]["measured_throttled"] is None
    sim_agg = V.validate(bench, capacity="node")[0]["sim_agg"]
    assert 2 * rows["a"]["sim_norm"] + rows["b"]["sim_norm"] == pytest.approx(sim_agg)
    assert all(r["sim_wait"] >= 0 and 0 < r["sim_norm"] <= 1 for r in rows.values())
    # a worker's CPU per sample over the calibrated one (demand x step per batch): a 0.7 / 320 over
    # 1.8 x 0.1 / 128, b 0.2 / 384 over 0.45 x 0.1 / 64; the simulated one carries time slicing's cost
    assert rows["a"]["measured_cpu_x"] == pytest.approx((0.7 / 320) / (0.18 / 128))
    assert rows["b"]["measured_cpu_x"] == pytest.approx((0.2 / 384) / (0.045 / 64))
    assert all(r["sim_cpu_x"] >= 1.0 for r in rows.values())
    table = V.markdown_jobs(list(rows.values()))
    assert "| oversubscribed | none | a | 2 | 16 | 0.250 / " in table
    assert "| 0.50 | 1.56 / " in table.splitlines()[2] and "| – | 0.74 / " in table.splitlines()[3]


@pytest.mark.unit
def test_validate_sim_can_charge_each_job_the_loader_cost_its_workers_paid(tmp_path, capsys):
    """``--cost measured``: a job's loader CPU per sample in the simulator is what its workers paid in the
    run (per policy, measured over simulated CPU per sample, medians over repeats; the median over the
    policies), not the calibration. A job whose workers paid 1.56x its calibration gets dearer in the
    simulator, one that paid 0.74x cheaper; the simulator then charges what the run measured. A job whose
    pipeline changes mid-run keeps its calibration."""
    from evaluation import validate_sim as V

    spec = lambda demand, frac, gpus=1: {"batch_size": 64 * gpus, "step_s": 0.1, "demand_cores": demand,
                                         "cpu_s_per_sample": demand * 0.1 / 64, "trainer_cpu_frac": frac,
                                         "gpus": gpus, "num_workers": 8}
    specs = {"a": spec(1.8, 0.25, gpus=2), "b": spec(0.45, 0.15)}
    phases = []
    for policy in ("none", "even-static"):
        for rep in range(3):
            jobs = {"a": {"normalised": 0.25, "samples_per_s": 320.0, "worker_cpu_cores": 0.7, "trainer_cpu_cores": 0.1},
                    "b": {"normalised": 0.6, "samples_per_s": 384.0, "worker_cpu_cores": 0.2, "trainer_cpu_cores": 0.1}}
            phases.append({"scenario": "oversubscribed", "kind": "static", "policy": policy, "rep": rep,
                           "warmup_s": 6, "window": [0.0, 12.0], "metrics": {"agg_normalised": 1.1, "jobs": jobs},
                           "specs": specs})
    bench = {"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0}, "phases": phases}
    before = V.validate_jobs(bench, capacity="node")
    factors = V.measured_costs(bench, capacity="node")
    for j in ("a", "b"):
        ratios = [r["measured_cpu_x"] / r["sim_cpu_x"] for r in before if r["job"] == j]
        assert len(ratios) == 2 and factors[("oversubscribed", j)] == pytest.approx(sum(ratios) / 2)
    # a paid (0.7 / 320) / (0.18 / 128) = 1.56x its calibration, b (0.2 / 384) / (0.045 / 64) = 0.74x; the
    # simulator's own slicing cost (>= 1) is taken out, not counted twice
    assert 1.0 < factors[("oversubscribed", "a")] < 1.56 and factors[("oversubscribed", "b")] < 0.74
    scaled, same = V.with_measured_costs(bench, capacity="node")
    assert same == factors and bench["phases"][0]["specs"]["a"]["demand_cores"] == 1.8     # the input is untouched
    for ph in scaled["phases"]:
        for j, sp in ph["specs"].items():
            f = factors[("oversubscribed", j)]
            assert sp["demand_cores"] == pytest.approx(specs[j]["demand_cores"] * f)
            assert sp["cpu_s_per_sample"] == pytest.approx(specs[j]["cpu_s_per_sample"] * f)
    after = {(r["policy"], r["job"]): r for r in V.validate_jobs(scaled, capacity="node")}
    for r in before:
        now = after[(r["policy"], r["job"])]
        # the dearer job's simulated throughput falls, the cheaper one's rises ...
        assert (now["sim_norm"] < r["sim_norm"]) if r["job"] == "a" else (now["sim_norm"] >= r["sim_norm"])
        # ... and the simulator now charges each job about what its workers paid
        paid = r["measured_cpu_x"] * specs[r["job"]]["cpu_s_per_sample"]
        charged = now["sim_cpu_x"] * specs[r["job"]]["cpu_s_per_sample"] * factors[("oversubscribed", r["job"])]
        assert charged == pytest.approx(paid, rel=0.05), (r["policy"], r["job"])
    # a job whose pipeline changes mid-run has no single cost: left at its calibration
    phased = {**specs["b"], "phases": [{"after_s": 5.0, "workload": {"name": "x"}}]}
    for ph in bench["phases"]:
        ph["specs"] = {"a": specs["a"], "b": phased}
    assert ("oversubscribed", "b") not in V.measured_costs(bench, capacity="node")
    # the command: the factors printed and in the JSON
    path = tmp_path / "bench.json"
    for ph in bench["phases"]:
        ph["specs"] = specs
    path.write_text(json.dumps(bench))
    out = tmp_path / "rows.json"
    assert V.main([str(path), "--cost", "measured", "--capacity", "node", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {c["job"]: c["x_calibrated"] for c in doc["costs"][str(path)]} == pytest.approx(
        {j: factors[("oversubscribed", j)] for j in ("a", "b")})
    calibrated = tmp_path / "calibrated.json"
    V.main([str(path), "--capacity", "node", "--out", str(calibrated)])
    assert "costs" not in json.loads(calibrated.read_text())
    with pytest.raises(SystemExit):
        V.main([str(path), "--cost", "guessed"])
    # a file that is not a bench.json: refused naming it, no traceback (report.read_bench)
    for text, why in (('{"rows": []}', "not an `adloader bench` bench.json"), ("[1, 2", "cannot read it as JSON")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            V.main([str(bad)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert str(bad) in err and why in err, err


@pytest.mark.unit
def test_validate_sim_counts_the_rows_within_five_percent(tmp_path, capsys):
    """The issue's target as the command prints it: per run, how many rows put the simulated ratio over
    the best baseline within 5% of the measured one, which are outside (largest first), and with several
    runs the count over all of them, also in the JSON."""
    from evaluation import validate_sim as V

    rows = [{"scenario": "mix", "policy": "a", "measured_best": 1.00, "sim_best": 1.04},
            {"scenario": "mix", "policy": "b", "measured_best": 0.80, "sim_best": 0.88},     # 10% over
            {"scenario": "mix", "policy": "c", "measured_best": 1.20, "sim_best": 1.10},     # 8.3% under
            {"scenario": "mix", "policy": "d", "measured_best": None, "sim_best": 1.0}]      # not counted
    s = V.within_summary(rows)
    assert (s["rows"], s["within"]) == (3, 1)
    assert [o["policy"] for o in s["outside"]] == ["b", "c"]
    assert s["max_diff"] == pytest.approx(0.10) and s["mean_diff"] == pytest.approx((0.04 + 0.10 + 0.1 / 1.2) / 3)
    assert "1 of 3 rows within 5%" in V.markdown_within(s, "run") and "mix b 10.0%" in V.markdown_within(s, "run")
    # the command, on two copies of a small run: per run and over both
    spec = {"batch_size": 64, "step_s": 0.1, "demand_cores": 0.9, "cpu_s_per_sample": 0.9 * 0.1 / 64,
            "trainer_cpu_frac": 0.2, "gpus": 1, "num_workers": 4}
    phases = [{"scenario": "mix", "kind": "static", "policy": policy, "rep": rep, "warmup_s": 6,
               "window": [0.0, 12.0], "specs": {"x": spec, "y": spec},
               "metrics": {"agg_normalised": agg, "jobs": {}}}
              for rep in range(2) for policy, agg in (("none", 1.5), ("even-static", 1.6), ("adaptive", 1.7))]
    paths = []
    for name in ("one.json", "two.json"):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps({"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0},
                                         "phases": phases}))
    out = tmp_path / "rows.json"
    assert V.main([str(p) for p in paths] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    per_run = doc["within"][str(paths[0])]
    assert per_run["rows"] == 3 and doc["within_all"]["rows"] == 6
    assert doc["within_all"]["within"] == 2 * per_run["within"]
    assert f"this run: {per_run['within']} of 3 rows" in printed
    assert f"all 2 runs: {doc['within_all']['within']} of 6 rows" in printed


@pytest.mark.unit
def test_validate_sim_runs_a_job_whose_pipeline_changes_with_its_later_phase():
    """The bench's ``phase`` scenario: a job's spec carries its later workload; the simulator runs it with
    that phase, whose cost per sample is the run's calibrated job with the same workload (its seed
    aside). Before, validate_sim skipped the scenario. A phase whose workload no job of the run has is
    still skipped: its cost is not known."""
    from evaluation import validate_sim as V

    light = {"name": "bert", "image_px": 96, "crop_px": 32, "aug_multiplier": 1, "seed": 100}
    heavy = {"name": "alexnet", "image_px": 256, "crop_px": 64, "aug_multiplier": 2, "seed": 101}

    def spec(w, cpu, step, phases=()):
        return {"batch_size": 64, "step_s": step, "cpu_s_per_sample": cpu, "demand_cores": cpu * 64 / step,
                "trainer_cpu_frac": 0.3, "gpus": 1, "num_workers": 2, "workload": w, "phases": list(phases)}

    later = [{"after_s": 5.0, "workload": {**heavy, "seed": 100}}]
    specs = {"p": spec(light, 0.0002, 0.04, later), "a": spec(heavy, 0.0015, 0.05), "s": spec(light, 0.0002, 0.06)}
    phases_of, extra = V.phase_curves(specs)
    assert phases_of == {"p": ((5.0, "p@phase1"),)}
    assert extra["p@phase1"]["demand_cores"] == pytest.approx(0.0015 * 64 / 0.04)    # the job's step, a's cost
    assert extra["p@phase1"]["step_s"] == 0.04 and not extra["p@phase1"]["phases"]
    bench_phases = []
    for rep in range(2):
        for pol, agg in (("even-static", 0.85), ("adaptive", 0.84), ("static-cores", 0.82)):
            jobs = {j: {"normalised": 0.28, "samples_per_s": 400.0, "worker_cpu_cores": 0.55,
                        "trainer_cpu_cores": 0.1} for j in specs}
            bench_phases.append({"scenario": "phase", "kind": "static", "policy": pol, "rep": rep, "warmup_s": 30,
                                 "window": [0.0, 12.0], "metrics": {"agg_normalised": agg, "jobs": jobs},
                                 "specs": specs})
    bench = {"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0}, "phases": bench_phases}
    rows = {r["policy"]: r for r in V.validate(bench, capacity="node")}
    assert set(rows) == {"even-static", "adaptive", "static-cores"}
    # simulated with the phase: the changed job needs 2.4 cores now, so no policy feeds it on 2 cores
    per_job = {(r["policy"], r["job"]): r for r in V.validate_jobs(bench, capacity="node")}
    assert set(j for _, j in per_job) == {"p", "a", "s"}
    assert all(per_job[(pol, "p")]["sim_norm"] < 0.5 for pol in rows)
    # its CPU per sample is set against the later phase's calibration (a's), not its first
    assert per_job[("even-static", "p")]["measured_cpu_x"] == pytest.approx((0.55 / 400.0) / 0.0015)
    # without the phase the same job would be fed (0.3 cores at 0.0002 s a sample)
    calm = {**bench, "phases": [{**ph, "specs": {**specs, "p": spec(light, 0.0002, 0.04)}} for ph in bench_phases]}
    calm_jobs = {(r["policy"], r["job"]): r for r in V.validate_jobs(calm, capacity="node")}
    assert calm_jobs[("even-static", "p")]["sim_norm"] > 0.9
    # a later workload no job of the run has: skipped
    odd = {**specs, "p": spec(light, 0.0002, 0.04, [{"after_s": 5.0, "workload": {**heavy, "crop_px": 128}}])}
    assert V.phase_curves(odd) == (None, {})
    assert V.validate({**bench, "phases": [{**ph, "specs": odd} for ph in bench_phases]}, capacity="node") == []


@pytest.mark.unit
def test_validate_sim_dynamic_rows_against_a_stored_run():
    """The dynamic rows: measured medians over the repeats beside the simulated figures, ratios to none
    and to the best other baseline (the issue's target: adaptive under 1 on both)."""
    import statistics
    from pathlib import Path

    from evaluation import validate_sim as V

    path = Path(__file__).resolve().parent.parent / "evaluation/results/bench_issue11_twentieth_dynamic_full.json"
    bench = json.loads(path.read_text())
    rows = {r["policy"]: r for r in V.validate_dynamic(bench)}
    assert set(rows) == {"none", "autotune", "even-static", "adaptive"}
    span = {p: statistics.median(ph["metrics"]["makespan_s"] for ph in bench["phases"] if ph["policy"] == p)
            for p in rows}
    assert rows["adaptive"]["measured_makespan_s"] == pytest.approx(span["adaptive"])
    assert rows["adaptive"]["measured_makespan_s_x_best"] == pytest.approx(
        span["adaptive"] / min(span[p] for p in ("none", "autotune", "even-static")))
    assert rows["none"]["measured_makespan_s_x_best"] == pytest.approx(
        span["none"] / min(span[p] for p in ("autotune", "even-static")))
    assert rows["none"]["measured_makespan_s_x_none"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["sim_makespan_s"] > 0 and r["sim_jct_mean_s"] > 0 and r["sim_makespan_s_x_best"] > 0
    table = V.markdown_dynamic(list(rows.values()))
    assert "| × best other baseline: measured / sim (difference) |" in table
    assert all(f"\n| {p} | {span[p]:.1f} / " in table for p in rows)


@pytest.mark.unit
def test_bigger_node_study_fills_the_gpus_and_keeps_the_controllers_records():
    from evaluation import validate_sim as V

    study = V.node_study(16, 8, mixes=("gpu-weighted", "nothing-to-arbitrate"), warmup_s=10, measure_s=10)
    assert all(v["_gpus"] == 8 for v in study.values())
    assert study["nothing-to-arbitrate"]["adaptive"] == pytest.approx(8.0)     # nothing to arbitrate: costs nothing
    assert all(v["adaptive"] >= 0.9 * max(v[p] for p in V.BASELINES) for v in study.values())
    rec = study["gpu-weighted"]["_records"]["adaptive"]
    assert rec["plan"] and set(rec["plan"]) == set(rec["window"]) == set(rec["desired"])
    assert all(a["reason"] for a in rec["plan"].values()) and all(a["reason"] for a in rec["desired"].values())
    assert "| 0-resnet18x2 |" in V.markdown_records(study)
    # the fairness figure: static-cores against itself is 1; the floor keeps adaptive's worst job at
    # 0.9x its static-cores throughput in the gpu-weighted mix; without the floor one job is starved
    # (0.02x: its cores buy more elsewhere)
    worst = study["gpu-weighted"]["_worst_vs_static"]
    assert worst["static-cores"] == pytest.approx(1.0) and worst["adaptive"] >= 0.9
    old = V.node_study(16, 8, mixes=("gpu-weighted",), warmup_s=10, measure_s=10,
                       policy_options=(("fairness_floor", False),))
    assert old["gpu-weighted"]["_worst_vs_static"]["adaptive"] < 0.5
    assert "| adaptive's worst job / its static-cores throughput |" in V.markdown_study(study, 16, 8)


@pytest.mark.unit
def test_unified_simulator_invariants():
    """Whatever the policy: the jobs never use more CPU than the node (or than the CPU other tenants
    leave them), no job runs above its ceiling, the snapshot figures the controller reads are
    consistent (compute + data wait = the step; the trainer's CPU wait is part of compute), and a
    static quota never gives a job more than its GPU share of the node."""
    from evaluation import nodemodel as N

    truth = S.builtin_curves()
    mix = {j: truth[k] for j, k in (("a", "resnet18x2"), ("b", "alexnet"), ("c", "bert"))}
    for avail in (None, 1.2):
        cfg = S.SimConfig(cores=2.0, gpus=4, loader_cpus=1.8, tick_s=1.0, available_cores=avail)
        for p in ("none", "autotune", "static-cores", "even-static", "adaptive"):
            r = S.steady_state(mix, p, cfg, warmup_s=5, measure_s=5)
            used = sum(x["loader_cores"] + x["trainer_cores"] for x in r["rates"].values())
            assert used <= (avail or 2.0) + 1e-6, (p, avail)
            assert all(0 < v <= 1 + 1e-9 for v in r["window"].values()), p
            for j, x in r["rates"].items():
                step = 1.0 / (x["samples_per_s"] / mix[j].batch_size)
                assert x["compute_s_per_step"] + x["data_wait_s_per_step"] == pytest.approx(step, rel=1e-6)
                assert x["compute_s_per_step"] >= mix[j].compute_s_per_step - 1e-9
                assert x["trainer_runq_s_per_step"] == pytest.approx(x["compute_s_per_step"] - mix[j].compute_s_per_step,
                                                                     abs=1e-9)
                if p == "static-cores":
                    assert x["loader_cores"] + x["trainer_cores"] <= 2.0 * mix[j].extra["gpus"] / 4 + 1e-6
    models = {j: N.job_model(cv, cv.extra["gpus"], 1) for j, cv in mix.items()}
    with pytest.raises(ValueError, match="unknown mode"):
        N.node_rates(models, "nope", 2.0)


@pytest.mark.unit
def test_wakeup_share_of_a_trainer():
    """A trainer that wakes on a CPU: a whole core where a CPU is idle, less the more weight runs where
    it wakes; the loaders' subtree weighs only on the CPUs its busy workers use."""
    from evaluation.nodemodel import wakeup_share

    assert wakeup_share(16.0, others_threads=4.0, spread_weight=4.0) == 1.0              # idle CPUs left
    assert wakeup_share(2.0, others_threads=2.0, spread_weight=2.0) == pytest.approx(0.5)  # 1 / (1 + 2/2)
    heavy = wakeup_share(2.0, 3.0, group_weight=12.0, group_threads=3.0)
    light = wakeup_share(2.0, 3.0, group_weight=3.0, group_threads=3.0)
    assert 0 < heavy < light < 1
    # one busy worker of a heavy subtree sits on one of 16 CPUs: most wake-ups miss it
    assert wakeup_share(16.0, 16.0, group_weight=40.0, group_threads=1.0) > 0.9
    for cpus in (1.0, 2.0, 16.0):
        for w in (0.0, 1.0, 8.0, 100.0):
            s = wakeup_share(cpus, cpus + 1.0, spread_weight=w / 2, group_weight=w, group_threads=min(w, cpus))
            assert 0 < s <= 1


@pytest.mark.unit
def test_a_waking_trainer_finds_no_idle_cpu_only_when_others_fill_them():
    """all_cpus_busy: at least as many of the other threads runnable as there are CPUs (binomial over
    the threads). Measured on the 2-core VM (a thread sleeping 100 ms, then busy 20 ms): beside one busy
    thread 0.06 ms of run-queue wait per wake-up, beside two half-busy threads 3.3 ms."""
    from evaluation.nodemodel import all_cpus_busy, wakeup_share

    assert all_cpus_busy(2.0, load=1.0, threads=1) == 0.0           # one thread cannot fill two CPUs
    assert all_cpus_busy(2.0, load=1.0, threads=2) == pytest.approx(0.25)
    assert all_cpus_busy(2.0, load=2.0, threads=2) == 1.0
    assert all_cpus_busy(2.0, load=0.0, threads=8) == 0.0
    assert 0.85 < all_cpus_busy(2.0, load=3.5, threads=20) < 0.95   # a saturated node: almost always
    assert all_cpus_busy(16.0, load=8.0, threads=32) < 0.01          # half a big node: hardly ever
    # other tenants' use of the last CPU counts as one more thread that busy
    assert all_cpus_busy(1.87, load=1.0, threads=2) > all_cpus_busy(2.0, load=1.0, threads=2)
    # the stretch of a trainer's CPU part: the mean over wake-ups with and without an idle CPU
    s = wakeup_share(2.0, others_threads=1.0, spread_weight=1.0, others_count=2)
    assert s == pytest.approx(1.0 / (0.75 + 0.25 / (1.0 / 1.5)))
    assert wakeup_share(2.0, others_threads=1.0, spread_weight=1.0, others_count=1) == 1.0


@pytest.mark.unit
def test_throttled_wall_time_under_a_cfs_quota():
    """A thread of a group that runs the first f P of each period: the mean wall time to get x seconds of
    CPU from a random start is what stepping through the periods gives; x / f (the quota as a slower
    CPU) over long parts, more for a part much shorter than the on-window (it may wake after the quota
    is spent and wait for the next period), x itself when the group is never throttled."""
    from evaluation.nodemodel import throttled_wall_s

    def stepped(x, f, period=0.1, n=2000):
        on, total = f * period, 0.0
        for i in range(n):
            t0 = t = (i + 0.5) / n * period
            need = x
            while need > 1e-12:
                pos = t - period * math.floor(t / period + 1e-12)
                if pos >= on - 1e-12:
                    t += period - pos
                    continue
                run = min(need, on - pos)
                need -= run
                t += run
            total += t - t0
        return total / n

    for x, f in ((0.01, 0.5), (0.013, 0.75), (0.03, 0.3), (0.05, 0.5), (0.12, 0.4)):
        assert throttled_wall_s(x, f, 0.1) == pytest.approx(stepped(x, f), rel=2e-3), (x, f)
    assert throttled_wall_s(0.01, 1.0) == 0.01 and throttled_wall_s(0.0, 0.3) == 0.0
    assert throttled_wall_s(0.002, 0.5) > 3 * (0.002 / 0.5)          # short: the next period's wait
    assert throttled_wall_s(2.0, 0.5) == pytest.approx(2.0 / 0.5, rel=0.02)


@pytest.mark.unit
def test_quota_run_steps_bursts_through_the_periods():
    """``quota_run``: one job stepped through time under a CFS quota. Without one, a job whose loader is
    ahead runs at its step; a quota its bursts fit in changes nothing; a job whose one batch needs more
    CPU than a period's budget is throttled although its mean use is half its quota (the bench's
    ResNet-50-like job: measured on the 2-core VM with the loader's one-batch-per-step dispatch, 2.89 vs
    3.04 steps/s, this model 0.96x), its trainer waits for the next period, and no job ever uses more
    than its quota. Seeded: the same call gives the same answer."""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def job(step, demand, frac, gpus=1):
        cv = ThroughputCurve(job="j", batch_size=64, compute_s_per_step=step, cpu_s_per_batch=demand * step,
                             blocked_s_per_batch=0.0, confidence=1.0)
        return N.JobModel(curve=cv, trainer_cpu_s_per_step=frac * step, gpus=gpus, habitual_workers=2)

    light = job(0.13, 0.15, 0.15)
    free = N.quota_run(light, 2, 2.0)
    assert free.bps == pytest.approx(1 / 0.13, rel=0.02)
    assert free.trainer_wall_s == pytest.approx(0.15 * 0.13, rel=1e-6)
    fits = N.quota_run(light, 2, 2.0, quota=2 / 3)
    assert fits.bps == pytest.approx(free.bps, rel=1e-9) and fits.trainer_wall_s == pytest.approx(free.trainer_wall_s)
    big = job(0.304, 0.225, 0.15)               # a batch of 68 ms CPU against a 66.7 ms budget
    a, b = N.quota_run(big, 2, 2.0), N.quota_run(big, 2, 2.0, quota=2 / 3)
    assert a.used_cores < 0.6 * (2 / 3)         # half its quota on average ...
    assert 0.9 < b.bps / a.bps < 0.99           # ... and still throttled
    assert b.trainer_wall_s > a.trainer_wall_s + 0.005
    assert N.quota_run(big, 2, 2.0, quota=2 / 3) == b
    for j, w, q in ((big, 8, 0.5), (job(0.076, 1.8, 0.25), 8, 0.5), (job(0.15, 1.8, 0.2, gpus=2), 16, 1.0)):
        r = N.quota_run(j, w, 2.0, quota=q)
        assert r.used_cores <= q * 1.005 and r.bps > 0     # (a window not on period edges: one budget's slack)
    # in static mode a bursty job under its quota loses what the stepping says, its trainer's wait shows
    models = {"j": big}
    s, n = N.node_rates(models, "static", 2.0, node_gpus=3)["j"], N.node_rates(models, "none", 2.0)["j"]
    assert s.normalised == pytest.approx(n.normalised * b.bps / a.bps, rel=1e-6)
    assert s.trainer_runq_s_per_step > n.trainer_runq_s_per_step


@pytest.mark.unit
def test_static_quota_is_a_budget_per_period(monkeypatch):
    """static mode (a hard CFS quota per job): a job whose use fits its quota runs as with no quota; one
    that would use more gets exactly its quota, its trainer waits for the periods the group is
    throttled, and with no trainer CPU it is the loader on the quota's cores. (Without the CPU that
    time slicing among more threads than CPUs costs, which has its own test: a 1-core quota on a 2-core
    node and a 1-core node are not sliced alike.)"""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    monkeypatch.setattr(N, "OVERSUB_CPU_PER_DOUBLING", 0.0)

    def model(loader_cores, trainer_frac, workers=2):
        cv = ThroughputCurve(job="j", batch_size=64, compute_s_per_step=0.1, cpu_s_per_batch=loader_cores * 0.1,
                             blocked_s_per_batch=0.0, confidence=1.0)
        return {"j": N.JobModel(curve=cv, trainer_cpu_s_per_step=trainer_frac * 0.1, habitual_workers=workers)}

    # under its quota (1 core of 2, it uses 0.45): the same as without one
    light = model(0.3, 0.15)
    s, n = N.node_rates(light, "static", 2.0, node_gpus=2)["j"], N.node_rates(light, "none", 2.0)["j"]
    assert s.normalised == pytest.approx(n.normalised, rel=1e-9) == pytest.approx(1.0)
    # over it: the group gets its quota and no more, the trainer waits for the throttled periods
    heavy = model(1.5, 0.3)
    free = N.node_rates(heavy, "static", 2.0, node_gpus=1)["j"]         # a 2-core quota: never throttled
    held = N.node_rates(heavy, "static", 2.0, node_gpus=2)["j"]
    assert held.loader_cores + held.trainer_cores == pytest.approx(1.0, rel=1e-3)
    assert held.normalised < free.normalised
    assert held.trainer_runq_s_per_step > free.trainer_runq_s_per_step
    # no trainer CPU: the loader on the quota's cores, as on a node of that many cores
    bare = model(1.5, 0.0)
    q = N.node_rates(bare, "static", 2.0, node_gpus=2)["j"]
    assert q.normalised == pytest.approx(N.node_rates(bare, "none", 1.0)["j"].normalised, rel=1e-6)
    assert q.trainer_runq_s_per_step == 0.0


@pytest.mark.unit
def test_wakeup_wait_command_measures_the_kernel_beside_the_model(tmp_path):
    """python -m evaluation.wakeup_wait: real processes, the trainer's run-queue wait from schedstat, the
    model's beside it (none modelled while the neighbours cannot fill the CPUs); bad options named."""
    import os

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no /proc/thread-self/schedstat (schedstats) on this kernel")
    from evaluation import wakeup_wait as W

    out = tmp_path / "w.json"
    assert W.main(["--neighbours", "0,1", "--iterations", "3", "--gpu-ms", "2", "--cpu-ms", "2",
                   "--woken-ms", "0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["neighbours"] for r in rows] == [0, 1]
    assert all(r["wait_ms_per_wake"] >= 0 and r["step_ms"] > 0 and r["iterations"] == 3 for r in rows)
    assert rows[0]["modelled_wait_ms_per_wake"] == 0.0
    # with the trainer's own worker woken at each CPU part: each count alone and with it, in that order
    assert W.main(["--neighbours", "1", "--iterations", "3", "--gpu-ms", "2", "--cpu-ms", "2",
                   "--woken-ms", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["neighbours"], r["woken_ms"], r["iterations"]) for r in rows] == [(1, 0.0, 3), (1, 2.0, 3)]
    cpus = len(os.sched_getaffinity(0))
    # as many always-busy neighbours as CPUs fill the node: the model says the trainer waits
    assert W.modelled_wait_s(cpus, cpus, 1.0, 0.02) > 0.0
    assert W.modelled_wait_s(cpus, cpus - 1, 1.0, 0.02) == 0.0
    # the worker it wakes fills the CPU the busy neighbours leave, for the part it computes beside it
    full = W.modelled_wait_s(cpus, cpus - 1, 1.0, 0.02, woken_s=0.02)
    assert full > 0.0
    assert 0.0 < W.modelled_wait_s(cpus, cpus - 1, 1.0, 0.02, woken_s=0.005) < full
    for bad, msg in ((["--neighbours", "x"], "argument --neighbours: not an integer: 'x'"), (["--duty", "0"], "--duty"),
                     (["--cpu-ms", "0"], "--cpu-ms"), (["--woken-ms", "-1"], "--woken-ms")):
        r = subprocess.run([sys.executable, "-m", "evaluation.wakeup_wait", *bad], capture_output=True, text=True,
                           env=repo_env(), timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (bad, r.stderr)


@pytest.mark.system
def test_lone_worker_command_measures_received_cores_against_the_weights(tmp_path):
    """python -m evaluation.lone_worker: the CPU each weighted group is entitled to (weight-proportional,
    at most a CPU per worker, the rest shared again), and a short real run in cgroups of its own that it
    removes; bad options named."""
    from pathlib import Path

    from evaluation import lone_worker as L

    assert L.entitled({"a": 1.0, "b": 1.0}, {"a": 1, "b": 2}, 2.0) == pytest.approx({"a": 1.0, "b": 1.0})
    # a one-worker group entitled to more than a CPU is capped at one; the rest goes to the others
    got = L.entitled({"a": 3.0, "b": 1.0}, {"a": 1, "b": 2}, 2.0)
    assert got == pytest.approx({"a": 1.0, "b": 1.0})
    got = L.entitled({"a": 0.37, "b": 0.49, "c": 0.74}, {"a": 1, "b": 1, "c": 2}, 2.0)
    assert sum(got.values()) == pytest.approx(2.0) and got["c"] == pytest.approx(2 * 0.74 / 1.6)
    r = subprocess.run([sys.executable, "-m", "evaluation.lone_worker", "--seconds", "0"], capture_output=True,
                       text=True, env=repo_env(), timeout=60)
    assert r.returncode == 2 and "--seconds" in r.stderr
    from tests.cgroup_support import CPU, skip_reason

    why = skip_reason()
    if why:
        pytest.skip(f"the real run: {why}")
    out = tmp_path / "l.json"
    assert L.main(["--seconds", "0.5", "--repeats", "1", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [x["b_workers"] for x in runs] == [1, 2]
    assert all(v > 0 for x in runs for v in x["received"].values())
    assert not list(Path(CPU).glob("adloader-lone-*"))


@pytest.mark.unit
def test_agent_grows_its_auto_budget_into_an_idle_reserve():
    """Four CPU-bound 2-GPU jobs whose trainers need 5% of a core each, on 48 CPUs: with the "auto" loader
    budget (90%) the agent used to plan 43.2 cores and size the workers to them, 8% behind `none`, whose
    habitual workers take the whole node; grown into the reserve the trainers leave
    (agent.policies.grown_loader_cpus) it ties. With the budget set explicitly it keeps it."""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def cv(name):
        c = ThroughputCurve(job=name, batch_size=128, compute_s_per_step=0.1, cpu_s_per_batch=2.0,
                            blocked_s_per_batch=0.0, confidence=1.0)
        return N.curve_with_workload(c, 0.005, 2, 12)

    truth = {f"j{i}": cv(f"j{i}") for i in range(4)}
    agg = {}
    for label, lc in (("auto", None), ("set", 43.2)):
        cfg = S.SimConfig(cores=48.0, gpus=8, loader_cpus=lc, tick_s=1.0, predictor="agent")
        for p in ("none", "adaptive"):
            agg[label, p] = S.steady_state(truth, p, cfg, warmup_s=20, measure_s=10)["window_agg"]
    assert agg["auto", "none"] == pytest.approx(agg["set", "none"])
    assert agg["auto", "adaptive"] >= 0.99 * agg["auto", "none"]
    assert agg["set", "adaptive"] < 0.95 * agg["set", "none"]


@pytest.mark.unit
def test_agent_mode_counts_cpu_time_not_allotted_cores_for_a_learned_core_correction():
    """A curve whose core-bound term learned core_correction < 1 (the corpus jobs: 0.91-0.93) uses that
    part of the cores it is allotted: under the agent a loader that gets the CPU time it uses at full
    speed is at its ceiling, as under `none` (before: the node model capped its CPU at that use and
    read it as an allotment, leaving it at 0.93 of its ceiling on a half-idle node; the default
    `adloader simulate` trace had adaptive 5.5% behind none for it)."""
    import dataclasses as dc

    from agent.model import JobAllocation
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    cv = ThroughputCurve(job="heavy", batch_size=16, compute_s_per_step=0.02, cpu_s_per_batch=0.17,
                         blocked_s_per_batch=0.0, confidence=1.0, core_correction=0.93)
    m = N.JobModel(curve=cv, habitual_workers=48)
    demand = N._loader_demand(m, 12)                      # CPU time at full speed: 8.5 cores
    assert demand == pytest.approx(0.17 / 0.02, rel=1e-3)
    none = N.node_rates({"heavy": m}, "none", 48.0)["heavy"]
    plan = {"heavy": JobAllocation(job="heavy", workers=12, cpus=14.0)}
    agent = N.node_rates({"heavy": m}, "agent", 48.0, plan)["heavy"]
    assert none.normalised == pytest.approx(1.0) and agent.normalised == pytest.approx(1.0)
    assert agent.loader_cores == pytest.approx(demand, rel=1e-3)
    # on a node short of CPU the same job gets what it gets, at core_correction of the allotted pace
    # (12 workers on 4 CPUs: each batch also costs what time slicing 3 threads per CPU adds)
    tight = N.node_rates({"heavy": dc.replace(m, habitual_workers=12)}, "agent", 4.0,
                         {"heavy": JobAllocation(job="heavy", workers=12, cpus=4.0)})["heavy"]
    sliced = 1.0 + N.OVERSUB_CPU_PER_DOUBLING * math.log2(3.0)
    assert tight.loader_cores == pytest.approx(4.0, rel=1e-3)
    assert tight.samples_per_s == pytest.approx(4.0 / (0.17 * sliced) * 16, rel=1e-3)


@pytest.mark.unit
def test_autotune_is_the_loaders_own_tuner_in_the_loop(monkeypatch):
    """Under ``autotune`` each simulated job runs the loader's real ``AutoTuner``: it starts where the
    loader starts it (a worker per CPU of the node, within the default max_workers, the node's CPUs),
    gets a window every ``WINDOW_S`` of its life, moves only after ``SETTLE_WINDOWS`` of them, drops the
    window after a resize, ends at the count the tuner's curve picks with its trainer sharing the CPUs,
    and goes quiet once settled (an arrival wakes it)."""
    from adloader import autotune
    from evaluation import nodemodel as N

    spec = {"job_id": "r", "kind": "resnet50", "batch_size": 64, "step_s": 0.1424, "demand_cores": 0.45,
            "cpu_s_per_sample": 0.001, "samples": 1e6, "gpus": 1, "trainer_cpu_frac": 0.15, "num_workers": 2}
    truth = N.curves_from_bench_specs({"r": spec, "s": dict(spec, job_id="s")})
    seen = {}
    real = autotune.AutoTuner.window

    def spy(self, obs, memory_cap=None):
        before = self.current
        want = real(self, obs, memory_cap)
        seen.setdefault(id(self), []).append((self.n_windows, before, want, obs is None))
        return want

    monkeypatch.setattr(autotune.AutoTuner, "window", spy)
    trace = [S.TraceJob("n", "r", "r", 0.0, 60.0)]
    cfg = S.SimConfig(cores=2.0, gpus=2, loader_cpus=1.8, tuner_gpu_part=False)     # the bench: no driver
    res = S.simulate_node(trace, truth, "autotune", cfg, until_s=30.0)
    (first,) = seen.values()
    assert first[0][1] == 2                              # the loader's start: one worker per CPU
    moves = [(n, b, w) for n, b, w, _ in first if w is not None and w != b]
    assert moves[0][0] >= autotune.SETTLE_WINDOWS
    assert moves[0][1:] == (2, 1)                        # the trainer's share: one worker is its best
    assert [d for n, _b, _w, d in first if n == moves[0][0] + 1] == [True]     # the straddling window
    m = N.job_model(truth["r"], 1, 2)
    assert res["rates"]["r"]["workers"] == N.autotune_workers(m, 2.0, cap=2) == 1
    # quiet while nothing changes: not a window every 2 s for 30 s
    assert len(first) < 30 / autotune.WINDOW_S - 3
    # an arrival at 30 s wakes the first job's tuner
    seen.clear()
    trace.append(S.TraceJob("n", "s", "s", 30.0, 60.0))
    S.simulate_node(trace, truth, "autotune", cfg, until_s=40.0)
    r_windows = list(seen.values())[0]                  # the first tuner made: the first job's
    assert len(seen) == 2 and max(n for n, *_ in r_windows) > len(first)


@pytest.mark.unit
def test_the_simulated_tuner_starts_at_its_gpus_part_of_a_node_that_shows_them(monkeypatch):
    """``SimConfig.tuner_gpu_part``: on a node whose driver shows its 8 GPUs each job's own tuner
    starts as ``autotune.initial_workers`` starts it there, at its GPUs' part of the 16 CPUs (1 GPU: 2
    workers, 2 GPUs: 4); without (the bench's emulated GPUs) at every CPU."""
    from adloader import autotune
    from evaluation import nodemodel as N

    spec = {"job_id": "a", "kind": "resnet50", "batch_size": 64, "step_s": 0.1424, "demand_cores": 0.45,
            "cpu_s_per_sample": 0.001, "samples": 1e6, "gpus": 1, "trainer_cpu_frac": 0.15, "num_workers": 2}
    truth = N.curves_from_bench_specs({"a": spec, "b": dict(spec, job_id="b", gpus=2)})
    starts = []
    real = autotune.AutoTuner.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        starts.append(self.current)

    monkeypatch.setattr(autotune.AutoTuner, "__init__", spy)
    trace = [S.TraceJob("n", "a", "a", 0.0, 60.0, gpus=1), S.TraceJob("n", "b", "b", 0.0, 60.0, gpus=2)]
    S.simulate_node(trace, truth, "autotune", S.SimConfig(cores=16.0, gpus=8), until_s=4.0)
    assert starts == [2, 4]
    starts.clear()
    S.simulate_node(trace, truth, "autotune", S.SimConfig(cores=16.0, gpus=8, tuner_gpu_part=False), until_s=4.0)
    assert starts == [16, 16]


@pytest.mark.unit
def test_time_slicing_more_threads_than_cpus_costs_cpu_per_batch():
    """The node model's CPU per batch grows by OVERSUB_CPU_PER_DOUBLING per doubling of the runnable
    threads per CPU past one (measured: evaluation.oversub_cpu); a worker counts for the part of its
    batch it is on the CPU and not while it waits for room in a full queue, a trainer for the busy part
    of its step."""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def job(c, b, workers, trainer_frac=0.0, gpus=1):
        cv = ThroughputCurve(job="j", batch_size=16, compute_s_per_step=0.1, cpu_s_per_batch=c,
                             blocked_s_per_batch=b, confidence=1.0)
        return N.JobModel(curve=cv, trainer_cpu_s_per_step=trainer_frac * 0.1, gpus=gpus, habitual_workers=workers)

    k = N.OVERSUB_CPU_PER_DOUBLING
    assert k > 0
    two = {"a": job(0.4, 0.0, 1), "b": job(0.4, 0.0, 1)}
    assert N.oversubscription_factor(two, {"a": 1, "b": 1}, 2.0) == 1.0              # one thread per CPU
    assert N.oversubscription_factor(two, {"a": 8, "b": 8}, 2.0) == pytest.approx(1 + 3 * k)   # 8 per CPU
    io = {"a": job(0.1, 0.3, 8)}                          # on the CPU a quarter of each batch: 2 threads
    assert N.oversubscription_factor(io, {"a": 8}, 2.0) == 1.0
    # a job at its ceiling on 0.2 cores: its 16 workers mostly wait for room in the queue
    fed = {"a": job(0.02, 0.0, 16)}
    assert N.oversubscription_factor(fed, {"a": 16}, 2.0) == pytest.approx(1 + 3 * k)   # taken as behind
    assert N.oversubscription_factor(fed, {"a": 16}, 2.0, fed={"a": 0.2}) == 1.0
    r = N.node_rates(fed, "none", 2.0)["a"]          # the model's second pass finds it fed and counts it so
    assert r.normalised == pytest.approx(1.0) and r.cpu_s_per_batch == pytest.approx(0.02)
    busy = {"a": job(0.4, 0.0, 3, trainer_frac=1.0, gpus=1)}   # 3 workers + a trainer always busy
    assert N.oversubscription_factor(busy, {"a": 3}, 2.0) == pytest.approx(1 + k)
    # a CPU-bound job with 16 workers on 2 cores delivers 1 / (1 + 3k) of what 2 do
    cv = ThroughputCurve(job="j", batch_size=16, compute_s_per_step=0.01, cpu_s_per_batch=0.4,
                         blocked_s_per_batch=0.0, confidence=1.0)
    r2 = N.node_rates({"j": N.JobModel(curve=cv, habitual_workers=2)}, "none", 2.0)["j"]
    r16 = N.node_rates({"j": N.JobModel(curve=cv, habitual_workers=16)}, "none", 2.0)["j"]
    assert r16.samples_per_s == pytest.approx(r2.samples_per_s / (1 + 3 * k), rel=1e-6)


@pytest.mark.unit
def test_per_node_comparison_against_the_best_other_policy():
    # node by node, against the best of the OTHER policies there (the oracle is nobody's alternative);
    # above 1 = better: a policy that wins one node and loses the other shows both, which a trace's
    # average hides
    def node(makespan, jcts):
        return {"makespan_s": makespan, "decisions": 0,
                "jobs": {f"j{i}": {"jct_s": j, "norm_s": 1.0, "wait_s": 0.0, "alive_s": j, "norm_mean": 1.0,
                                   "changes": 0} for i, j in enumerate(jcts)}}

    per_policy = {"a": {"n0": node(10, [4, 6]), "n1": node(20, [10])},
                  "b": {"n0": node(12, [5, 5]), "n1": node(16, [12])},
                  "oracle": {"n0": node(1, [1]), "n1": node(1, [1])}}
    cmp = S.per_node_comparison(per_policy)
    a = cmp["a"]
    assert a["makespan"]["min"] == pytest.approx(16 / 20) and a["makespan"]["max"] == pytest.approx(12 / 10)
    assert a["makespan"]["better"] == 1 and a["makespan"]["nodes"] == 2
    assert a["jct"]["min"] == pytest.approx(1.0) and a["jct"]["max"] == pytest.approx(12 / 10)
    assert a["jct"]["better"] == 1          # a tie (5 s vs 5 s) is not better
    assert cmp["b"]["jct"]["better"] == 0
    assert S.per_node_comparison({"a": per_policy["a"], "oracle": per_policy["oracle"]}) == {}
    doc = {"summary": {p: dict(S.summarise_policy(per_policy[p]), per_node=cmp[p]) for p in per_policy}}
    md = S.markdown(doc)
    assert cmp["b"]["jct"]["worse"] == 1 and cmp["a"]["jct"]["worse"] == 0
    assert ("| a | 1.000 [0.840, 0.800–1.200] | 1.100 [1.020, 1.000–1.200] | 1.100 [1.020, 1.000–1.200] "
            "| 1 / 1; 1 / 0; 1 / 0 of 2 |") in md, md
    # counted once per GPU: on n0 a's 4-s job holds 3 GPUs ((3x4 + 6) / 4 = 4.5 s), b's 5-s jobs one
    # each (5 s), so a is better there by GPU-weighted JCT though its plain mean JCT ties
    per_policy["a"]["n0"]["jobs"]["j0"]["gpus"] = 3
    per_policy["b"]["n0"]["jobs"]["j0"]["gpus"] = 3
    cmp = S.per_node_comparison(per_policy)
    assert cmp["a"]["jct_gpu"]["min"] == pytest.approx(5 / 4.5) and cmp["a"]["jct"]["min"] == pytest.approx(1.0)
    assert cmp["a"]["jct_gpu"]["better"] == 2 and cmp["b"]["jct_gpu"]["worse"] == 2
    assert S.summarise_policy(per_policy["a"])["jct_gpu_mean_s"] == pytest.approx((3 * 4 + 6 + 10) / 5)


@pytest.mark.unit
def test_oversub_cpu_fit_and_bad_arguments(capsys):
    from evaluation import oversub_cpu as O

    # 2 CPUs, +3% per doubling past one per CPU: 4 processes +3%, 8 +6%, 16 +9%; 1 and 2 are no slicing
    med = {1: 1.0, 2: 1.0, 4: 1.03, 8: 1.06, 16: 1.09}
    ref, slope = O.fit(2, med)
    assert ref == 1.0 and slope == pytest.approx(0.03)
    assert O.fit(4, {1: 2.0, 2: 2.0})[1] == 0.0          # nothing above one per CPU: no slope
    with pytest.raises(SystemExit) as e:
        O.main(["--procs", "2,x"])
    assert e.value.code == 2 and "argument --procs: not an integer: 'x'" in capsys.readouterr().err
    assert O.main(["--reps", "0"]) == 2
    assert O.main(["--image-px", "4"]) == 2 and "--image-px at least 16" in capsys.readouterr().err


@pytest.mark.unit
def test_mix_study_draws_mixes_that_fill_the_gpus_and_reports_each_shape(tmp_path, capsys):
    """evaluation.mix_study: seeded random mixes fill the node's GPUs with jobs in the documented
    ranges; a run writes per-shape summaries whose ratios are the mixes' adaptive / best baseline, the
    same for the same seed; bad arguments are refused with a message naming the option."""
    import json
    import random

    from evaluation import mix_study as M

    rng = random.Random(3)
    for _ in range(50):
        mix = M.random_mix(rng, 16, 8)
        d = M.describe(mix)
        assert sum(x["gpus"] for x in d.values()) == 8
        for x in d.values():
            assert 1 <= x["gpus"] <= 4
            assert 0.25 * 2 - 1e-3 <= x["loader_cores_per_gpu"] <= 7 * 2 + 1e-3
            assert 0.0 <= x["trainer_busy"] <= 0.4 + 1e-3
            assert x["num_workers"] % x["gpus"] == 0
    out = tmp_path / "m.json"
    assert M.main(["--nodes", "8:4", "--mixes", "3", "--seed", "2", "--worst", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s, worst = res["summaries"]["8:4"], res["worst"]["8:4"]
    assert s["mixes"] == 3 and len(worst) == 3
    for r in worst:
        best = max(M.BASELINES, key=lambda p: r["agg"][p])
        assert r["best"] == best and r["ratio"] == pytest.approx(r["agg"]["adaptive"] / r["agg"][best])
        # the ideal that keeps the fairness target, over the best baseline and under adaptive
        fair = r["fair_bound"] * r["agg"][best]
        assert 0 < fair <= sum(x["gpus"] for x in r["jobs"].values()) + 1e-9
        assert r["of_fair_bound"] == pytest.approx(r["agg"]["adaptive"] / fair)
    assert s["min"] == pytest.approx(min(r["ratio"] for r in worst))
    assert s["fair_bound_at_1.10"] == sum(r["fair_bound"] >= 1.10 for r in worst)
    assert "| 8:4 | 3 |" in capsys.readouterr().out
    assert M.main(["--nodes", "8:4", "--mixes", "3", "--seed", "2", "--worst", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summaries"] == res["summaries"]
    assert M.main(["--nodes", "8x4"]) == 2 and "CORES:GPUS" in capsys.readouterr().err
    assert M.main(["--nodes", "0:4"]) == 2 and "at least 1" in capsys.readouterr().err
    assert M.main(["--mixes", "0"]) == 2 and "--mixes" in capsys.readouterr().err
    assert M.main(["--floor-fraction", "1.5"]) == 2 and "--floor-fraction" in capsys.readouterr().err


@pytest.mark.unit
def test_trace_phases_parse_from_csv_and_json_and_say_what_is_wrong(tmp_path):
    csv_p = tmp_path / "t.csv"
    csv_p.write_text("node,job,kind,arrival_s,work_s,phases\nn0,a,mid,0,10,20:heavy;5:light\nn0,b,light,0,4,\n")
    a, b = S.read_trace(str(csv_p))
    assert a.phases == ((5.0, "light"), (20.0, "heavy")) and b.phases == ()
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"node": "n0", "job": "a", "kind": "mid", "arrival_s": 0, "work_s": 10, "phases": [[3, "heavy"]]}\n')
    assert S.read_trace(str(jl))[0].phases == ((3.0, "heavy"),)
    for bad, words in (("heavy", "not AFTER_S:KIND"), ("0:heavy", "AFTER_S must be > 0"), ("5:", "KIND named")):
        p = tmp_path / "bad.csv"
        p.write_text(f"node,job,kind,arrival_s,work_s,phases\nn0,a,mid,0,10,{bad}\n")
        with pytest.raises(S.SimError, match=f"bad.csv:2: phases: .*{words}"):
            S.read_trace(str(p))
    cfg = S.SimConfig(cores=2.0, gpus=1, loader_cpus=2.0, predictor="perfect")
    with pytest.raises(S.SimError, match="unknown kinds: nope"):
        S.simulate([S.TraceJob("n", "x", "mid", 0, 1, 1, ((1.0, "nope"),))], CURVES, ["even"], cfg)
    # one node run directly says so too, before it starts (it raised a KeyError at the phase's time)
    with pytest.raises(S.SimError, match="unknown kinds: nope"):
        S.simulate_node([S.TraceJob("n", "x", "mid", 0, 1, 1, ((0.5, "nope"),))], CURVES, "even", cfg)


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["none", "even", "adaptive"])
def test_a_phase_makes_the_job_another_kind_from_then_on(policy):
    """A job alone on 2 loader cores needing 1 core (``mid``) needs 3 (``heavy``) from 10 s after its
    arrival: at its ceiling before, at 2/3 of it after, under every policy (its two habitual workers
    on 2 cores). Under ``none`` nothing decides: the physics must see the new kind (its rates were
    cached per job model, and a new model can reuse a freed one's id)."""
    cfg = S.SimConfig(cores=2.0, gpus=1, loader_cpus=2.0, predictor="perfect")
    job = [S.TraceJob("n", "x", "mid", 1.0, 1e9, 1, ((10.0, "heavy"),))]
    before = S.simulate_node(job, CURVES, policy, cfg, until_s=11.0, measure_from_s=1.0)
    after = S.simulate_node(job, CURVES, policy, cfg, until_s=40.0, measure_from_s=20.0)
    assert before["window"]["x"] == pytest.approx(1.0, abs=0.01)
    assert after["window"]["x"] == pytest.approx(2.0 / 3.0, abs=0.02)
    plain = S.simulate_node([dataclasses.replace(job[0], phases=())], CURVES, policy, cfg, until_s=40.0,
                            measure_from_s=20.0)
    assert plain["window"]["x"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.unit
@pytest.mark.parametrize("predictor", ["first-principles", "agent"])
def test_a_job_turned_heavy_gets_its_workers_within_seconds_of_its_new_windows(predictor, monkeypatch):
    """End to end through the controller, the policy and the learning predictor: 8 jobs on 32 cores, a
    BERT-like job (1 core) turns ResNet-50-like (3 cores) 60 s in. The bank drops the old windows once two
    new ones show the change, so the job has its 3 workers and its ceiling 10 s after it. With the old
    windows kept (the detection off) the first-principles bank still blends the two jobs then (2
    workers, 2/3 of its ceiling; 3 workers 40 s after the change)."""
    import predictor.bank as bank_mod

    curves = S.builtin_curves()
    kinds = ["resnet50", "bert", "resnet18", "audio"] * 2
    trace = [S.TraceJob("n", f"j{i}", k, 0.0, 1e9, 1, ((60.0, "resnet50"),) if i == 1 else ())
             for i, k in enumerate(kinds)]
    cfg = S.SimConfig(cores=32, gpus=8, predictor=predictor, settle_ticks=400)
    truth = S.with_memory(curves, cfg)

    def at(t):
        r = S.simulate_node(trace, truth, "adaptive", cfg, until_s=t, measure_from_s=t - 1.0)
        return r["plan"]["j1"]["workers"], r["window"]["j1"]

    assert at(58.0) == (1, pytest.approx(1.0, abs=0.01))
    workers, norm = at(70.0)
    assert workers == 3 and norm == pytest.approx(1.0, abs=0.01)
    if predictor == "first-principles":
        monkeypatch.setattr(bank_mod, "CHANGE_WINDOWS", 0)
        workers, norm = at(70.0)
        assert workers == 2 and norm < 0.7


@pytest.mark.unit
def test_steps_known_for_a_part_of_the_jobs():
    """``--steps-known PART``: a fixed draw by job id says which jobs tell their steps (the same for
    every policy and run); 0 none, 1 every one. The finish guard needs every job on a node to say: on
    node p7 with half of them saying, adaptive's plans are the blind ones (the same makespan) though it
    decides every tick; the option's bad values are refused with the reason."""
    from agent.cli import build_parser

    ids = [f"j{i}" for i in range(2000)]
    half = [j for j in ids if S.tells_steps(j, 0.5)]
    assert 900 < len(half) < 1100 and half == [j for j in ids if S.tells_steps(j, 0.5)]
    assert not any(S.tells_steps(j, 0.0) for j in ids) and all(S.tells_steps(j, 1.0) for j in ids)
    assert set(j for j in ids if S.tells_steps(j, 0.25)) < set(half)
    truth = S.builtin_curves()
    trace = [t for t in S.read_trace(str(Path(__file__).resolve().parents[1] / "evaluation" / "traces" /
                                     "phases_16jobs.csv")) if t.node == "p7"]
    saying = [t.job for t in trace if S.tells_steps(t.job, 0.5)]
    assert 0 < len(saying) < len(trace)
    cfg = S.SimConfig(cores=48.0, gpus=16)
    blind, part = (S.simulate_node(trace, truth, "adaptive", dataclasses.replace(cfg, steps_known=k))
                   for k in (0.0, 0.5))
    assert part["makespan_s"] == pytest.approx(blind["makespan_s"], rel=0.01)
    assert part["decisions"] > 2 * blind["decisions"]
    parse = build_parser().parse_args
    assert parse(["simulate", "--curves", "builtin", "--steps-known"]).steps_known == 1.0
    assert parse(["simulate", "--curves", "builtin", "--steps-known", "0.5"]).steps_known == 0.5
    assert parse(["simulate", "--curves", "builtin"]).steps_known == 0.0
    p = subprocess.run(adloader_cmd("simulate", "--curves", "builtin", "--steps-known", "1.5"),
                       capture_output=True, text=True)
    assert p.returncode == 2 and "1.5 is not a part of the jobs (0-1)" in p.stderr, p.stderr


@pytest.mark.unit
def test_jobs_that_say_their_steps_left_finish_the_node_sooner_under_adaptive():
    """``evaluation/traces/phases_16jobs.csv``'s node p7: 16 one-GPU jobs of 300 s of work at full speed
    (ResNet-50-, BERT-, ResNet-18-, audio-like, four each), all at 0, on 48 cores. Without the jobs'
    remaining steps adaptive feeds the cheap jobs first; the ResNet-18-like ones (6 cores a GPU) run on
    their floors until the others finish at 300 s and then cannot use the node: the last finishes ~12%
    after autotune's. With them (``steps_known``: the finish guard) the node's last job finishes before
    autotune's, and the mean JCT stays below autotune's. The agent's plans then depend on the work left,
    so it decides every tick."""
    truth = S.builtin_curves()
    trace = [t for t in S.read_trace(str(Path(__file__).resolve().parents[1] / "evaluation" / "traces" /
                                     "phases_16jobs.csv")) if t.node == "p7"]
    assert len(trace) == 16 and not any(t.phases for t in trace)
    cfg = S.SimConfig(cores=48.0, gpus=16)
    runs = {name: S.simulate_node(trace, truth, pol, dataclasses.replace(cfg, steps_known=known))
            for name, pol, known in (("autotune", "autotune", False), ("blind", "adaptive", False),
                                     ("known", "adaptive", True))}
    span = {k: r["makespan_s"] for k, r in runs.items()}
    jct = {k: sum(j["jct_s"] for j in r["jobs"].values()) / len(r["jobs"]) for k, r in runs.items()}
    assert span["blind"] > 1.08 * span["autotune"], span          # the loss the guard is for
    assert span["known"] < span["autotune"] < span["blind"], span
    assert jct["known"] < jct["autotune"], jct
    assert runs["known"]["decisions"] > 2 * runs["blind"]["decisions"]     # ticks on without events


@pytest.mark.unit
def test_validate_sim_runs_an_agent_variant_and_a_run_whose_jobs_said_their_steps():
    """``adaptive[finish_guard=false]`` (a bench variant whose keys are the policy's own) runs in the
    simulator with that option; a variant of a key the simulator has no such option for, or of a policy
    it does not run, is left out. A run made with ``--steps-known`` is simulated with the jobs saying
    their steps: the guard's variant and the default then differ where the tail would idle."""
    from evaluation import validate_sim as V

    assert V._variant("adaptive[finish_guard=false]") == ("adaptive", (("finish_guard", False),))
    assert V._variant("adaptive[hysteresis=0.05,cpu_bound_min_workers=2]") == \
        ("adaptive", (("cpu_bound_min_workers", 2), ("hysteresis", 0.05)))
    assert V._variant("adaptive[observed_cores=received]") == ("adaptive", (("observed_cores", "received"),))
    assert V._variant("adaptive[tick_s=0.5]") is None and V._variant("oracle") is None
    assert V._variant("none") == ("none", ())
    spec = {"batch_size": 32, "step_s": 0.1, "gpus": 1, "trainer_cpu_frac": 0.0, "num_workers": 8,
            "worker_ram_mb": 0.0}
    # 16 cores: jobs needing 8, 4, 4 and 1 cores for their ceilings, 120 s of work each, all at 0. The
    # GPU shares (3.6 cores) leave 2.6 cores above the floors; without the guard the 4-core jobs take
    # what they lack first and the 8-core job finishes alone, 30 s after the others
    specs = {f"j{i}": dict(spec, job_id=f"j{i}", demand_cores=d, cpu_s_per_sample=d * 0.1 / 32,
                           samples=int(120 / 0.1 * 32), arrival_s=0.0) for i, d in enumerate((8.0, 4.0, 4.0, 1.0))}
    pols = ["adaptive", "adaptive[finish_guard=false]"]
    known = V.simulate_dynamic(specs, 16.0, 14.4, pols, steps_known=True)
    blind = V.simulate_dynamic(specs, 16.0, 14.4, pols)
    assert blind["adaptive"] == blind["adaptive[finish_guard=false]"]          # nobody said: no guard
    assert known["adaptive[finish_guard=false]"]["makespan_s"] == pytest.approx(blind["adaptive"]["makespan_s"])
    assert known["adaptive"]["makespan_s"] < 0.95 * known["adaptive[finish_guard=false]"]["makespan_s"], known
    assert known["adaptive"]["jct_mean_s"] < known["adaptive[finish_guard=false]"]["jct_mean_s"], known


@pytest.mark.unit
def test_the_finish_guard_keeps_its_jobs_and_does_not_churn():
    """``phases_16jobs.csv``'s node p5 (one ResNet-18-like job turns ResNet-50-like at 60 s) on 48
    cores: the audio-like jobs' remaining time sits near the node's finishing time for a minute. With a
    single threshold they left the guarded set and came back every few ticks (four jobs 13 times each,
    186 worker changes on the node); a job the held plan feeds above its floor stays in within the wider
    ``FINISH_HOLD_SLACK``: 46, each guarded job entering once (15 without the hints: the guard's own
    moves, the room re-split as jobs enter, are the rest)."""
    truth = S.builtin_curves()
    trace = [t for t in S.read_trace(str(Path(__file__).resolve().parents[1] / "evaluation" / "traces" /
                                     "phases_16jobs.csv")) if t.node == "p5"]
    cfg = S.SimConfig(cores=48.0, gpus=16)
    changes = {known: sum(j["changes"] for j in S.simulate_node(
        trace, truth, "adaptive", dataclasses.replace(cfg, steps_known=known))["jobs"].values())
        for known in (False, True)}
    assert changes[False] < 30 and changes[True] < 80, changes


@pytest.mark.unit
def test_a_job_whose_loop_stops_delivers_nothing_meanwhile_and_adaptive_lends_its_cores():
    """``TraceJob.pause`` (the bench's validating mix): a job whose loop stops 30 s after every 30 s of training
    delivers nothing in its pauses (its window throughput about half its own without them) and takes no
    CPU; adaptive, ``release_away_s`` (10 s) into each pause, plans its cores to a neighbour that can use
    them, which then delivers more than with the release off; the paused job loses nothing by it."""
    from evaluation import nodemodel as N
    from predictor.curve import ThroughputCurve

    def curve(name, loader_cores, gpus=1):
        cv = ThroughputCurve(job=name, batch_size=64 * gpus, compute_s_per_step=0.1,
                             cpu_s_per_batch=loader_cores * 0.1, blocked_s_per_batch=0.0, confidence=1.0)
        return N.curve_with_workload(cv, 0.02, gpus, 2)

    truth = {"p": curve("p", 1.2, gpus=2), "n": curve("n", 1.6)}
    cfg = S.SimConfig(cores=2.0, gpus=3, loader_cpus=1.8, tick_s=1.0, predictor="perfect")
    pauses = {"p": (30.0, 30.0)}
    plain = S.steady_state(truth, "adaptive", cfg, 16.0, 60.0)
    on = S.steady_state(truth, "adaptive", cfg, 16.0, 60.0, pauses_of=pauses)
    off = S.steady_state(truth, "adaptive", dataclasses.replace(cfg, policy_options=(("release_away_s", 0.0),)),
                         16.0, 60.0, pauses_of=pauses)
    assert on["window"]["p"] == pytest.approx(0.5 * plain["window"]["p"], rel=0.1)   # away 30 s of the 60
    assert off["window"]["p"] == pytest.approx(on["window"]["p"], rel=0.02)
    assert on["window"]["n"] > 1.05 * off["window"]["n"]
    assert on["window_agg"] > off["window_agg"]


@pytest.mark.unit
def test_validate_sim_runs_a_job_whose_loop_stops_with_its_pauses():
    """The bench's validating mix: a job's spec carries ``pause_every_s`` and ``pause_s``; validate_sim runs
    it with those pauses (before, it left the mix out): the paused job's simulated window throughput is
    about half what the same job gives without them, and no ideal bound is given (it has no pauses)."""
    from evaluation import validate_sim as V

    w = {"name": "alexnet", "image_px": 256, "crop_px": 64, "aug_multiplier": 2, "seed": 100}

    def spec(cpu, step, gpus=1, pause=None):
        return {"batch_size": 64 * gpus, "step_s": step, "cpu_s_per_sample": cpu, "demand_cores": cpu * 64 * gpus / step,
                "trainer_cpu_frac": 0.2, "gpus": gpus, "num_workers": 2, "workload": {**w, "seed": 100 + gpus},
                **({"pause_every_s": pause[0], "pause_s": pause[1]} if pause else {})}

    def bench(specs):
        phases = [{"scenario": "validating", "kind": "static", "policy": pol, "rep": 0, "warmup_s": 16,
                   "window": [0.0, 60.0], "specs": specs,
                   "metrics": {"agg_normalised": agg, "jobs": {j: {"normalised": 0.3, "samples_per_s": 300.0,
                                                                 "worker_cpu_cores": 0.5, "trainer_cpu_cores": 0.1}
                                                             for j in specs}}}
                  for pol, agg in (("even-static", 1.0), ("adaptive", 1.05))]
        return {"meta": {"node_cores": 2, "loader_cpus": 1.8, "tick_s": 1.0}, "phases": phases}

    paused = {"p": spec(0.0005, 0.05, gpus=2, pause=(30.0, 30.0)), "n": spec(0.0012, 0.05)}
    steady = {"p": spec(0.0005, 0.05, gpus=2), "n": spec(0.0012, 0.05)}
    got = {(r["policy"], r["job"]): r for r in V.validate_jobs(bench(paused), capacity="node")}
    calm = {(r["policy"], r["job"]): r for r in V.validate_jobs(bench(steady), capacity="node")}
    for pol in ("even-static", "adaptive"):
        assert got[(pol, "p")]["sim_norm"] == pytest.approx(0.5 * calm[(pol, "p")]["sim_norm"], rel=0.15)
    rows = V.validate(bench(paused), capacity="node")
    assert {r["policy"] for r in rows} == {"even-static", "adaptive"} and all("bound_best" not in r for r in rows)
