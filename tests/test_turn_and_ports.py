"""TURN and the media port range: a client whose ICE may use nothing but relayed
candidates reaches the server through Debian's coturn (started here, on loopback), and the
server binds its media only to the UDP ports ``ice.udp_ports`` names."""

from __future__ import annotations

import asyncio
import errno
import re
import shutil
import socket
import subprocess
import time

import pytest
from aiortc import RTCConfiguration, RTCIceServer
from aiortc.rtcconfiguration import RTCIceTransportPolicy
from conftest import ServerProcess, free_port

from server.client.peer import run_session
from server.media.ports import NoFreePort, bind_udp_in_range

TURNSERVER = shutil.which("turnserver")
LOW = 41200  # the media range the server is given


class _Quiet(asyncio.DatagramProtocol):
    pass


@pytest.mark.unit
async def test_ephemeral_datagram_ports_come_from_the_range_until_it_is_full():
    loop = asyncio.get_running_loop()
    low = free_port()  # a TCP port number's neighbourhood is as good a range as any
    bind_udp_in_range(loop, low, low + 2)
    transports = []
    try:
        for _ in range(3):
            transport, _ = await loop.create_datagram_endpoint(
                _Quiet, local_addr=("127.0.0.1", 0))
            transports.append(transport)
        ports = sorted(t.get_extra_info("sockname")[1] for t in transports)
        assert ports == [low, low + 1, low + 2]
        with pytest.raises(NoFreePort) as raised:
            await loop.create_datagram_endpoint(_Quiet, local_addr=("127.0.0.1", 0))
        assert raised.value.errno == errno.EADDRINUSE
        # Sockets that name their port, or only send, are left alone.
        sender, _ = await loop.create_datagram_endpoint(_Quiet, remote_addr=("127.0.0.1", 9))
        transports.append(sender)
        assert not low <= sender.get_extra_info("sockname")[1] <= low + 2
    finally:
        for transport in transports:
            transport.close()


@pytest.fixture(scope="module")
def coturn(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if TURNSERVER is None:
        pytest.skip("coturn is not installed (apt-get install coturn)")
    port = free_port()
    log = tmp_path_factory.mktemp("coturn") / "turn.log"
    proc = subprocess.Popen(
        [TURNSERVER, "-n", "--listening-ip=127.0.0.1", f"--listening-port={port}",
         "--relay-ip=127.0.0.1", "--min-port=41300", "--max-port=41399",
         "--lt-cred-mech", "--user=avatar:secret", "--realm=sonic", "--allow-loopback-peers",
         "--no-cli", "--no-tls", "--no-dtls", "--no-tcp-relay", f"--log-file={log}",
         "--simple-log", "--no-stdout-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # listening once it answers a STUN binding request
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.settimeout(0.2)
            probe.sendto(bytes.fromhex("000100002112a442") + b"\x01" * 12, ("127.0.0.1", port))
            try:
                probe.recv(512)
                break
            except OSError:
                continue
    else:
        proc.kill()
        pytest.fail(f"coturn did not start: {log.read_text() if log.exists() else ''}")
    yield f"turn:127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def relayed_server(coturn):  # type: ignore[no-untyped-def]
    server = ServerProcess("--set", f"ice.servers={coturn}", "--set", "ice.username=avatar",
                           "--set", "ice.credential=secret",
                           "--set", f"ice.udp_ports={LOW},{LOW + 49}")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.e2e
async def test_a_relay_only_client_talks_to_the_avatar_through_coturn(relayed_server, coturn,
                                                                       speech_wav):
    client = RTCConfiguration(iceServers=[RTCIceServer(coturn, "avatar", "secret")],
                              iceTransportPolicy=RTCIceTransportPolicy.RELAY)
    received = await run_session(relayed_server.url, str(speech_wav), seconds=5.0,
                                 configuration=client)
    assert received.video_fps() >= 24
    assert len(received.audio.pts) > 100
    candidates = re.findall(r"a=candidate:\S+ \d+ udp \d+ (\S+) (\d+) typ (\w+)",
                            received.answer["sdp"])
    host_ports = [int(port) for _, port, kind in candidates if kind == "host"]
    assert host_ports and all(LOW <= port <= LOW + 49 for port in host_ports), candidates
    assert any(kind == "relay" for *_, kind in candidates)  # the server's own TURN too
