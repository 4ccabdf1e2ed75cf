"""The far end of the data-plane suite's round trips: a ROUTER in a process of its own that answers
every message at once, as a worker would if computing took no time.

    python -m odmoe.benchmarks.wire_echo --mode raw|codec [--curve]

`raw` sends the received frames straight back (the wire's own cost: two ZeroMQ hops and the
process wake-ups); `codec` decodes a ComputeExpert with odmoe's codec and answers with an
ExpertResult carrying the same row, through the same `from_frames`/`to_frames` a worker uses. With
`--spin-us N` the raw echo first keeps its core busy N µs (as a worker computing an expert, with no
Python, codec or torch around it: the floor of a decode layer's exchange). With
`--curve` the ROUTER is a CURVE server whose secret key (Z85) is the first line of stdin (no ZAP:
the per-message cost is the same). Prints its port on the first line of stdout, then serves until
its stdin closes.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import zmq

from odmoe.messages import ComputeExpert, ExpertResult, from_frames, to_frames


def busy(seconds: float) -> None:
    """Keep this core busy (as a computing node does), not asleep, for `seconds`."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def serve(sock: zmq.Socket, mode: str, spin_s: float = 0.0) -> None:
    while True:
        peer, *frames = sock.recv_multipart(copy=False)
        if mode == "raw":
            busy(spin_s)
            sock.send_multipart([peer, *frames], copy=False)
            continue
        message, tensors = from_frames(frames)
        assert isinstance(message, ComputeExpert)
        result = ExpertResult(message.step, message.expert, 0, 0.0, 0.0, 0, 0)
        sock.send_multipart([peer, *to_frames(result, tensors)], copy=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["raw", "codec"], required=True)
    parser.add_argument("--curve", action="store_true", help="read a CURVE secret key from stdin")
    parser.add_argument("--spin-us", type=float, default=0.0, help="raw: stay busy this long before echoing")
    args = parser.parse_args(argv)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if args.curve:
        sock.curve_server = True
        sock.curve_secretkey = sys.stdin.readline().strip().encode()
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    threading.Thread(target=serve, args=(sock, args.mode, args.spin_us / 1e6), daemon=True).start()
    sys.stdin.read()  # the suite closes our stdin (or dies): then we go


if __name__ == "__main__":
    main()
