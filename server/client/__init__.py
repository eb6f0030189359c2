"""What runs in a caller's process, never in the server's: the reference WebRTC peer
(``peer``; ``python -m server.client``), an application's ``SessionClient``, the pipecat
processor, the start-up calibration's peers, and what test and benchmark peers send."""
