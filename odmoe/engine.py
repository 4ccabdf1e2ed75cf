"""The decode loop of the main node: prompt -> tokens, one request at a time.

Contract: `MainEngine.generate(request)` yields `TokenEvent`s as tokens are chosen and ends with one
`DoneEvent` carrying the request's stats. It knows nothing about gRPC; experts are computed wherever
the `RemoteExperts` attached to the model sends them. Same inputs as `transformers`' `generate()`
(DynamicCache, attention mask of ones, `logits_to_keep=1`, stop at EOS or `max_new_tokens`) and the
same choice of each token (`odmoe/sampling.py`: greedy by default, or seeded sampling), so the tokens
equal a single-process `generate()` with the same parameters. Stop strings (`odmoe/stop_strings.py`)
end a request early; the text streamed never shows one, nor any part of one still undecided.

Resuming (`resume_ids`: the tokens a client already received from a main that was lost): they are
replayed one decode iteration each, exactly as they were first computed, and not streamed again;
a one-shot prefill of prompt + resumed tokens would differ from the reference in the last bits.
Whatever way a request ends (done, failed, cancelled by closing the generator), the shadow and the
workers are told, so nothing stays loaded or running for it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase

from odmoe.alignment import AlignmentPlan, AlignmentSchedule
from odmoe.device_slots import device_peak_bytes
from odmoe.kv_rows import newest_rows
from odmoe.main_model import MainModel
from odmoe.memory import peak_rss_bytes
from odmoe.remote_experts import RemoteExperts
from odmoe.sampling import InvalidSampling, SamplingParams, TokenChooser
from odmoe.stop_strings import MAX_STOPS, StopStrings
from odmoe.trace import now_us

log = logging.getLogger("odmoe.main")


class InvalidRequest(ValueError):
    """The request itself is wrong (empty prompt, too many tokens...): the client's to fix."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str = ""
    token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 32
    return_logits: bool = False  # send the last position's logits back (fidelity checks)
    resume_ids: tuple[int, ...] = ()  # new tokens already sent by a main that was lost: replayed
    sampling: SamplingParams = SamplingParams()  # greedy unless do_sample
    stop: tuple[str, ...] = ()  # stop strings: the request ends where one appears, which is not shown
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the new text this token completes (may be "" mid-way through a UTF-8 character)


@dataclass(frozen=True)
class DoneEvent:
    stats: dict  # stats["finish_reason"]: "stop" (EOS or a stop string) or "length" (max_new_tokens)
    final_logits: torch.Tensor | None = None  # [vocab] fp32, when the request asked for it


class MainEngine:
    def __init__(
        self,
        main: MainModel,
        tokenizer: PreTrainedTokenizerBase,
        experts: RemoteExperts,
        make_plan: Callable[[], AlignmentPlan] | None = None,
        pace_shadow: bool = False,
    ):
        self.main, self.tokenizer, self.experts = main, tokenizer, experts
        self.make_plan = make_plan or (lambda: AlignmentPlan(AlignmentSchedule()))
        self.plan = self.make_plan()  # per request: a tuned plan learns within one request
        self.pace_shadow = pace_shadow  # send an Align every iteration even when nothing is aligned
        main.attach(experts)
        config = main.model.config
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        eos = main.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.token_ids and request.prompt:
            raise InvalidRequest("give either a prompt or token_ids, not both")
        ids = list(request.token_ids) if request.token_ids else self.tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.main.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise InvalidRequest(f"token ids must lie in [0, {vocab})")
        if request.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
        resume = request.resume_ids
        if len(resume) > request.max_new_tokens:
            raise InvalidRequest(
                f"{len(resume)} resumed tokens exceed max_new_tokens={request.max_new_tokens}"
            )
        try:
            request.sampling.validate()
        except InvalidSampling as exc:
            raise InvalidRequest(str(exc)) from None
        if len(request.stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in request.stop):
            raise InvalidRequest(f"stop takes at most {MAX_STOPS} non-empty strings")
        if any(not 0 <= i < vocab for i in resume):
            raise InvalidRequest(f"resume_ids must lie in [0, {vocab})")
        if set(resume[:-1]) & self.eos_ids:
            raise InvalidRequest("resume_ids continue past an end-of-sequence token")
        if self.max_positions and len(ids) + request.max_new_tokens > self.max_positions:
            raise InvalidRequest(
                f"{len(ids)} prompt tokens + max_new_tokens={request.max_new_tokens} exceed the model's "
                f"context of {self.max_positions} positions"
            )
        return ids

    @property
    def shadow(self):
        return self.experts.shadow

    @torch.inference_mode()
    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent | DoneEvent]:
        start, start_us = time.perf_counter(), now_us()
        # 1) tokens in: exactly tokenizer(prompt) (a chat template is the front door's business).
        device = self.main.device  # tokens are chosen on the host (odmoe.sampling), computed here
        ids = torch.tensor([self.prompt_ids(request)])
        chooser = TokenChooser(self.main.model, request.sampling, ids[0].tolist())
        stops, finish_reason = StopStrings(request.stop), "length"
        prompt_len, resumed = ids.shape[1], list(request.resume_ids)
        if len(resumed) == request.max_new_tokens or set(resumed[-1:]) & self.eos_ids:
            # the lost main had streamed every token and died before its final reply
            stats = {
                "request_id": request.request_id,
                "new_tokens": 0,
                "resumed_tokens": len(resumed),
                "finish_reason": "length" if len(resumed) == request.max_new_tokens else "stop",
            }
            yield DoneEvent(stats)
            return
        model, cache = self.main.model, DynamicCache(config=self.main.model.config)
        self.experts.traffic = type(self.experts.traffic)()
        new_ids: list[int] = []
        text = _Detokenizer(self.tokenizer)
        step_input, first_token_at = ids, 0.0
        self.plan = self.make_plan()
        if self.shadow is not None:
            self.shadow.begin(request.request_id, ids[0].tolist(), request.max_new_tokens)
        try:
            # 2) prefill (iteration 0) then 3) one decode iteration per new token; the first
            #    len(resumed) tokens are replayed as they were chosen before, not streamed again.
            for iteration in range(request.max_new_tokens):
                self.experts.begin(request.request_id, iteration)
                mask = torch.ones(1, prompt_len + len(new_ids), dtype=torch.long, device=device)
                logits = (
                    model(
                        input_ids=step_input.to(device),
                        attention_mask=mask,
                        past_key_values=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    .logits[:, -1, :]
                    .float()
                    .cpu()
                )
                token = chooser.choose(logits)
                replayed = iteration < len(resumed)
                if replayed:
                    if token != resumed[iteration]:
                        log.warning(
                            "request %s: resumed token %d is %d, this main would pick %d (is it the same "
                            "model and dtype as the main that was lost?)",
                            request.request_id,
                            iteration,
                            resumed[iteration],
                            token,
                        )
                    token = resumed[iteration]
                    chooser.replace_last(token)
                new_ids.append(token)
                if not replayed and not first_token_at:
                    first_token_at = time.perf_counter()
                piece, stopped = stops.feed(text.add(token))
                finished = stopped or token in self.eos_ids or iteration + 1 == request.max_new_tokens
                if stopped or token in self.eos_ids:
                    finish_reason = "stop"
                if not finished:
                    self._align_shadow(iteration + 1, token, cache, rows=step_input.shape[1])
                else:
                    piece += stops.flush()  # held back for a stop string that never came
                if not replayed:
                    yield TokenEvent(token, piece)
                if finished:
                    break
                step_input = torch.tensor([[token]])
        finally:  # also when the client went away and the generator is closed mid-way
            if self.shadow is not None:
                self.shadow.end()
            self.experts.end_request()
        end = time.perf_counter()
        self.experts.tracer.flush()
        stats = self._stats(request, prompt_len, new_ids, start, first_token_at, end)
        stats["resumed_tokens"] = len(resumed)
        stats["finish_reason"] = finish_reason
        stats["seed"] = chooser.seed if chooser.sampling else None
        stats["failover"] = self._failover_stats(start_us)
        stats["alignment"] = self.plan.report()
        yield DoneEvent(stats, logits[0].clone() if request.return_logits else None)

    def _failover_stats(self, since_us: float) -> dict:
        events = [e for e in self.experts.members.events if e.at_us >= since_us]
        return {
            "live_workers": sorted(self.experts.members.live),
            "resent_calls": self.experts.traffic.resent,
            "events": [
                {"worker": e.worker, "event": e.event, "at_us": e.at_us, "reason": e.reason} for e in events
            ],
        }

    def _align_shadow(self, iteration: int, token: int, cache: DynamicCache, rows: int) -> None:
        """Before decode iteration n: main's input token for it and the K/V rows main computed in n-1,
        where the plan says; with the next iteration it will align, so a waiting shadow knows."""
        if self.shadow is None:
            return
        wrong, predicted = self.experts.traffic.timely_recall.arrived.get(iteration - 1, (0, 0))
        self.plan.observe(iteration - 1, wrong, predicted)
        send_token, send_kv = self.plan.aligns(iteration)
        if not (send_token or send_kv or self.pace_shadow):
            return
        keys = values = None
        if send_kv:
            keys, values = newest_rows(cache, rows)  # [L, heads, rows, D]
        self.plan.sent(iteration, send_token, send_kv)
        next_align = self.plan.next_after(iteration)
        self.shadow.align(iteration, token if send_token else -1, keys, values, next_align)

    def _stats(self, request, prompt_len, new_ids, start, first_token_at, end) -> dict:
        traffic = self.experts.traffic
        new_ids = new_ids[len(request.resume_ids) :]  # what this main streamed
        decode_tokens = len(new_ids) - 1
        decode_s = end - first_token_at
        return {
            "request_id": request.request_id,
            "prompt_tokens": prompt_len,
            "new_tokens": len(new_ids),
            "ttft_s": first_token_at - start,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
            "total_s": end - start,
            "experts_loaded": traffic.experts_loaded,
            "bytes_loaded": traffic.bytes_loaded,
            "worker_load_s": traffic.load_s,
            "worker_compute_s": traffic.compute_s,
            "main_wait_on_workers_s": traffic.wait_s,
            "peak_rss_bytes": {
                "main": peak_rss_bytes(),
                **{f"worker{w}": b for w, b in sorted(traffic.worker_peak_rss.items())},
            },
            # the paper's GPU memory: main's weights (KV cache aside), each worker's expert slots
            "device_bytes": {
                "main": self.main.device_bytes,
                **{f"worker{w}": b for w, b in sorted(self.experts.device_bytes.items())},
            },
            # CUDA's own counter (max_memory_allocated) per node process; 0 for a node on a CPU
            "device_peak_bytes": {
                "main": device_peak_bytes(self.main.device),
                "shadow": self.shadow.seen.device_peak_bytes if self.shadow is not None else 0,
                **{f"worker{w}": b for w, b in sorted(traffic.worker_device_peak.items())},
            },
            "decode": {**traffic.decode, "seconds": decode_s, "tokens": decode_tokens},
            "emulated_link": {
                f"worker{w}": {"bandwidth_gbps": bw, "latency_ms": ms}
                for w, (bw, ms) in self.experts.emulated_links.items()
            }
            or None,
            "prefill": self._prefill_stats(first_token_at - start),
            "recall": self.experts.recall().report(),
            "timely_recall": traffic.timely_recall.report(),
            "per_worker": {f"worker{w}": row for w, row in sorted(traffic.per_worker.items())},
            "preloaded": traffic.preloaded,
            "reloads": traffic.reloads,
            "stall_s": sum(traffic.stall_s_per_layer.values()),
            "stall_s_per_layer": dict(sorted(traffic.stall_s_per_layer.items())),
            # a lossy miss policy computed a resident expert in place of a missed one: not the model's output
            "exact": not traffic.substitutions_per_layer,
            "substitutions": sum(traffic.substitutions_per_layer.values()),
            "substitutions_per_layer": dict(sorted(traffic.substitutions_per_layer.items())),
            "substituted": [list(s) for s in traffic.substituted],  # [iteration, layer, missing, computed]
            "hedging": self._hedging_stats(),
            **self._shadow_stats(),
        }

    def _hedging_stats(self) -> dict:
        """Hedged prefetch: what the hedges cost (bytes loaded) against what they saved (hits).
        Counted by the workers as of their last answer in this request, so a hedge loaded after a
        worker's last answer is missing (at most one layer's)."""
        t = self.experts.traffic
        loads, used, nbytes = (sum(row[i] for row in t.hedging.values()) for i in range(3))
        timely = t.timely_recall.report()
        activated, hits = timely["activated"], (timely["overall"] or 0.0) * timely["activated"]
        return {
            "hedge_loads": loads,
            "hedges_used": used,
            "hedge_bytes": nbytes,
            "hedge_bytes_fraction": nbytes / t.bytes_loaded if t.bytes_loaded else 0.0,
            "hedge_hits": t.hedge_hits,
            "timely_recall_with_hedges": (hits + t.hedge_hits) / activated if activated else None,
        }

    def _prefill_stats(self, ttft: float) -> dict:
        """TTFT split: main's own work, and the time it waited on workers split into the busiest
        worker's loading + computing (the critical path) and the rest (transfer and queueing)."""
        p = self.experts.traffic.prefill
        per_layer = p["experts_per_layer"]
        return {
            "main_s": ttft - p["wait_s"],
            "wait_on_workers_s": p["wait_s"],
            "critical_load_compute_s": p["critical_s"],
            "transfer_s": max(p["wait_s"] - p["critical_s"], 0.0),
            "load_s": p["load_s"],
            "compute_s": p["compute_s"],
            "experts_per_layer": per_layer,
            "experts_per_layer_mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0,
        }

    def _shadow_stats(self) -> dict:
        if self.shadow is not None and self.shadow.lost_at_us:
            lost = {"shadow_lost_at_us": self.shadow.lost_at_us}
        else:
            lost = {}
        if self.shadow is None or not self.shadow.active:
            return {"shadow": False, **lost}
        seen = self.shadow.seen
        ahead, late, forward = seen.lookahead_layers, seen.late_departure_s, seen.forward_s
        idle, layers = seen.alignment_wait_s, max(len(self.shadow.order), 1)
        return {
            "shadow": True,
            "shadow_forward_s_mean": sum(forward.values()) / len(forward) if forward else None,
            "shadow_alignment_wait_s_mean": sum(idle.values()) / len(idle) if idle else None,
            "lookahead_layers_mean": sum(ahead) / len(ahead) if ahead else None,
            # the same lookahead in decode iterations (MoE layers per iteration)
            "lookahead_iterations_mean": sum(ahead) / len(ahead) / layers if ahead else None,
            # speculative: iterations ahead of main's newest report when it started one; rollbacks
            "shadow_ahead_mean": sum(seen.ahead.values()) / len(seen.ahead) if seen.ahead else None,
            "shadow_rollbacks": seen.rollbacks,
            "late_departure_s": sum(late.values()),
            "late_departure_s_mean": sum(late.values()) / len(late) if late else None,
            **lost,
        }


class _Detokenizer:
    """Streams text: each token yields the text it completes, holding back half a UTF-8 character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        piece, self.emitted = full[len(self.emitted) :], full
        return piece
