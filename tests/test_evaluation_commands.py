"""The component benchmarks' command lines (`python -m evaluation.<module>`): a bad argument is a usage
error naming it, before anything is measured, never a traceback."""
from __future__ import annotations

import pytest

from evaluation import agent_bench, predictor_accuracy

pytestmark = pytest.mark.unit


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: " in err and "Traceback" not in err, err
    return err


def test_predictor_accuracy_names_a_bad_corpus_or_start(tmp_path, capsys):
    """(a missing or non-JSON corpus, or --starts without ':', was a traceback)"""
    (tmp_path / "text.jsonl").write_text("not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    for argv, words in ((["--corpus", str(tmp_path / "absent.jsonl")], "absent.jsonl: cannot read: No such file"),
                        (["--corpus", str(tmp_path / "text.jsonl")], "text.jsonl: not a corpus"),
                        (["--corpus", str(tmp_path / "empty.jsonl")], "empty.jsonl: no measurements in it"),
                        (["--starts", "2"], "--starts takes WORKERS:CORES pairs")):
        assert words in _usage_error(predictor_accuracy.main, argv + ["--validation", ""], capsys)


def test_agent_bench_refuses_an_unknown_policy_before_starting_an_agent(capsys, monkeypatch):
    """(the first agent it started refused it, and the bench died with a RuntimeError's traceback)"""
    monkeypatch.setattr(agent_bench, "run_one", lambda *a, **k: pytest.fail("an agent was started"))
    err = _usage_error(agent_bench.main, ["--policies", "even,bogus"], capsys)
    assert "--policies: unknown 'bogus'; choose from: adaptive, even, even-static, none" in err
