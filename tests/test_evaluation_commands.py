"""The component benchmarks' command lines (`python -m evaluation.<module>`): a bad argument is a usage
error naming it, before anything is measured, never a traceback."""
from __future__ import annotations

import pytest

from evaluation import agent_bench, predictor_accuracy



def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: " in err and "Traceback" not in err, err
    return err


@pytest.mark.unit
def test_predictor_accuracy_names_a_bad_corpus_or_start(tmp_path, capsys):
    """(a missing or non-JSON corpus, or --starts without ':', was a traceback)"""
    (tmp_path / "text.jsonl").write_text("not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    for argv, words in ((["--corpus", str(tmp_path / "absent.jsonl")], "absent.jsonl: cannot read: No such file"),
                        (["--corpus", str(tmp_path / "text.jsonl")], "text.jsonl: not a corpus"),
                        (["--corpus", str(tmp_path / "empty.jsonl")], "empty.jsonl: no measurements in it"),
                        (["--starts", "2"], "--starts takes WORKERS:CORES pairs")):
        assert words in _usage_error(predictor_accuracy.main, argv + ["--validation", ""], capsys)


@pytest.mark.unit
def test_agent_bench_refuses_an_unknown_policy_before_starting_an_agent(capsys, monkeypatch):
    """(the first agent it started refused it, and the bench died with a RuntimeError's traceback)"""
    monkeypatch.setattr(agent_bench, "run_one", lambda *a, **k: pytest.fail("an agent was started"))
    err = _usage_error(agent_bench.main, ["--policies", "even,bogus"], capsys)
    assert "--policies: unknown 'bogus'; choose from: adaptive, even, even-static, none" in err


@pytest.mark.unit
def test_pin_bench_refuses_bad_numbers_before_it_runs(capsys, monkeypatch):
    from evaluation import pin_bench

    monkeypatch.setattr(pin_bench.subprocess, "run", lambda *a, **k: pytest.fail("a run was started"))
    for argv, words in ((["--steps", "0"], "--steps must be at least 1"), (["--pin-ms", "-1"], "--pin-ms must be 0 or more"),
                        (["--step-ms", "nan"], "a finite number expected"), (["--repeats", "1_0"], "'1_0'")):
        assert words in _usage_error(pin_bench.main, argv, capsys), argv


@pytest.mark.component
def test_pin_bench_runs_both_loaders_and_writes_its_json(tmp_path, capsys):
    """A tiny real run: each loader, in its own process, trains with pinning on under the fake
    accelerator (torch's multiprocessing iterator included), and the JSON holds both (no timing asserted)."""
    import json

    from evaluation import pin_bench

    out = tmp_path / "pin.json"
    assert pin_bench.main(["--steps", "5", "--pin-ms", "1", "--step-ms", "1", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"torch", "adloader"} and all(len(v) == 1 for v in doc["runs"].values())
    assert all(doc["summary"][k]["steps_per_s"]["median"] > 0 for k in ("torch", "adloader"))
    assert "| adloader |" in capsys.readouterr().out


@pytest.mark.component
def test_memory_bench_measures_both_loaders_after_a_full_collection(tmp_path, capsys):
    """A small real run of each loader's forked workers, each running one full gc collection: torch's
    workers copy the pages of the training process's objects that the collection walks (tens of MiB
    with torch imported); adloader's keep them frozen (``adloader._pool._start_process``). Memory, not
    time, is asserted."""
    import json

    from evaluation import memory_bench

    uss = {}
    for loader in ("torch", "adloader"):
        out = tmp_path / f"{loader}.json"
        assert memory_bench.main(["--rows", "20000", "--epochs", "1", "--gc-collect", "--loader", loader,
                                  "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["args"]["loader"] == loader and doc["args"]["gc_collect"] is True
        uss[loader] = doc["results"]["numpy-array"]["uss_per_worker"]
        assert doc["results"]["numpy-array"]["workers"] == 2
    assert uss["adloader"] < uss["torch"] - 15 * (1 << 20), uss
    assert "a full gc collection in each worker" in capsys.readouterr().out


@pytest.mark.unit
def test_supply_check_refuses_bad_numbers_and_a_tree_that_is_not_a_checkout(tmp_path, capsys, monkeypatch):
    from evaluation import supply_check

    monkeypatch.setattr(supply_check, "run_once", lambda *a, **k: pytest.fail("a run was started"))
    for argv, words in ((["--seconds", "5"], "--seconds"), (["--repeats", "0"], "--repeats"),
                        (["--read-ms", "0"], "--read-ms"), (["--against", str(tmp_path)], "not a checkout")):
        assert words in _usage_error(supply_check.main, argv, capsys), argv


@pytest.mark.unit
def test_placement_latency_refuses_bad_arguments_before_it_runs(capsys, monkeypatch, tmp_path):
    from evaluation import placement_latency

    monkeypatch.setattr(placement_latency, "run_tree", lambda *a, **k: pytest.fail("a run was started"))
    (tmp_path / "agent").mkdir()
    for argv, words in ((["--passes", "0"], "at least 1"), (["--rounds", "1_0"], "'1_0'"),
                        (["--out", ""], "--out"), (["--tree", "x"], "expected NAME=DIR"),
                        (["--tree", f"x={tmp_path}"], "a checkout holding agent/ and adloader/")):
        assert words in _usage_error(placement_latency.main, argv, capsys), argv
    (tmp_path / "adloader").mkdir()
    err = _usage_error(placement_latency.main, ["--tree", f"a={tmp_path}", "--tree", f"a={tmp_path}"], capsys)
    assert "the name 'a' is given twice" in err


@pytest.mark.unit
def test_placement_latency_summary_counts_every_pass_and_the_ones_never_placed():
    from evaluation.placement_latency import summarize

    runs = [{"tree": "a", "passes": [{"placed_s": 0.4}, {"placed_s": None}, {"placed_s": 1.2}]},
            {"tree": "b", "passes": [{"placed_s": 0.3}]},
            {"tree": "a", "passes": [{"placed_s": 0.8}]}]
    s = summarize(runs)
    assert s["a"]["passes"] == 4 and s["a"]["never"] == 1 and s["a"]["median_s"] == 0.8
    assert s["a"]["range_s"] == [0.4, 1.2] and s["b"]["median_s"] == 0.3 and s["b"]["never"] == 0
