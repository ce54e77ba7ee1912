"""The number flags of the evaluation commands (``python -m evaluation.<name>``): text as the agent's
config reads it (no '1_0', no digits of other scripts) and finite floats, or a usage error naming the
flag (evaluation.flags)."""
from __future__ import annotations

import argparse
import importlib
import re

import pytest

from evaluation.flags import above, at_least, comma_list, finite_float, plain_int
from tests.conftest import REPO

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("module, argv, flag, bad", [
    # each argv would run quickly (or stop on another error) if the bad value were read as a number
    ("controller_bench", ["--jobs", "1", "--ticks", "1", "--repeats", "1", "--policies", "even", "--target-ms", "nan"],
     "--target-ms", "nan"),
    ("hold_noise", ["--ticks", "2", "--levels", "0", "--nodes", "1_0"], "--nodes", "1_0"),
    ("mix_study", ["--nodes", "2:3", "--mixes", "1", "--floor-fraction", "inf"], "--floor-fraction", "inf"),
    ("loader_overhead", ["--tree", "x=/nonexistent", "--pairs", "\u0662"], "--pairs", "\u0662"),
])
def test_a_malformed_number_is_a_usage_error_naming_the_flag(module, argv, flag, bad, tmp_path, capsys):
    mod = importlib.import_module(f"evaluation.{module}")
    out = ["--out", str(tmp_path / "out.json")] if module != "loader_overhead" else []
    with pytest.raises(SystemExit) as e:
        mod.main(out + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and repr(bad) in err, err


def test_the_types_take_plain_numbers_and_refuse_the_rest():
    assert plain_int("12") == 12 and plain_int("-3") == -3
    assert finite_float("0.5") == 0.5 and finite_float("1e3") == 1000.0 and finite_float("-2") == -2.0
    for text in ("1_0", "\u0661\u0660", "\uff11", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            plain_int(text)
    for text in ("nan", "NaN", "inf", "-Infinity", "1e999", "1_0.5", "\u0661.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            finite_float(text)


def test_no_evaluation_command_reads_a_number_flag_with_int_or_float():
    """Every ``type=`` of a number flag under evaluation/ is one of evaluation.flags' types."""
    plain = re.compile(r"\btype\s*=\s*(int|float)\b")
    found = [f"{p.name}:{i}" for p in sorted((REPO / "evaluation").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if plain.search(line)]
    assert found == []


def test_a_comma_separated_list_reads_its_items_with_the_plain_types():
    assert comma_list(plain_int)("0,1, 2") == [0, 1, 2] and comma_list(plain_int)("7") == [7]
    assert comma_list(finite_float)("0,0.05,1e-2") == [0.0, 0.05, 0.01]
    for text in ("1,,2", "1,", ",1", "", " ", "1e3", "1_0", "\u0661", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            comma_list(plain_int)(text)
    for text in ("0,nan", "inf", "0,-Infinity", "1e999", "0,,1", "0.1_0"):
        with pytest.raises(argparse.ArgumentTypeError):
            comma_list(finite_float)(text)


@pytest.mark.parametrize("module, argv, flag, bad", [
    # (before: int() and float() over text.split(","): '1e3' and '1_0' read or a traceback, 'nan' and
    # 'inf' read as levels or CPU allowances, empty items skipped without a word)
    ("wakeup_wait", ["--neighbours", "0,1e3"], "--neighbours", "1e3"),
    ("wakeup_wait", ["--neighbours", "0,,1"], "--neighbours", "0,,1"),
    ("oversub_cpu", ["--procs", "1,2_0"], "--procs", "2_0"),
    ("hold_noise", ["--levels", "0,nan"], "--levels", "nan"),
    ("predictor_corpus", ["--cores", "1,inf"], "--cores", "inf"),
    ("predictor_corpus", ["--workers", "1,"], "--workers", "1,"),
    ("best_plan", ["--nodes", "2:3", "--random", "2", "--pick", "1e0"], "--pick", "1e0"),
    ("best_plan", ["--nodes", "2:\u0663"], "--nodes", "2:\u0663"),
    ("validate_sim", ["--nodes", "16:8,1_6:8"], "--nodes", "1_6:8"),
    ("jobproc", ["--spec", "{}", "--progress", "/nonexistent/p", "--sweep", "1,2.5"], "--sweep", "2.5"),
])
def test_a_malformed_item_of_a_number_list_is_a_usage_error_naming_the_flag(module, argv, flag, bad, tmp_path,
                                                                            capsys):
    mod = importlib.import_module(f"evaluation.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and repr(bad) in err, err


def test_number_lists_read_here_rather_than_by_argparse_refuse_the_same_items(capsys):
    """mix_study --nodes and predictor_accuracy --starts are read after argparse (their JSON records
    the flag as given), with the same list type."""
    from evaluation import mix_study, predictor_accuracy

    assert mix_study.main(["--nodes", "8:4,1_6:8"]) == 2
    assert "--nodes: " in (err := capsys.readouterr().err) and "'1_6:8'" in err, err
    assert mix_study.main(["--nodes", "8:4,"]) == 2 and "empty items" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        predictor_accuracy.main(["--starts", "2:nan", "--validation", ""])
    assert e.value.code == 2 and "--starts" in (err := capsys.readouterr().err) and "'2:nan'" in err, err


JOBPROC = ["--spec", "{}", "--progress", "/nonexistent/p"]


@pytest.mark.parametrize("module, argv, flag, bad", [
    # (before: jobproc --workers went through a bare int() after parsing, a traceback; the lists took any
    # number: 0 workers or -1 cores reached the measurement, 0 processes were dropped by a check after
    # parsing that did not name the value)
    ("jobproc", JOBPROC + ["--workers", "x"], "--workers", "x"),
    ("jobproc", JOBPROC + ["--workers", "1_0"], "--workers", "1_0"),
    ("jobproc", JOBPROC + ["--workers", "-1"], "--workers", "-1"),
    ("jobproc", JOBPROC + ["--sweep", "1,-1"], "--sweep", "-1"),
    ("jobproc", JOBPROC + ["--segment-s", "0"], "--segment-s", "0"),
    ("predictor_corpus", ["--workers", "0"], "--workers", "0"),
    ("predictor_corpus", ["--workers", "1,2,-3"], "--workers", "-3"),
    ("predictor_corpus", ["--cores", "-1"], "--cores", "-1"),
    ("predictor_corpus", ["--cores", "1,0"], "--cores", "0"),
    ("predictor_corpus", ["--window-s", "0"], "--window-s", "0"),
    ("predictor_corpus", ["--warmup-s", "-0.5"], "--warmup-s", "-0.5"),
    ("oversub_cpu", ["--procs", "1,0"], "--procs", "0"),
    # (before: any integer or finite number: a negative --max-workers or --total-steps was the loader's
    # ValueError as a traceback, a --duration-s of 0 or less stopped at the first step; 0 repeats, clients
    # or seconds measured nothing; 0 workers with persistent workers was torch's ValueError)
    ("jobproc", JOBPROC + ["--max-workers", "-1"], "--max-workers", "-1"),
    ("jobproc", JOBPROC + ["--total-steps", "-5"], "--total-steps", "-5"),
    ("jobproc", JOBPROC + ["--duration-s", "0"], "--duration-s", "0"),
    ("agent_bench", ["--clients", "0"], "--clients", "0"),
    ("agent_bench", ["--seconds", "-1"], "--seconds", "-1"),
    ("agent_bench", ["--repeats", "0"], "--repeats", "0"),
    ("controller_bench", ["--jobs", "0"], "--jobs", "0"),
    ("controller_bench", ["--ticks", "0"], "--ticks", "0"),
    ("controller_bench", ["--cores", "60", "-14"], "--cores", "-14"),
    ("controller_bench", ["--repeats", "0"], "--repeats", "0"),
    ("controller_bench", ["--target-ms", "0"], "--target-ms", "0"),
    ("loader_bench", ["--workers", "0"], "--workers", "0"),
    ("loader_burst", ["--seconds", "0"], "--seconds", "0"),
    ("loader_burst", ["--quota", "-0.5"], "--quota", "-0.5"),
    ("loader_overhead", ["--pairs", "0"], "--pairs", "0"),
    ("loader_overhead", ["--batches", "0"], "--batches", "0"),
    ("loader_overhead", ["--workers", "0"], "--workers", "0"),
    ("loader_overhead", ["--repeats", "0"], "--repeats", "0"),
    ("memory_bench", ["--workers", "0"], "--workers", "0"),
    ("memory_bench", ["--rows", "0"], "--rows", "0"),
    ("memory_bench", ["--epochs", "0"], "--epochs", "0"),
    ("memory_bench", ["--batch-size", "-1"], "--batch-size", "-1"),
    ("security_bench", ["--seconds", "0"], "--seconds", "0"),
    ("security_bench", ["--repeats", "0"], "--repeats", "0"),
    ("security_bench", ["--tick-s", "-1"], "--tick-s", "-1"),
    ("slurm_bench", ["--repeats", "0"], "--repeats", "0"),
])
def test_an_item_out_of_its_range_is_a_usage_error_naming_the_flag_and_value(module, argv, flag, bad, capsys):
    mod = importlib.import_module(f"evaluation.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and repr(bad) in err and "Traceback" not in err, err


def test_jobproc_workers_above_max_workers_is_a_usage_error_naming_both(capsys):
    # (before: the loader's ValueError "num_workers=4 exceeds max_workers=2", as a traceback)
    from evaluation import jobproc

    with pytest.raises(SystemExit) as e:
        jobproc.main(JOBPROC + ["--workers", "4", "--max-workers", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--workers 4 exceeds --max-workers 2" in err and "Traceback" not in err, err


def test_the_range_types_refuse_outside_and_take_the_bound_as_said():
    assert at_least(plain_int, 1)("1") == 1 and above(finite_float, 0)("0.25") == 0.25
    assert at_least(finite_float, 0)("0") == 0.0
    for parse, text in ((at_least(plain_int, 1), "0"), (above(finite_float, 0), "0"), (at_least(plain_int, 0), "x")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    with pytest.raises(argparse.ArgumentTypeError, match=r"an integer at least 1 expected, got '0' \(in '2,0'\)"):
        comma_list(at_least(plain_int, 1))("2,0")


def test_predictor_accuracy_starts_out_of_range_is_a_usage_error_naming_the_pair(capsys):
    from evaluation import predictor_accuracy

    for bad in ("0:1", "2:0", "1:-0.5"):
        with pytest.raises(SystemExit) as e:
            predictor_accuracy.main(["--starts", f"2:2,{bad}", "--validation", ""])
        assert e.value.code == 2 and "--starts" in (err := capsys.readouterr().err) and repr(bad) in err, err


def test_no_evaluation_command_reads_a_comma_separated_list_with_int_or_float():
    """A list flag's items go through evaluation.flags.comma_list (the same text rules as one number)."""
    bare = re.compile(r"\b(int|float)\(.*split\(\",\"\)")
    found = [f"{p.name}:{i}" for p in sorted((REPO / "evaluation").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert found == []


class _Parsed(Exception):
    """Raised in place of running a command whose arguments parsed."""


# each command with each of its path and name-list flags; ('' from a variable left unset was read as the
# flag not given, as an empty list, or as the working directory)
_EMPTY_CASES = [
    ("agent_bench", "--policies", "names"), ("agent_bench", "--out", "path"), ("agent_bench", "--profile", "path"),
    ("best_plan", None, "path"), ("best_plan", "--mixes", "names"), ("best_plan", "--out", "path"),
    ("controller_bench", "--policies", "names"), ("controller_bench", "--out", "path"),
    ("hold_noise", "--out", "path"), ("loader_bench", "--out", "path"),
    ("loader_burst", "--loaders", "names"), ("loader_burst", "--out", "path"),
    ("loader_overhead", "--out", "path"), ("lone_worker", "--out", "path"), ("memory_bench", "--out", "path"),
    ("mix_study", "--out", "path"),
    ("multirank_check", "--against", "path"), ("multirank_check", "--policy", "names"),
    ("multirank_check", "--out", "path"), ("oversub_cpu", "--out", "path"),
    ("phase_noise", None, "path"), ("phase_noise", "--out", "path"),
    ("phase_scan", None, "path"), ("phase_scan", "--out", "path"), ("pin_bench", "--out", "path"),
    ("plots", None, "path"), ("predictor_accuracy", "--corpus", "path"), ("predictor_accuracy", "--json", "path"),
    ("predictor_corpus", "--out", "path"), ("predictor_corpus", "--jobs", "names"),
    ("security_bench", "--scenarios", "names"), ("security_bench", "--agent-repo", "path"),
    ("security_bench", "--out", "path"), ("slurm_bench", "--out", "path"),
    ("supply_check", "--against", "path"), ("supply_check", "--out", "path"),
    ("validate_sim", None, "path"), ("validate_sim", "--out", "path"), ("wakeup_wait", "--out", "path"),
    ("workload_audit", "--out", "path"),
]
# positional arguments the commands need besides the flag under test
_POSITIONAL = {"phase_noise": ["x.json"], "phase_scan": ["agent.log"], "plots": ["bench.json"]}


@pytest.mark.parametrize("module, flag, kind", _EMPTY_CASES)
def test_an_empty_path_or_name_list_is_a_usage_error_naming_the_flag(module, flag, kind, monkeypatch, capsys):
    """The arguments are parsed only: a command whose arguments parse stops there (``_Parsed``)."""
    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    mod = importlib.import_module(f"evaluation.{module}")
    argv = [""] if flag is None else _POSITIONAL.get(module, []) + [flag, ""]
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument {flag}: " if flag else "argument ") in err, err
    assert ("an empty path" if kind == "path" else "no name given") in err, err
    # the same argv with a value given parses (the flag is the only thing refused)
    good = ["x"] if flag is None else _POSITIONAL.get(module, []) + [flag, "x"]
    with pytest.raises(_Parsed):
        mod.main(good)
