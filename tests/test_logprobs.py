"""Log-probabilities through real clusters, equal to transformers' own to the bit.

References: `log_softmax` of transformers' logits in this process, on the nodes' thread count
(tests/test_cluster_fidelity.py: node_threads): a generated token's from `generate(output_logits=
True)`, a prompt token's from one forward pass over the prompt but its last token (what evaluation
harnesses compute: lm-evaluation-harness's `hf` backend). Values are float32, compared exactly.
"""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe import LocalCluster
from odmoe.main.engine import DoneEvent, GenerateRequest, PromptEvent, TokenEvent
from odmoe.main.inprocess import engine_in_process
from odmoe.main.sampling import SamplingParams
from tests.conftest import FAMILY_NAMES, FOCUSED_FAMILIES
from tests.test_cluster_fidelity import node_threads

pytestmark = pytest.mark.integration
PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os\n\nclass Config:\n    ", "x = ["]


@functools.cache
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def prompt_reference(path: str, ids: list[int], top: int):
    """Each prompt token's logprob (None for the first) and the `top` best at its position."""
    model, _ = _hf(path)
    with node_threads(), torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    chosen = [None, *(float(lp[i, t]) for i, t in enumerate(ids[1:]))]
    best = [(), *(_top(row, top) for row in lp)]
    return chosen, best


def generated_reference(path: str, ids: list[int], new_tokens: int, top: int, **sampling):
    model, _ = _hf(path)
    x = torch.tensor([ids])
    with node_threads(), torch.inference_mode():
        if "seed" in sampling:
            torch.manual_seed(sampling.pop("seed"))
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )
    tokens = out.sequences[0, x.shape[1] :].tolist()
    lps = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, [float(lp[t]) for lp, t in zip(lps, tokens, strict=True)], [_top(lp, top) for lp in lps]


def _top(row: torch.Tensor, k: int) -> tuple:
    if k <= 0:
        return ()
    values, index = row.topk(k)
    return tuple(zip(index.tolist(), values.tolist(), strict=True))


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(model_dirs["mixtral"], workers=2, group_size=2) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster):
    tls = httpx.Client(verify=cluster.http_auth["verify"])
    return openai.OpenAI(
        base_url=cluster.http_url + "/v1", api_key=cluster.token, max_retries=0, http_client=tls
    )


def _ids(path: str, prompt: str) -> list[int]:
    return _hf(path)[1](prompt)["input_ids"]


# -- gRPC / odmoe.Client ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling", [{}, {"do_sample": True, "temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"]
)
def test_sdk_logprobs_of_prompt_and_new_tokens_equal_transformers(cluster, sampling):
    path = cluster.model_path
    for prompt in PROMPTS:
        ids = _ids(path, prompt)
        got = cluster.client.generate(ids, max_new_tokens=8, logprobs=3, prompt_logprobs=True, **sampling)
        tokens, chosen, best = generated_reference(path, ids, 8, 3, **sampling)
        assert got.token_ids == tokens and got.logprobs == chosen and got.top_logprobs == best
        want, want_top = prompt_reference(path, ids, 3)
        assert got.prompt_logprobs == want and got.prompt_top_logprobs == want_top


def test_scoring_a_prompt_alone_generates_nothing(cluster):
    ids = _ids(cluster.model_path, PROMPTS[0])
    got = cluster.client.generate(ids, max_new_tokens=0, logprobs=0, prompt_logprobs=True)
    assert got.token_ids == [] and got.stats["new_tokens"] == 0
    assert got.prompt_logprobs == prompt_reference(cluster.model_path, ids, 0)[0]


# -- HTTP: the OpenAI shapes -------------------------------------------------------------------------
def test_lm_eval_harness_request_shape_scores_every_prompt_in_order(cluster):
    """local-completions' loglikelihood request: token-id prompts, echo, logprobs=1, max_tokens=1."""
    path = cluster.model_path
    prompts = [_ids(path, p) for p in PROMPTS]
    body = {
        "model": _name(cluster),
        "prompt": prompts,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
    }
    reply = httpx.post(
        cluster.http_url + "/v1/completions", json=body, timeout=120, **cluster.http_auth
    ).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, reply["choices"], strict=True):
        lp = choice["logprobs"]
        want, want_top = prompt_reference(path, ids, 1)
        assert lp["token_logprobs"][: len(ids)] == want  # the prompt's, the first null
        assert len(lp["tokens"]) == len(ids) + 1 and lp["top_logprobs"][0] is None
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert max(top.values()) >= value  # what the harness reads as "greedy" (==)
        tokens, chosen, _ = generated_reference(path, ids, 1, 1)
        assert lp["token_logprobs"][-1] == chosen[0]
    assert reply["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_echo_with_max_tokens_zero_scores_the_prompt_text(cluster, api):
    path = cluster.model_path
    answer = api.completions.create(
        model=_name(cluster), prompt=PROMPTS[1], echo=True, logprobs=2, max_tokens=0
    )
    choice = answer.choices[0]
    ids = _ids(path, PROMPTS[1])
    want, want_top = prompt_reference(path, ids, 2)
    assert choice.text == PROMPTS[1] and choice.logprobs.token_logprobs == want
    texts = _hf(path)[1]
    assert choice.logprobs.tokens == [texts.decode([t]) for t in ids]
    assert choice.logprobs.text_offset == [len(texts.decode(ids[:i])) for i in range(len(ids))]
    for top, best in zip(choice.logprobs.top_logprobs[1:], want_top[1:], strict=True):
        assert top == {texts.decode([t]): lp for t, lp in best} | top  # the two best (and the chosen)


def test_chat_logprobs_in_the_chat_shape_streamed_or_not(cluster, api):
    path = cluster.model_path
    messages = [{"role": "user", "content": "a loop"}]
    whole = api.chat.completions.create(
        model=_name(cluster), messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    tok = _hf(path)[1]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    tokens, chosen, best = generated_reference(path, list(ids), 6, 2)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == chosen
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[lp for _, lp in b] for b in best]
    assert [c.token for c in content] == [tok.decode([t]) for t in tokens]
    stream = api.chat.completions.create(
        model=_name(cluster),
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [
        c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert [c.logprob for c in streamed] == chosen


def test_streamed_completion_logprobs_add_up_to_the_whole(cluster, api):
    kw = {
        "model": _name(cluster),
        "prompt": PROMPTS[0],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    whole = api.completions.create(**kw).choices[0]
    pieces = [c.choices[0] for c in api.completions.create(stream=True, **kw)]
    got = [v for p in pieces if p.logprobs for v in p.logprobs.token_logprobs]
    assert got == whole.logprobs.token_logprobs
    assert [o for p in pieces if p.logprobs for o in p.logprobs.text_offset] == whole.logprobs.text_offset
    assert "".join(p.text for p in pieces) == whole.text


def test_tokenizer_endpoints(cluster):
    tok = _hf(cluster.model_path)[1]
    post = functools.partial(httpx.post, timeout=30, **cluster.http_auth)
    got = post(
        cluster.http_url + "/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}
    ).json()
    assert got["tokens"] == tok(PROMPTS[0], add_special_tokens=False)["input_ids"] and got["count"] == len(
        got["tokens"]
    )
    back = post(cluster.http_url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]
    info = httpx.get(cluster.http_url + "/tokenizer_info", **cluster.http_auth).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"]
    assert post(cluster.http_url + "/detokenize", json={"tokens": [10**7]}).status_code == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # a mix
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_what_is_not_supported_is_refused_naming_it(cluster, body, param):
    base = {"model": _name(cluster), "prompt": "x", "max_tokens": 2}
    reply = httpx.post(
        cluster.http_url + "/v1/completions", json={**base, **body}, timeout=30, **cluster.http_auth
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs(cluster):
    body = {"model": _name(cluster), "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    reply = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=30, **cluster.http_auth)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"


def _name(cluster) -> str:
    return httpx.get(cluster.http_url + "/v1/models", **cluster.http_auth).json()["data"][0]["id"]


# -- every family, with the real decode loop in one process -----------------------------------------
@pytest.mark.parametrize("family", [*FAMILY_NAMES, *FOCUSED_FAMILIES])
def test_every_family_logprobs_equal_transformers(model_dirs, family):
    """In-process workers (odmoe/main/inprocess.py): the engine's logprobs, prompt and new tokens, greedy
    and seeded, to the bit (this process's thread count on both sides)."""
    path = model_dirs[family]
    engine, _ = engine_in_process(path)
    ids = _ids(path, PROMPTS[0])
    for sampling in ({}, {"do_sample": True, "temperature": 0.9, "seed": 3}):
        request = GenerateRequest(
            token_ids=tuple(ids),
            max_new_tokens=6,
            logprobs=2,
            prompt_logprobs=True,
            sampling=SamplingParams(**sampling),
        )
        events = list(engine.generate(request))
        prompt = next(e for e in events if isinstance(e, PromptEvent))
        new = [e for e in events if isinstance(e, TokenEvent)]
        assert isinstance(events[-1], DoneEvent)
        model, _ = _hf(path)
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
            assert list(prompt.logprobs[1:]) == [float(lp[i, t]) for i, t in enumerate(ids[1:])]
            x = torch.tensor([ids])
            if sampling:
                torch.manual_seed(sampling["seed"])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=6,
                output_logits=True,
                return_dict_in_generate=True,
                **{k: v for k, v in sampling.items() if k != "seed"},
            )
        tokens = out.sequences[0, len(ids) :].tolist()
        assert [e.token_id for e in new] == tokens
        assert [e.logprob for e in new] == [
            float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens, strict=True)
        ]
