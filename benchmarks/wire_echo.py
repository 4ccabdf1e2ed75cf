"""The far end of the data-plane suite's round trips: a ROUTER in a process of its own that answers
every message at once, as a worker would if computing took no time.

    python -m odmoe_bench.wire_echo --mode raw|codec [--curve]

`raw` sends the received frames straight back (the wire's own cost: two ZeroMQ hops and the
process wake-ups); `codec` decodes a ComputeExperts with odmoe's codec and answers with an
ExpertsResult carrying the same row, through the same `from_frames`/`to_frames` a worker uses. With
`--spin-us N` the raw echo first keeps its core busy N µs (as a worker computing an expert, with no
Python, codec or torch around it: the floor of a decode layer's exchange). With
`--model DIR --layer L --kernel K` the raw echo instead computes one of that layer's experts on the
received row with the workers' own `expert_forward` (one torch thread; the experts taken in turn, so
their weights come from memory as a worker's do) and answers with its output: the floor with real
compute, whose cache misses and slower calls in a process just woken a spin does not have; on exit
it prints its median compute µs. With
`--curve` the ROUTER is a CURVE server whose secret key (Z85) is the first line of stdin (no ZAP:
the per-message cost is the same). Prints its port on the first line of stdout, then serves until
its stdin closes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
import zmq

from odmoe.models.expert_math import KERNELS, expert_forward
from odmoe.models.open_model import open_checkpoint
from odmoe.transport.messages import ComputeExperts, ExpertsResult, from_frames, to_frames


def busy(seconds: float) -> None:
    """Keep this core busy (as a computing node does), not asleep, for `seconds`."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


class Expert:
    """A layer's experts from the checkpoint, computed in turn on the received row by the workers'
    own `expert_forward`: a worker's compute with none of its message handling around it."""

    def __init__(self, model: str, layer: int, kernel: str):
        ckpt = open_checkpoint(model)
        self.weights = [ckpt.expert(layer, e) for e in range(ckpt.num_experts)]
        self.act, self.kernel = ckpt.config.hidden_act, kernel
        self.dtype, self.hidden = self.weights[0].down.dtype, self.weights[0].down.shape[0]
        self.calls, self.compute_s = 0, []

    def __call__(self, frame) -> torch.Tensor:
        start = time.perf_counter()
        x = torch.frombuffer(frame.buffer, dtype=self.dtype).view(-1, self.hidden)
        w = self.weights[self.calls % len(self.weights)]
        with torch.inference_mode():
            y = expert_forward(x, w.gate_up, w.down, self.act, self.kernel)
        self.calls += 1
        self.compute_s.append(time.perf_counter() - start)
        return y


def serve(sock: zmq.Socket, mode: str, spin_s: float = 0.0, expert: Expert | None = None) -> None:
    while True:
        peer, *frames = sock.recv_multipart(copy=False)
        if mode == "raw" and expert is not None:
            y = expert(frames[-1])
            sock.send_multipart([peer, *frames[:-1], memoryview(y.numpy()).cast("B")], copy=False)
            continue
        if mode == "raw":
            busy(spin_s)
            sock.send_multipart([peer, *frames], copy=False)
            continue
        message, tensors = from_frames(frames)
        assert isinstance(message, ComputeExperts)
        n = len(message.experts)
        result = ExpertsResult(
            message.step, 0, message.experts, [0.0] * n, [0.0] * n, [0] * n, [False] * n, [0.0] * n, 0
        )
        sock.send_multipart([peer, *to_frames(result, tensors)], copy=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["raw", "codec"], required=True)
    parser.add_argument("--curve", action="store_true", help="read a CURVE secret key from stdin")
    parser.add_argument("--spin-us", type=float, default=0.0, help="raw: stay busy this long before echoing")
    parser.add_argument("--model", default="", help="raw: compute the experts of this checkpoint")
    parser.add_argument("--layer", type=int, default=0, help="with --model: whose experts")
    parser.add_argument("--kernel", default="grouped_mm", choices=KERNELS, help="with --model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as every cluster node has
    expert = None
    if args.model:
        expert = Expert(args.model, args.layer, args.kernel)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if args.curve:
        sock.curve_server = True
        sock.curve_secretkey = sys.stdin.readline().strip().encode()
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    threading.Thread(target=serve, args=(sock, args.mode, args.spin_us / 1e6, expert), daemon=True).start()
    sys.stdin.read()  # the suite closes our stdin (or dies): then we go
    if expert is not None and expert.compute_s:
        print(f"{statistics.median(list(expert.compute_s)) * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    main()
