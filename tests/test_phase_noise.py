"""``evaluation.phase_noise``: what kind of noise moved a bench run's phases (pure figures over a
bench.json and its agents' observation records)."""
import json

import pytest

from evaluation import phase_noise as P

pytestmark = pytest.mark.unit

SPECS = {"a": {"cpu_s_per_sample": 0.001}, "b": {"cpu_s_per_sample": 0.002}}


def _log(path, job_costs: dict, windows: int, start: float = 1000.0):
    """An agent log with ``windows`` one-second observation windows per job; job -> (first half's CPU
    per sample, second half's). A malformed line and another event sit among them."""
    lines = ['{"event": "hello", "job": "a"}', "not json at all"]
    for k in range(windows):
        for job, (c1, c2) in job_costs.items():
            c = c1 if k < windows // 2 else c2
            lines.append(json.dumps({"ts": start + k, "event": "observation", "job": job,
                                     "window": {"steps": 2, "batch_size": 10, "cpu_s_per_batch": c * 10}}))
    path.write_text("\n".join(lines) + "\n")


def _policy(k: int) -> str:
    return "AB"[(k + k // 2) % 2]


def _bench(tmp_path, factors, halves=None):
    """Phases of scenario s, policies A and B alternating (A, B, B, A, ...), listed out of order; phase k
    ran with every job's cost x factors[k] and policy B's job a 1.3x dearer than A's (a policy's own
    effect, not noise). ``halves``: per phase, the factor of its first and second half in the log."""
    phases = []
    for k, f in enumerate(factors):
        policy = _policy(k)
        own = {"a": 1.3 if policy == "B" else 1.0, "b": 1.0}
        jobs = {j: {"samples_per_s": 100.0, "worker_cpu_cores": 100.0 * SPECS[j]["cpu_s_per_sample"] * f * own[j]}
                for j in SPECS}
        run = tmp_path / f"run{k}"
        run.mkdir(parents=True)
        if halves is not None:
            h1, h2 = halves[k]
            _log(run / "agent.log", {j: (SPECS[j]["cpu_s_per_sample"] * h1 * own[j],
                                         SPECS[j]["cpu_s_per_sample"] * h2 * own[j]) for j in SPECS}, windows=10)
        phases.append({"scenario": "s", "kind": "static", "policy": policy, "rep": k // 2, "phase_start": 10.0 * k,
                       "warmup_s": 0.0, "run_dir": str(run), "specs": SPECS,
                       "metrics": {"agg_normalised": 1.0, "jobs": jobs}})
    phases.append({"scenario": "s", "kind": "static", "policy": "A", "rep": 9, "error": "a job died"})
    # listed even phases first, then odd ones (and the failed one first): read in that order, an
    # alternating sequence would look like a drift
    return {"phases": phases[-1:] + phases[0:-1:2] + phases[1:-1:2]}


def test_a_common_phase_factor_alternating_in_time_reads_as_together_and_negative_lag(tmp_path):
    factors = [1.2, 0.9, 1.25, 0.85, 1.15, 0.95, 1.3, 0.8]
    x = P.analyse(_bench(tmp_path, factors))
    assert x["phases"] == 8
    assert x["together"] == pytest.approx(1.0, abs=1e-6) and x["together_n"] == 8   # one pair per phase
    assert x["lag1"] < -0.9 and x["lag1_n"] == 7          # in the order they ran, not the list's
    assert x["halves"] is None and x["halves_n"] == 0     # no agent logs
    assert x["sd_between"] > 0.1 and x["sd_within"] is None


def test_halves_come_from_the_agents_windows_after_the_warm_up(tmp_path):
    factors = [1.2, 0.9, 1.25, 0.85, 1.15, 0.95, 1.3, 0.8]
    # a state that holds over each phase: both halves at the phase's factor
    held = P.analyse(_bench(tmp_path / "held", factors, halves=[(f, f) for f in factors]))
    assert held["halves"] == pytest.approx(1.0, abs=1e-6) and held["halves_n"] == 16
    assert held["sd_within"] == pytest.approx(0.0, abs=1e-9)
    # a state that changes within the phase: the second half moves against the first (mirrored about
    # the median of its policy's phases: A's factors 1.2, 0.85, 1.15, 0.8 -> 1.0; B's -> 1.1)
    med = {"A": 1.0, "B": 1.1}
    moved = P.analyse(_bench(tmp_path / "moved", factors,
                             halves=[(f, 2 * med[_policy(k)] - f) for k, f in enumerate(factors)]))
    assert moved["halves"] == pytest.approx(-1.0, abs=1e-6) and moved["sd_within"] > 0.1


def test_phase_halves_skip_the_warm_up_and_thin_jobs(tmp_path):
    log = tmp_path / "agent.log"
    _log(log, {"a": (0.002, 0.004), "b": (0.001, 0.001)}, windows=6)
    # windows at ts 1000..1005; a warm-up of 3 s leaves 1003, 1004, 1005 (halves: 1003 | 1004, 1005), all
    # in the second half of the log's windows for job a: 0.004 per sample
    assert P.phase_halves(log, 3.0) == {"a": pytest.approx((0.004, 0.004)), "b": pytest.approx((0.001, 0.001))}
    assert P.phase_halves(log, 0.0)["a"] == pytest.approx((0.002, 0.004))
    assert P.phase_halves(log, 5.0) == {}                  # one window left: no halves
    assert P.phase_halves(tmp_path / "missing.log", 0.0) == {}


def test_cli_prints_the_table_writes_json_and_names_a_bad_file(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench(tmp_path, [1.2, 0.9, 1.1, 1.0])))
    assert P.main([str(path), "--out", str(tmp_path / "noise.json")]) == 0
    out = capsys.readouterr().out
    assert "| run | phases | together" in out and str(path) in out
    assert json.loads((tmp_path / "noise.json").read_text())[str(path)]["phases"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    assert P.main([str(bad)]) == 2
    assert "not an `adloader bench` bench.json" in capsys.readouterr().err
    assert P.main([str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
