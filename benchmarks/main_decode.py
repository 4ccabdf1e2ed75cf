"""Main's own CPU per generated token, batched decode against one forward pass per request.

    python -m odmoe_bench.main_decode [--model trained] [--users 1,2,4,8] [--rounds 3] [--device cuda]

The engine with in-process workers (`odmoe.main.inprocess`: main's real decode loop, RemoteExperts,
codec and expert math, no sockets), so what is timed is one process's work and a busy neighbour on
this shared box moves both modes alike. `users` requests of 32-token prompts (greedy and seeded,
alternating) are submitted at once and each generates 40 tokens; the time the in-process workers
spend computing experts is taken out (it belongs to the workers), what remains is main: its
forward passes, exchanges' encoding and combining, token choice and streaming into the tickets.
The two modes (`server.decode=batched` / `per_request`) alternate over `rounds` rounds and each
figure is the median. Every request's tokens are checked equal between the two modes.
With `--device cuda` main computes on the GPU (the workers stay on the CPU) and the clock is the wall
clock, not the thread's CPU time: a GPU's work is not the thread's, and every token's choice waits for
it, so wall time less the workers' is main's time per token there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from odmoe.models.open_model import load_tokenizer


def _measure(engine, workers, requests, clock=time.thread_time) -> tuple[float, dict[str, list[int]]]:
    from odmoe.main.engine import TokenEvent
    from odmoe.main.request_queue import END, RequestQueue

    spent = [0.0]
    send = workers.send

    def timed_send(worker, frames, copy=True):
        start = clock()
        try:
            return send(worker, frames, copy)
        finally:
            spent[0] += clock() - start

    workers.send = timed_send
    queue = RequestQueue(1024, 1e9)
    tickets = {r.request_id: queue.submit(r) for r in requests}

    def stopped() -> bool:
        return all(t.events.queue and t.events.queue[-1] is END for t in tickets.values())

    start = clock()
    engine.serve(queue, stopped)
    main = clock() - start - spent[0]
    workers.send = send
    tokens = {
        rid: [e.token_id for e in t.events.queue if isinstance(e, TokenEvent)] for rid, t in tickets.items()
    }
    return main * 1000 / sum(len(v) for v in tokens.values()), tokens


def main() -> None:

    from odmoe.main.engine import GenerateRequest
    from odmoe.main.inprocess import engine_in_process
    from odmoe.main.sampling import SamplingParams
    from odmoe.tools.model_names import resolve_model
    from odmoe_bench.workload import prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="trained")
    parser.add_argument("--users", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="main's device (cuda: wall clock, see above)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    clock = time.thread_time if args.device == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)  # as a node runs (one torch thread per process on this box)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    users = [int(u) for u in args.users.split(",")]
    engines = {
        mode: engine_in_process(
            path, dtype, device=args.device, max_running=max(users), batched_decode=mode == "batched"
        )
        for mode in ("batched", "per_request")
    }
    assert engines["batched"][0].batched is not None, "batched decode does not serve this model's family"

    def requests(n: int, round_: int) -> list:
        seeded = SamplingParams(do_sample=True, temperature=0.8, seed=11)
        return [
            GenerateRequest(
                token_ids=tuple(prompt_ids(tok, i, 32)),
                max_new_tokens=args.tokens,
                sampling=seeded if i % 2 else SamplingParams(),
                request_id=f"u{n}-r{round_}-{i}",
                ignore_eos=True,
            )
            for i in range(n)
        ]

    for engine, workers in engines.values():  # warm-up: first calls allocate and probe shapes
        _measure(engine, workers, requests(max(users), -1), clock)
    what = "CPU" if args.device == "cpu" else f"{args.device} wall"
    print(
        f"main's {what} ms per generated token ({path.rsplit('/', 1)[-1]}, {args.dtype}, "
        f"medians of {args.rounds} rounds)"
    )
    print(f"{'users':>5} {'batched':>9} {'per_request':>12} {'ratio':>7}  tokens equal")
    for n in users:
        figures: dict[str, list[float]] = {"batched": [], "per_request": []}
        equal = True
        for r in range(args.rounds):
            got = {}
            for mode, (engine, workers) in engines.items():
                ms, tokens = _measure(engine, workers, requests(n, r), clock)
                figures[mode].append(ms)
                got[mode] = list(tokens.values())
            equal &= got["batched"] == got["per_request"]
        b, p = statistics.median(figures["batched"]), statistics.median(figures["per_request"])
        print(f"{n:>5} {b:>9.2f} {p:>12.2f} {b / p:>7.2f}  {equal}")


if __name__ == "__main__":
    main()
