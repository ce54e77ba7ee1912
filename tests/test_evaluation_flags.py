"""The number flags of the evaluation commands (``python -m evaluation.<name>``): text as the agent's
config reads it (no '1_0', no digits of other scripts) and finite floats, or a usage error naming the
flag (evaluation.flags)."""
from __future__ import annotations

import argparse
import importlib
import re

import pytest

from evaluation.flags import finite_float, plain_int
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
