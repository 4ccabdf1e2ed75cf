"""OpenAI's logprobs shapes, built from odmoe's token events (pure: a tokenizer and numbers in).

Contract: the HTTP front door collects, per choice, `Scored(token_id, logprob, top)` entries (the
prompt's from a `PromptEvent`, the new tokens' from `TokenEvent`s) and turns them into
- `completion_logprobs(...)`: `/v1/completions`' `{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`: the prompt's first token has `null` logprob and top (nothing predicts it), as in
  OpenAI's API; `top_logprobs` maps token text to logprob, the chosen token included (as vLLM does)
  so that `token_logprobs[i] == max(top_logprobs[i].values())` exactly when it was the most likely;
- `chat_content(...)`: `/v1/chat/completions`' `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}`.
A token's text is `decode([token])` (a token that ends inside a UTF-8 character reads U+FFFD, its
`bytes` those of that text); `text_offset` is where the token's text begins in the decoded text
of everything before it (`len(decode(tokens[:i]))`). The values are float32 log-probabilities of
the model's distribution before any sampling processor (temperature, top-p ...), as vLLM returns
by default (OpenAI's documentation does not say whether its own apply temperature); odmoe's equal
transformers' own to the bit (odmoe/main/request_run.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scored:
    token_id: int
    logprob: float | None  # None: the prompt's first token
    top: tuple[tuple[int, float], ...] = ()


class TokenTexts:
    """The decoded text of single tokens and of token prefixes (cached per token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._one = tokenizer, {}

    def one(self, token: int) -> str:
        text = self._one.get(token)
        if text is None:
            text = self._one[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def offsets(self, tokens: list[int], start: int = 0) -> list[int]:
        """Where each token's text begins in decode(tokens), counted from `start`."""
        out = []
        for i in range(len(tokens)):
            prefix = self.tokenizer.decode(tokens[:i], skip_special_tokens=True) if i else ""
            out.append(start + len(prefix.rstrip("\ufffd")))
        return out


def completion_logprobs(texts: TokenTexts, entries: list[Scored], offset_start: int = 0) -> dict:
    tokens = [e.token_id for e in entries]
    top_logprobs: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:
            top_logprobs.append(None)
            continue
        top = {texts.one(t): lp for t, lp in e.top}
        top.setdefault(texts.one(e.token_id), e.logprob)
        top_logprobs.append(top)
    return {
        "tokens": [texts.one(t) for t in tokens],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": texts.offsets(tokens, offset_start),
    }


def chat_content(texts: TokenTexts, entries: list[Scored]) -> dict:
    def item(token: int, logprob: float | None) -> dict:
        text = texts.one(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }
