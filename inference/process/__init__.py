"""The inference process: the shared scheduler and the engine, serving every media worker.

One Python process cannot carry a GPU's worth of sessions: the engine's Python side
(packing inputs, launching, waiting for copies) queues for the GIL behind the media side's
event loop. Measured on an H200, a batch of one took 1.82 ms instead of 0.33 with 256
sessions' submissions on the same loop
(benchmarks/results/2026-11-30-scheduler-and-engine-process.md). So one process per GPU owns the
scheduler and the engine, and media workers connect to it over a Unix socket
(``multiprocessing.connection``: authenticated, framed, from the standard library). Each
worker shares a ring of frame slots with it in shared memory: the worker writes a frame's
inputs into a slot and sends the slot's number; the process answers with that number once
the frame (I420, half the bytes of RGB) and its coefficients are in the same slot. Only
slot numbers, deadlines and short replies cross the socket; a portrait crosses it once.
One scheduler sees every worker's frames, so a batch spans all of them.

Deadlines are event-loop times, which every process reads from the same monotonic clock.

One job a module, as vLLM v1 splits its engine core from its client:

- ``ring``: where each slot's inputs and outputs lie in a worker's shared memory;
- ``messages``: every message on the socket and the control pipe, one typed class each;
- ``outbox``: per-frame items sent as one message a round of the event loop;
- ``core``: the process side, the shared service and the workers connected to it;
- ``client``: a media worker's ``Inference``, talking to the core;
- ``handle``: the front door's handle that starts, stops and hears the process;
- ``standalone``: a process and its one client together, for benchmarks and tests.
"""


class InferenceProcessError(RuntimeError):
    """The inference process failed to start, refused a call, or died."""
