import json

import pytest

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
