"""One request on main, from admission to its last event: what the decode loop keeps per request.

Contract: a `RequestRun` holds a request's prompt, tokens so far, K/V cache (`DynamicCache`), token
chooser (greedy or seeded sampling, `odmoe.main.sampling`), stop strings and streamed text, with the
engine's decisions for it (`RunSchedule`) and its timing (`RunClock`) beside. The engine
calls `forward()` once per iteration (inside a lockstep task: it may park at every MoE layer) and
`accept(logits)` with what it returned; `accept` chooses the token exactly as `generate()` would,
streams it (a `TokenEvent` to the run's sink) unless it is a replayed one, and says whether the
request is over. The inputs of every forward pass are the ones transformers' `generate()` uses
(attention mask of ones, `logits_to_keep=1`, the cache), so a run's tokens are those of the same
request alone, whatever else runs beside it: its cache, chooser and inputs are its own.

Resuming (`resume_ids`: the tokens a client already received from a main that was lost): they are
replayed one decode iteration each, exactly as they were first computed, and not streamed again;
a one-shot prefill of prompt + resumed tokens would differ from the reference in the last bits.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase

from odmoe.main.alignment import AlignmentPlan, AlignmentSchedule
from odmoe.main.batched_decode import DecodeInput
from odmoe.main.remote_experts import RunContext
from odmoe.main.sampling import SamplingParams, TokenChooser
from odmoe.main.shadow_link import ShadowLink
from odmoe.main.stop_strings import StopStrings
from odmoe.main.tick_plan import Admission
from odmoe.models.cache_argument import with_cache
from odmoe.models.kv_rows import newest_rows
from odmoe.models.main_model import MainModel
from odmoe.tools.trace import now_us

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
    # Requests of one prompt that may share its prefill (the OpenAI API's `n` choices): admitted
    # together, the first computes the prompt's K/V cache and logits once and the others copy them
    # (the same bits: a prefill is deterministic), then each samples with its own seed.
    prefill_group: str = ""
    ignore_eos: bool = False  # go on past an end-of-sequence token until max_new_tokens (vLLM's option)
    # log-probabilities (odmoe.logprobs): each new token's and the `logprobs` best at its position
    # (None: off; 0: the chosen token's only); `prompt_logprobs`: every prompt token's too, from a
    # scoring pass over the prompt (max_new_tokens may then be 0: the prompt is only scored)
    logprobs: int | None = None
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the new text this token completes (may be "" mid-way through a UTF-8 character)
    logprob: float | None = None  # with logprobs: this token's (a float32 value)
    top: tuple[tuple[int, float], ...] = ()  # with logprobs > 0: (token, logprob), best first


@dataclass(frozen=True)
class PromptEvent:
    """With prompt_logprobs, before any token: each prompt token's log-probability given the ones
    before it (None for the first) and the best `logprobs` tokens at its position."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class DoneEvent:
    stats: dict  # stats["finish_reason"]: "stop" (EOS or a stop string) or "length" (max_new_tokens)
    final_logits: torch.Tensor | None = None  # [vocab] fp32, when the request asked for it


Sink = Callable[[object], None]  # where a run's events go (a ticket's queue)


@dataclass
class RunSchedule:
    """The engine's decisions for a run and its way through the current tick: its admission
    (`odmoe.main.tick_plan.admit`), the MoE layers its prefill exchanged this tick, whose prefill it
    copies (`prefill_group`), the shadow predicting for it (None: none, or no use) and the plan of
    when to align it (its report is in the stats, shadow or not)."""

    admission: Admission = Admission()
    prefill_layers: int = 0
    leader: RequestRun | None = None
    shadow: ShadowLink | None = None
    plan: AlignmentPlan = field(default_factory=lambda: AlignmentPlan(AlignmentSchedule()))


@dataclass
class RunClock:
    """Its stats' timing: when it began (perf_counter, and the trace's microseconds), when its first
    token came (0: not yet), how many requests decoded beside it each decode iteration (itself too)."""

    start: float = field(default_factory=time.perf_counter)
    start_us: int = field(default_factory=now_us)
    first_token_at: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class RequestRun:
    def __init__(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        main: MainModel,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
        ctx: RunContext,
        sink: Sink,
        schedule: RunSchedule | None = None,
    ):
        self.request, self.main, self.eos_ids, self.ctx = request, main, eos_ids, ctx
        self.sink = sink
        self.schedule = schedule or RunSchedule()
        self.clock = RunClock()
        self.prompt_len = len(prompt_ids)
        self.chooser = TokenChooser(main.model, request.sampling, prompt_ids)
        self.stops, self.text = StopStrings(request.stop), _Detokenizer(tokenizer)
        self.cache = DynamicCache(config=main.model.config)
        self.step_input = torch.tensor([prompt_ids])
        self.resumed = list(request.resume_ids)
        self.new_ids: list[int] = []
        self.iteration = 0  # 0: prefill; n: the n-th decode iteration
        self.finish_reason = "length"
        self.logits: torch.Tensor | None = None
        self.scored = not request.prompt_logprobs  # the prompt's scoring pass is done (or not asked)
        self.done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def decoding(self) -> bool:
        return self.iteration >= 1

    def already_over(self) -> bool:
        """The lost main had streamed every token and died before its final reply."""
        resumed = self.resumed
        eos = bool(set(resumed[-1:]) & self.eos_ids) and not self.request.ignore_eos
        return self.request.max_new_tokens > 0 and (len(resumed) == self.request.max_new_tokens or eos)

    def forward(self) -> torch.Tensor | None:
        """This iteration's forward pass (prefill, or one token): the last position's logits [1, V];
        None when the request only scores its prompt (max_new_tokens=0)."""
        if not self.scored:  # iteration 0, before the prefill: the prompt's own pass
            self.scored = True
            self.sink(self._score_prompt())
            if self.request.max_new_tokens == 0:
                return None
        device = self.main.device  # tokens are chosen on the host (odmoe.main.sampling), computed here
        mask = torch.ones(1, self.prompt_len + len(self.new_ids), dtype=torch.long, device=device)
        out = self.main.model(
            input_ids=self.step_input.to(device),
            attention_mask=mask,
            **with_cache(self.main.model, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float().cpu()

    def decode_input(self) -> DecodeInput:
        """What a batched decode pass needs of it (odmoe.main.batched_decode): the same token, cache
        and attention-mask length `forward()` gives transformers."""
        return DecodeInput(self.step_input, self.cache, self.prompt_len + len(self.new_ids))

    def _score_prompt(self) -> PromptEvent:
        """The prompt tokens' log-probabilities: one forward pass over the prompt but its last token,
        every position's logits (what evaluation harnesses compute in one process: each prompt token
        is predicted by the positions before it). Its experts' calls are named iteration -1."""
        ids = self.step_input  # [1, T]
        if ids.shape[1] < 2:
            return PromptEvent(tuple(ids[0].tolist()), (None,), ((),))
        self.ctx.iteration = -1
        try:
            device = self.main.device
            out = self.main.model(
                input_ids=ids[:, :-1].to(device),
                attention_mask=torch.ones(1, ids.shape[1] - 1, dtype=torch.long, device=device),
                use_cache=False,
                logits_to_keep=0,
            )
        finally:
            self.ctx.iteration = 0
        scored = token_logprobs(out.logits[0].float().cpu(), ids[0, 1:], self.request.logprobs or 0)
        return PromptEvent(
            tuple(ids[0].tolist()), (None, *(lp for lp, _ in scored)), ((), *(top for _, top in scored))
        )

    def accept(self, logits: torch.Tensor | None) -> bool:
        """Choose this iteration's token, stream it (unless replayed); True when the request is over."""
        if logits is None:  # the prompt was only scored
            self.done = True
            return True
        self.logits = logits
        token = self.chooser.choose(logits)
        iteration = self.iteration
        replayed = iteration < len(self.resumed)
        if replayed:
            if token != self.resumed[iteration]:
                log.warning(
                    "request %s: resumed token %d is %d, this main would pick %d (is it the same "
                    "model and dtype as the main that was lost?)",
                    self.request_id,
                    iteration,
                    self.resumed[iteration],
                    token,
                )
            token = self.resumed[iteration]
            self.chooser.replace_last(token)
        self.new_ids.append(token)
        if not replayed and not self.clock.first_token_at:
            self.clock.first_token_at = time.perf_counter()
        piece, stopped = self.stops.feed(self.text.add(token))
        eos = token in self.eos_ids and not self.request.ignore_eos
        finished = stopped or eos or iteration + 1 == self.request.max_new_tokens
        if stopped or eos:
            self.finish_reason = "stop"
        if finished:  # held back for a stop string that never came, or half a UTF-8 character
            more, _ = self.stops.feed(self.text.flush())
            piece += more + self.stops.flush()
        if not replayed:
            if self.request.logprobs is None:
                self.sink(TokenEvent(token, piece))
            else:
                ((logprob, top),) = token_logprobs(logits, torch.tensor([token]), self.request.logprobs)
                self.sink(TokenEvent(token, piece, logprob, top))
        self.step_input = torch.tensor([[token]])
        self.done = finished
        return finished

    @property
    def rows_last_iteration(self) -> int:
        """K/V rows the last forward pass added (the prompt's, after prefill)."""
        return self.prompt_len if self.iteration == 0 else 1

    def next_iteration(self) -> None:
        self.iteration += 1
        self.schedule.prefill_layers = 0

    def align_shadow(self, pace: bool) -> None:
        """Before decode iteration n: main's input token for it and the K/V rows main computed in n-1,
        where the plan says (`pace`: an Align every iteration, aligned or not); with the next
        iteration it will align, so a waiting shadow knows."""
        shadow, plan = self.schedule.shadow, self.schedule.plan
        if shadow is None:
            return
        iteration = self.iteration + 1
        if shadow.resumable(self.request_id):  # reachable again after it was lost: from here on
            shadow.resume(self.request_id, iteration, self.new_ids[: iteration - 1])
        wrong, predicted = self.ctx.traffic.wrong_predictions(iteration - 1)
        plan.observe(iteration - 1, wrong, predicted)
        send_token, send_kv = plan.aligns(iteration)
        if not (send_token or send_kv or pace):
            return
        keys = values = None
        if send_kv:
            keys, values = newest_rows(self.cache, self.rows_last_iteration)  # [L, heads, rows, D]
        plan.sent(iteration, send_token, send_kv)
        token = self.new_ids[-1]
        next_align = plan.next_after(iteration)
        shadow.align(self.request_id, iteration, token if send_token else -1, keys, values, next_align)

    @property
    def streamed(self) -> list[int]:
        """What this main streamed (resumed tokens excepted)."""
        return self.new_ids[len(self.resumed) :]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row of `logits` [n, V] (float32): log_softmax's value at `tokens[i]` and the `top` best
    (token, logprob), best first. The model's distribution, before any sampling processor: what
    OpenAI's and vLLM's logprobs report too."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).flatten().tolist()
    if top <= 0:
        return [(c, ()) for c in chosen]
    values, index = lp.topk(top, dim=-1)
    return [
        (c, tuple(zip(i, v, strict=True)))
        for c, i, v in zip(chosen, index.tolist(), values.tolist(), strict=True)
    ]


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

    def flush(self) -> str:
        """At the end: what was held back, as `decode()` gives it (an unfinished character as U+FFFD),
        so the streamed pieces add up to the decoded text of every token."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.emitted = full[len(self.emitted) :], full
        return piece
