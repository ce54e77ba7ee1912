"""agent/journal.py: atomic save, round trip, a corrupt or missing journal reads as None."""
from __future__ import annotations

import os

import pytest

from agent import journal
from agent.model import JobAllocation

pytestmark = pytest.mark.unit


def test_journal_atomic_roundtrip_and_corrupt_file(tmp_path):
    a = JobAllocation(job="j", workers=3, cpus=1.5, cpuset=(0, 1), reason="r", cpu_weight=1.8, budget=2.55,
                      delivery=1.2)
    journal.save(str(tmp_path), {"j": a}, {"j": {"uid": 0}})
    doc = journal.load(str(tmp_path))
    assert doc["applied"]["j"] == a and doc["jobs"] == {"j": {"uid": 0}}
    assert [p.name for p in tmp_path.iterdir()] == ["journal.json"]     # no temp file left behind
    assert oct(os.stat(tmp_path / "journal.json").st_mode & 0o777) == "0o600"
    (tmp_path / "journal.json").write_text('{"version": 1, "applied": {"j": ')
    got = journal.load(str(tmp_path))        # set aside and reported (tests/test_security_state.py)
    assert got["jobs"] == {} and got["applied"] == {} and "journal.json" in got["problems"][0]
    assert journal.load(str(tmp_path / "nothing")) is None


@pytest.mark.parametrize("version", ["true", "1.0", '"1"', "2", "null"])
def test_a_journal_whose_version_is_not_the_integer_1_is_set_aside(tmp_path, version):
    """Before: ``"version": true`` and ``1.0`` passed the check (``== 1`` in Python) and the journal was
    adopted as version 1. Now each version that is not the integer 1 is set aside and reported."""
    (tmp_path / "journal.json").write_text('{"version": %s, "applied": {}, "jobs": {"j": {"uid": 0}}}' % version)
    got = journal.load(str(tmp_path))
    assert got["jobs"] == {} and len(got["problems"]) == 1 and "version must be 1" in got["problems"][0], got
    assert not (tmp_path / "journal.json").exists()


def test_make_dir_reports_only_what_it_made_and_remove_made_keeps_what_holds_a_file(tmp_path):
    from agent import statefile

    os.mkdir(tmp_path / "there")
    assert statefile.make_dir(str(tmp_path / "there")) == []
    made = statefile.make_dir(str(tmp_path / "there" / "a" / "b"), mode=0o700)
    assert made == [str(tmp_path / "there" / "a"), str(tmp_path / "there" / "a" / "b")]
    assert os.stat(made[-1]).st_mode & 0o777 == 0o700
    (tmp_path / "there" / "a" / "note").write_text("x")
    statefile.remove_made(made)           # b is empty: removed; a holds a file: kept, and all above it
    assert not os.path.exists(made[-1]) and os.path.isfile(tmp_path / "there" / "a" / "note")
    statefile.remove_made(statefile.make_dir(str(tmp_path / "there" / "c" / "d")))
    assert sorted(os.listdir(tmp_path / "there")) == ["a"]
    (tmp_path / "f").write_text("")
    with pytest.raises(FileExistsError):  # a file at the path: refused, as os.makedirs does
        statefile.make_dir(str(tmp_path / "f"))


def test_temporary_files_left_by_a_writer_killed_mid_write_are_removed_at_load(tmp_path):
    """Before: an agent killed between writing its temporary file and renaming it (SIGKILL, the OOM
    killer, power loss) left ``.journal.json.<pid>.tmp`` (and ``.prev`` link) for good, one more per crash.
    Now the next load removes them, and only them; the journal and its last good copy are read as before."""
    from agent import statefile
    from agent.actuators.originals import Originals

    journal.save(str(tmp_path), {}, {"j": {"uid": 0}})
    journal.save(str(tmp_path), {}, {"j": {"uid": 0}})            # a .prev too
    orig = tmp_path / "cgroup-originals.json"
    left = [".journal.json.4321.tmp", ".journal.json.4321.tmp.prev", ".cgroup-originals.json.99.tmp"]
    others = ["journal.json.bad-20260101T000000Z", ".journal.json.x.tmp", "notes.tmp"]
    for name in left + others:
        (tmp_path / name).write_text("{")
    assert journal.load(str(tmp_path))["jobs"] == {"j": {"uid": 0}}
    Originals(str(orig))
    assert sorted(os.listdir(tmp_path)) == sorted(["journal.json", "journal.json.prev", *others])
    assert statefile.remove_stale_temps(str(tmp_path / "nothing" / "journal.json")) == []
