import io

import pytest

from kernels_py.runtime import protocol


def test_roundtrip_many_frames():
    msgs = [{"type": "run", "id": i, "job": {"args": {"s": "é" * i}}} for i in range(20)]
    stream = io.BytesIO(b"".join(protocol.encode_frame(m) for m in msgs))
    assert [protocol.read_frame(stream) for _ in msgs] == msgs
    assert protocol.read_frame(stream) is None


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\x00\x00", "truncated frame header"),
        (b"\x00\x00\x00\x10{}", "truncated frame body"),
        (b"\x00\x00\x00\x03abc", "not valid JSON"),
        (b"\x00\x00\x00\x02[]", "JSON list"),
        (b"\xff\xff\xff\xff", "exceeds"),
    ],
)
def test_bad_frames(data, match):
    with pytest.raises(protocol.ProtocolError, match=match):
        protocol.read_frame(io.BytesIO(data))


def test_nan_is_refused_on_the_wire():
    with pytest.raises(ValueError):
        protocol.encode_frame({"x": float("nan")})
