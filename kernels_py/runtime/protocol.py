"""Wire format between the Go host and a worker: frames of a 4-byte big-endian
length followed by that many bytes of UTF-8 JSON. Mirrors gohost/worker/frame.go."""

import json
import struct

# Tensors travel by reference (shared memory), so frames only carry metadata and
# small results; the cap catches a desynchronised stream before a huge allocation.
MAX_FRAME_BYTES = 64 << 20

_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """The byte stream is not a valid sequence of frames."""


def _read_exact(stream, n: int) -> bytes:
    chunks = []
    remaining = n
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(stream):
    """Return the next decoded message, or None on a clean end of stream."""
    header = _read_exact(stream, _HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise ProtocolError(f"truncated frame header: {len(header)} of {_HEADER.size} bytes")
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    body = _read_exact(stream, length)
    if len(body) < length:
        raise ProtocolError(f"truncated frame body: {len(body)} of {length} bytes")
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"frame is not valid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame holds a JSON {type(msg).__name__}, want an object")
    return msg


def encode_frame(msg: dict, default=None) -> bytes:
    body = json.dumps(msg, default=default, allow_nan=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _HEADER.pack(len(body)) + body


def write_frame(stream, msg: dict, default=None) -> None:
    stream.write(encode_frame(msg, default))
    stream.flush()
