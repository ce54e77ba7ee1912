"""agent/status.py: the `adloader status` table."""
from __future__ import annotations

import pytest

from tests.fakes import status_doc

pytestmark = pytest.mark.unit


def test_status_table_names_every_column():
    from agent.status import render_table

    t = render_table(status_doc())
    for word in ("JOB", "RANKS", "WORKERS", "CPUS", "WAIT", "GPU-IDLE", "SAMPLES/S", "MAX-USEFUL", "REASON",
                 "j1", "2->3", "31%", "marginal gain 0.2/core", "estimated from the job's data wait"):
        assert word in t, word



def test_the_workers_column_shows_the_live_workers_where_a_resize_is_not_in_force():
    """An endless IterableDataset's loader keeps its epoch's workers: target 3, 1 live, shown as such;
    a job whose workers are all live (or whose client does not say) shows its count alone."""
    from agent.status import render_table

    doc = status_doc()
    doc["jobs"][0].update(workers=3, desired_workers=3, live_workers=1)
    assert "3 (live 1)" in render_table(doc)
    for live in (3, None):
        doc["jobs"][0]["live_workers"] = live
        assert "(live" not in render_table(doc)


@pytest.mark.parametrize("change,in_row", [
    (lambda d: d["jobs"][0].pop("workers"), True),
    (lambda d: d["jobs"][0].pop("uid"), True),
    (lambda d: d["jobs"][0].pop("job"), True),
    (lambda d: d["jobs"][0].pop("ranks"), True),
    (lambda d: d.__setitem__("agent", None), False),
    (lambda d: d["agent"].__setitem__("memory", [1]), False),
    (lambda d: d.__setitem__("node", "yes"), False),
    (lambda d: d.__setitem__("jobs", None), False),
    (lambda d: d.__setitem__("jobs", ["j1", None]), False),
    (lambda d: d["jobs"][0].__setitem__("job", 42), False),
    (lambda d: d["jobs"][0].__setitem__("loader_memory_bytes", "100"), False),
    (lambda d: d["jobs"][0].__setitem__("workers", {"now": 2}), True),
], ids=["no-workers", "no-uid", "no-job", "no-ranks", "agent-null", "memory-list", "node-str", "jobs-null",
        "jobs-not-objects", "job-id-int", "memory-str", "workers-object"])
def test_a_status_document_from_a_broken_or_other_agent_renders_what_is_there(change, in_row):
    """Before: KeyError/AttributeError/TypeError, a traceback from `adloader status`. Now every field that
    is missing or unusable shows as ``?`` and the rest of the table is still there."""
    from agent.status import render_table

    doc = status_doc()
    change(doc)
    t = render_table(doc)
    assert "JOB" in t and "REASON" in t
    if in_row:
        row = next(line for line in t.splitlines() if "marginal gain 0.2/core" in line)
        assert "?" in row, row


def test_status_shows_missing_fields_as_a_question_mark_and_numbers_sent_as_text():
    from agent.status import render_table

    doc = status_doc()
    del doc["jobs"][0]["uid"], doc["jobs"][0]["workers"]
    doc["jobs"][0]["data_wait_frac"] = "0.31"
    doc["agent"] = {"pid": 7}
    t = render_table(doc)
    head, row = t.splitlines()[0], next(line for line in t.splitlines() if line.startswith("j1"))
    assert "pid 7" in head and "policy ?" in head, head
    assert row.split()[1:3] == ["?", "2"], row          # UID missing, RANKS there
    assert row.split()[3] == "?->3", row                # WORKERS missing, the desired count there
    assert "31%" in row, row


@pytest.mark.parametrize("change,note", [
    (lambda d: None, None),
    (lambda d: d["agent"].__setitem__("protocol", "1.7"), None),          # a newer minor: same fields
    (lambda d: d.__setitem__("version", 2), "status document version 2"),
    (lambda d: d.pop("version"), "status document version ?"),
    (lambda d: d["agent"].__setitem__("protocol", "2.0"), "protocol 2.0"),
])
def test_status_says_when_the_document_is_not_the_version_this_client_reads(change, note):
    from adloader import protocol
    from agent.status import STATUS_VERSION, render_table

    doc = status_doc()
    doc["agent"]["protocol"] = protocol.VERSION
    change(doc)
    lines = render_table(doc).splitlines()
    notes = [line for line in lines if line.startswith("note:")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0], lines
        assert f"version {STATUS_VERSION}" in notes[0] and protocol.VERSION in notes[0], notes


def test_the_job_column_shows_each_job_id_whole_and_on_one_line():
    """Before: the JOB cell was cut to 14 characters, so torchrun-4012345 and torchrun-4012399 (two
    jobs named after their torchrun agents' pids) both showed as "torchrun-40123". Now the column is
    as wide as the longest id; an id with a control character (a broken agent's document) is escaped."""
    from agent.status import render_table

    doc = status_doc()
    second = dict(doc["jobs"][0], job="torchrun-4012399")
    doc["jobs"] = [dict(doc["jobs"][0], job="torchrun-4012345"), second,
                   dict(doc["jobs"][0], job="slurm-123456789_1000:rank@node+x=y")]
    lines = render_table(doc).splitlines()
    rows = [line for line in lines if "marginal gain" in line]
    assert [r.split()[0] for r in rows] == ["torchrun-4012345", "torchrun-4012399",
                                            "slurm-123456789_1000:rank@node+x=y"]
    header = next(line for line in lines if line.startswith("JOB"))
    assert {r.index("marginal gain") for r in rows} == {header.index("REASON")}   # the columns still line up
    doc["jobs"] = [dict(second, job="a\nb\x1b[2J")]
    row = next(line for line in render_table(doc).splitlines() if "marginal gain" in line)
    assert row.startswith("a\\nb\\x1b[2J "), row
