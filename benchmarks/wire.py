"""What the inference wire's typed messages cost against the string-tagged tuples they
replaced, per message on the per-frame path: a batch of ``--items`` frames submitted
(``Submit``) and answered (``Done``), pickled and unpickled as ``Connection.send`` and
``recv`` do. Prints the median over ``--repeats`` timings of ``--number`` calls each, in
microseconds per message, and the pickle's bytes.

    python -m benchmarks.wire --items 64
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import timeit
from multiprocessing.reduction import ForkingPickler
from typing import Any

from inference.process.messages import Done, Submit


def costs(messages: list[Any], number: int, repeats: int) -> list[tuple[int, float, float]]:
    """Bytes, then median microseconds to pickle and to unpickle, for each message. The
    messages take turns within each repeat, so a busy moment of the machine falls on all
    of them alike."""
    data = [bytes(ForkingPickler.dumps(m)) for m in messages]  # what Connection.send writes
    dumps: list[list[float]] = [[] for _ in messages]
    loads: list[list[float]] = [[] for _ in messages]
    for _ in range(repeats):
        for i, (message, pickled) in enumerate(zip(messages, data, strict=True)):
            dumps[i].append(timeit.timeit(lambda m=message: ForkingPickler.dumps(m),
                                          number=number))
            loads[i].append(timeit.timeit(lambda d=pickled: pickle.loads(d), number=number))
    return [(len(d), statistics.median(p) / number * 1e6, statistics.median(u) / number * 1e6)
            for d, p, u in zip(data, dumps, loads, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=64, help="frames a batch")
    parser.add_argument("--number", type=int, default=2000, help="calls a timing")
    parser.add_argument("--repeats", type=int, default=31, help="timings, of which the median")
    args = parser.parse_args()
    submitted = [(i, i % 16, 81234.5678 + 0.04 * i) for i in range(args.items)]
    answered = [(i, 256 if i % 8 else None) for i in range(args.items)]
    rows = [("submit", "tuple", ("submit", submitted)), ("submit", "Submit", Submit(submitted)),
            ("done", "tuple", ("done", answered)), ("done", "Done", Done(answered))]
    print(f"{args.items} items a message, median of {args.repeats} x {args.number} calls")
    print(f"{'message':8} {'as':7} {'bytes':>6} {'pickle us':>10} {'unpickle us':>12}")
    measured = costs([message for _, _, message in rows], args.number, args.repeats)
    for (kind, form, _), (size, dumps, loads) in zip(rows, measured, strict=True):
        print(f"{kind:8} {form:7} {size:6d} {dumps:10.2f} {loads:12.2f}")


if __name__ == "__main__":
    main()
