"""Speech coded by libopus itself, through ctypes: the copy PyAV ships with its wheels (so
every host that runs the server has it), else the system's.

PyAV reaches libopus through FFmpeg: each 20 ms becomes an ``AudioFrame``, passes a
filter graph that re-chunks it to the codec's frame size, and comes back as a ``Packet``;
that wrapping was an eighth of the returned speech's encode (0.080 against 0.070 ms a
chunk of espeak-ng's conversation here, the same bytes out;
benchmarks/results/2026-12-06-speech-encode-libopus.md). A
packet of 40 ms is still two 20 ms frames joined (``server.media.encoding.join_opus``):
libopus 1.6 coding 40 ms in one call, CELT-only, spent about half the bits asked for
(34 against 64 kbit/s) and lost 8 dB of SNR.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import weakref
from functools import cache

import numpy as np

from server.media.clock import AUDIO_RATE

#: ``OPUS_APPLICATION_RESTRICTED_LOWDELAY``: CELT only, no look-ahead for speech detection.
RESTRICTED_LOWDELAY = 2051
_SET_BITRATE, _SET_COMPLEXITY, _SET_VBR_CONSTRAINT = 4002, 4010, 4020
#: The most bytes a packet takes (RFC 6716, 3.2.1: 1275 a frame; 60 ms is three).
MAX_PACKET = 4000


class OpusError(RuntimeError):
    """libopus refused a call (its own error code, named)."""


@cache
def _lib() -> ctypes.CDLL:
    import av

    bundled = sorted(glob.glob(os.path.join(os.path.dirname(av.__file__), os.pardir,
                                            "av.libs", "libopus*.so*")))
    path = bundled[0] if bundled else ctypes.util.find_library("opus")
    if path is None:
        raise OpusError("libopus not found: neither PyAV's wheel nor the system has it")
    lib = ctypes.CDLL(path)
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_int)]
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_encode.restype = ctypes.c_int32
    lib.opus_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_char_p, ctypes.c_int32]
    lib.opus_strerror.restype = ctypes.c_char_p
    return lib


def _check(code: int, what: str) -> int:
    if code < 0:
        raise OpusError(f"{what}: {_lib().opus_strerror(code).decode()}")
    return code


class OpusEncoder:
    """A mono Opus encoder at 48 kHz: int16 samples in (2.5 to 20 ms: see above), one
    packet out."""

    def __init__(self, *, bitrate: int = 64000, complexity: int = 5,
                 application: int = RESTRICTED_LOWDELAY) -> None:
        lib = _lib()
        error = ctypes.c_int()
        self._state = lib.opus_encoder_create(AUDIO_RATE, 1, application, ctypes.byref(error))
        _check(error.value, "opus_encoder_create")
        weakref.finalize(self, lib.opus_encoder_destroy, ctypes.c_void_p(self._state))
        # Unconstrained VBR, as FFmpeg's libopus wrapper sets it ("vbr=on").
        for request, value in ((_SET_BITRATE, bitrate), (_SET_COMPLEXITY, complexity),
                               (_SET_VBR_CONSTRAINT, 0)):
            _check(lib.opus_encoder_ctl(ctypes.c_void_p(self._state), ctypes.c_int(request),
                                        ctypes.c_int32(value)), f"opus_encoder_ctl {request}")
        self._out = ctypes.create_string_buffer(MAX_PACKET)
        self._encode = lib.opus_encode

    def encode(self, samples: np.ndarray) -> bytes:
        pcm = np.ascontiguousarray(samples, np.int16)
        size = self._encode(self._state, pcm.ctypes.data, pcm.size, self._out, MAX_PACKET)
        if size < 0:  # checked here, not by ``_check``: its message is not made per chunk
            _check(size, f"opus_encode of {pcm.size} samples")
        return ctypes.string_at(self._out, size)
