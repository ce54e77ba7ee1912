"""``evaluation.workload_audit``: the agent's real registry, collector, controller and predictor bank fed
by simulated training loops (simulated time: no timing in what is asserted). The registry reads this
process's /proc entry, hence the component tier."""
import json

import pytest

from evaluation import workload_audit as W

pytestmark = pytest.mark.component

SECONDS, WARMUP = 200.0, 20.0


def test_pauses_of_the_loop_do_not_move_the_plan_nor_feed_the_predictor():
    """A loop that validates every ~30 s (8 s; a 25 s checkpoint at ~120 s) is planned as the same loop
    without pauses, give or take a re-plan; a loop that stands still for 150 s is fed no window while it
    does. On the code before the pause fixes (af6d1ff, before 5cff570, 99ea527, d8c1337) the first
    re-planned 14 times in these 200 s (down to 2 workers) and was fed 3 windows in its checkpoint; the
    second was fed a window every 3 s from 19 s into its stop (27)."""
    steady = W.run_agent("steady", SECONDS, WARMUP, seed=1)
    validation = W.run_agent("validation", SECONDS, WARMUP, seed=1)
    paused = W.run_agent("paused", SECONDS, WARMUP, seed=1)
    for r in (steady, validation, paused):
        assert r["errors"] == [] and r["windows"] > 10
    assert len(validation["stalls"]) >= 4                  # the pauses happened, ...
    assert validation["replans"] <= steady["replans"] + 2, validation["allocations"]
    assert validation["median_workers"] == steady["median_workers"]
    assert validation["windows_in_stalls"] == 0, validation["windows_in_stalls_at"]
    (stop, resume), = paused["stalls"]                     # ... and the stop: one, running to the end
    assert resume == SECONDS and stop < SECONDS - 60
    assert paused["windows_in_stalls"] == 0, paused["windows_in_stalls_at"]
    assert paused["replans"] <= steady["replans"] + 1, paused["allocations"]


def test_runs_are_deterministic_and_the_tuner_holds_a_steady_loop():
    a = W.run_agent("lognormal", 60.0, 10.0, seed=3)
    assert W.run_agent("lognormal", 60.0, 10.0, seed=3) == a
    tuner = W.run_tuner("validation", SECONDS, WARMUP, seed=1)
    assert tuner["moves"] == 0, tuner["moves_at"]          # (6 moves down to 1 worker before the pause fix)


def test_cli_prints_the_table_writes_json_and_names_a_bad_scenario(tmp_path, capsys):
    assert W.main(["--scenarios", "steady,fast", "--seconds", "30", "--warmup", "10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| scenario | re-plans |" in out and "| steady |" in out and "| fast |" in out
    doc = json.loads((tmp_path / "workload_audit.json").read_text())
    assert set(doc["scenarios"]) == {"steady", "fast"} and doc["scenarios"]["fast"]["agent"]["samples_per_s"] > 0
    for argv, words in ((["--scenarios", "steady,bogus"], "--scenarios: unknown 'bogus'; choose from: steady,"),
                        (["--seconds", "30", "--warmup", "30"], "--warmup (30) must be below --seconds (30)"),
                        (["--seconds", "5"], "at least 10 expected")):
        with pytest.raises(SystemExit) as e:
            W.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "Traceback" not in err, err


def test_a_loop_away_from_its_loader_lends_its_cores_to_its_neighbour_and_gets_them_back():
    """The 150-s stop (from ~100 s, 400 s simulated): ``release_away_s`` (10 s) into it, the job under test is
    planned its least cores with its workers kept, and its CPU-hungry neighbour the room; within two ticks of
    its return it has its cores back. Its own throughput is what it was without the release (within 1%:
    the ticks between its return and the new plan), its neighbour's is higher; with 0, nothing moves."""
    on = W.run_agent("paused", 400.0, WARMUP, seed=1)
    off = W.run_agent("paused", 400.0, WARMUP, seed=1, config=W.PolicyConfig(release_away_s=0))
    (stop, resume), = on["stalls"]
    assert on["errors"] == [] and off["errors"] == [] and resume < 400.0
    assert [a[1:] for a in off["allocations"] if a[0] > WARMUP] == []     # without it: held through the stop
    held = off["allocations"][-1][1:]
    moves = [a for a in on["allocations"] if a[0] > WARMUP]
    (t_away, w_away, c_away), (t_back, w_back, c_back) = moves[:2]
    assert stop + 10.0 <= t_away <= stop + 12.0 and c_away == 0.05 and w_away == held[0]
    assert resume < t_back <= resume + 2.0 and (w_back, c_back) == held
    assert on["samples_per_s"] >= 0.99 * off["samples_per_s"]
    assert on["neighbour_samples_per_s"] > 1.03 * off["neighbour_samples_per_s"]
