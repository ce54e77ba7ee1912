"""`python -m evaluation.plots BENCH.json [OUT_DIR]`: its command line (the drawing runs in the bench
harness's tests, through ``evaluation.setup.run``)."""
from __future__ import annotations

import json

import pytest

from evaluation import plots

pytestmark = pytest.mark.unit


def test_help_and_bad_input_are_usage_errors_not_tracebacks(tmp_path, capsys):
    """(`--help` was read as the file's name, and a missing, non-JSON or non-bench file was a traceback)"""
    with pytest.raises(SystemExit) as e:
        plots.main(["--help"])
    assert e.value.code == 0 and "BENCH.json [OUT_DIR]" in capsys.readouterr().out
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "list.json").write_text("[]")
    for name, words in (("absent.json", "absent.json: cannot read it as JSON: No such file or directory"),
                        ("text.json", "text.json: cannot read it as JSON: Expecting value"),
                        ("list.json", "list.json: not the bench.json of an `adloader bench` run")):
        with pytest.raises(SystemExit) as e:
            plots.main([str(tmp_path / name)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "usage: python -m evaluation.plots" in err, err


def test_a_run_without_figures_draws_nothing_and_exits_0(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"phases": [], "summary": {}}))
    assert plots.main([str(bench), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").is_dir() and capsys.readouterr().out == ""
