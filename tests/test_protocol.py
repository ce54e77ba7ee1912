import json

import pytest

from adloader import protocol
from adloader import protocol as p

pytestmark = pytest.mark.unit


def test_roundtrip_and_unknown_fields_ignored():
    m = p.make("directive", job="j1", seq=3, workers=4, cpus=1.5, cpuset=None, reason="r")
    assert p.decode(p.encode(m)) == m
    m2 = dict(m, future_field={"x": 1})
    assert p.decode(json.dumps(m2).encode())["workers"] == 4


def test_major_mismatch_names_version():
    with pytest.raises(p.ProtocolError) as e:
        p.decode(json.dumps({"v": "2.0", "type": "heartbeat"}).encode())
    assert e.value.code == "version" and "2.0" in str(e.value) and "upgrade" in str(e.value)


@pytest.mark.parametrize("frame,code", [
    (b"\xff\xfe", "malformed"), (b"[1,2]", "malformed"), (b'{"type":"hello"}', "malformed"),
    (b'{"v":"1.0","type":"nope"}', "unknown_type"),
    (b'{"v":"1.0","type":"hello","job":"j","rank":true,"pid":1}', "malformed"),
    (b"x" * (p.MAX_MESSAGE_BYTES + 1), "too_large"),
])
def test_bad_frames_give_named_errors(frame, code):
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frame)
    assert e.value.code == code


@pytest.mark.parametrize("job", ["4242", "4242_7", "pid-123", "torchrun-abc.def", "a@b:c+d=e", "_x", "x" * 128])
def test_job_id_grammar_accepts_what_schedulers_use(job):
    assert protocol.check_job_id(job) is None


@pytest.mark.parametrize("job", ["", ".", "..", ".hidden", "a/b", "a b", "a\x00b", "a\nb", "-x", "~x", "x" * 129, 5])
def test_job_id_grammar_refuses_paths_dots_separators_and_control_characters(job):
    assert protocol.check_job_id(job) is not None


def test_huge_integers_and_non_finite_numbers_are_malformed_not_overflow():
    """Issue 16.10: a 4,000-digit integer in a report raised OverflowError inside the collector."""
    for body in ('"steps": ' + "9" * 4000, '"data_wait_s": 1e400', '"x": NaN', '"x": -Infinity'):
        data = ('{"v": "1.0", "type": "report", "job": "j", "rank": 0, "pid": 1, "stats": {' + body + "}}").encode()
        with pytest.raises(protocol.ProtocolError) as e:
            protocol.decode(data)
        assert e.value.code == "malformed"
    ok = protocol.decode(b'{"v": "1.0", "type": "report", "job": "j", "rank": 0, "pid": 1, "stats": {"steps": 12345678901234567890}}')
    assert ok["stats"]["steps"] == 12345678901234567890
