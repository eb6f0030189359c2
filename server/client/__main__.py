"""The server's reference WebRTC peer, on the command line.

It sends a WAV as the driving speech (or, with --view, watches a session an application
drives), prints what came back (frames, fps, coefficient messages) as JSON, and with
--out saves it as an MP4.

    python -m server.client http://127.0.0.1:8080 speech.wav --seconds 10
    python -m server.client http://127.0.0.1:8080 --view SESSION TOKEN --seconds 15 --out a.mp4
"""

from __future__ import annotations

import argparse
import asyncio
import json
from urllib.parse import urlparse

from server.client.peer import run_session
from server.client.recording import save_mp4
from server.media.peer import pin_host_addresses


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m server.client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("wav", nargs="?", default="",
                        help="the speech to send (not with --view)")
    parser.add_argument("--view", nargs=2, metavar=("SESSION", "TOKEN"),
                        help="send nothing: watch a session made by POST /sessions")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="how long to stay (default 10)")
    parser.add_argument("--out", metavar="CLIP.mp4",
                        help="save what comes back as an MP4, lips and sound as they played")
    parser.add_argument("--avatar", help="the avatar of a new session (GET /avatars)")
    parser.add_argument("--motion-only", action="store_true",
                        help="no video: count the coefficients sent on the data channel")
    parser.add_argument("--ice-host", action="append", default=None, metavar="ADDR",
                        help="offer only these host candidates (default 127.0.0.1 for a "
                             "loopback server URL)")
    args = parser.parse_args()
    hosts = args.ice_host
    if hosts is None and urlparse(args.url).hostname in ("127.0.0.1", "localhost"):
        hosts = ["127.0.0.1"]
    pin_host_addresses(hosts or [])
    options = {"motion_only": True} if args.motion_only else None
    if not args.view and not args.wav:
        parser.error("give a WAV to send, or --view SESSION TOKEN")
    if args.out and args.motion_only:
        parser.error("a motion-only session has no video to save (--out)")
    received = asyncio.run(run_session(args.url, args.wav, seconds=args.seconds,
                                       avatar=args.avatar, options=options,
                                       keep=bool(args.out),
                                       view=tuple(args.view) if args.view else None))
    saved = {"out": args.out, "frames_saved": save_mp4(received, args.out)} if args.out \
        else {}
    print(json.dumps({"session_id": received.session_id,
                      "video_frames": len(received.video.pts),
                      "audio_frames": len(received.audio.pts),
                      "video_fps": round(received.video_fps(), 2),
                      "coefficient_messages": len(received.coefficients),
                      "motion_fps": round(received.motion_fps(), 2), **saved}))


if __name__ == "__main__":
    main()
