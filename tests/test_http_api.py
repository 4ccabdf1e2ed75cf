"""The OpenAI-compatible HTTP API of a real local cluster, driven with the official `openai` client
and with raw HTTP (httpx) for the edge cases. One cluster serves the whole module (max_running=2 and
max_waiting=1 so a full queue is easy to reach); the test that kills its workers runs last."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time

import grpc
import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe import LocalCluster
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.security import ClientCredentials
from tests.conftest import run_together

pytestmark = pytest.mark.integration
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def cluster(model_dirs):
    words = ["model.dtype=float32", "server.max_running=2", "server.max_waiting=1"]
    with LocalCluster(model_dirs["mixtral"], workers=2, group_size=2, overrides=words) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster):
    tls = httpx.Client(verify=cluster.http_auth["verify"])  # the cluster's own certificate (security on)
    return openai.OpenAI(
        base_url=cluster.http_url + "/v1", api_key=cluster.token, max_retries=0, http_client=tls
    )


@pytest.fixture(scope="module")
def name(api):
    return api.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(cluster):
    model = AutoModelForCausalLM.from_pretrained(cluster.model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(cluster.model_path)


def sampled(hf, prompt: str | list[int], new_tokens: int, seed: int, **params) -> list[int]:
    """transformers' own seeded sampling, one process."""
    model, tok = hf
    ids = (
        torch.tensor([prompt]) if isinstance(prompt, list) else tok(prompt, return_tensors="pt")["input_ids"]
    )
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new_tokens, **params
    )
    return out[0, ids.shape[1] :].tolist()


def metric(cluster, name: str) -> float:
    page = httpx.get(cluster.http_url + "/metrics", **cluster.http_auth).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


def text_of(hf, ids: list[int]) -> str:
    return hf[1].decode(ids, skip_special_tokens=True)


# -- the openai client, as users call it -----------------------------------------------------------
def test_models_health_and_a_completion(cluster, api, name, hf):
    assert [m.id for m in api.models.list().data] == [name]
    assert httpx.get(cluster.http_url + "/health", **cluster.http_auth).json() == {"status": "ok"}
    answer = api.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
    greedy = cluster.client.generate(PROMPT, max_new_tokens=12)
    assert answer.choices[0].text == greedy.text
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.completion_tokens == len(greedy.token_ids)
    assert answer.usage.prompt_tokens == len(hf[1](PROMPT)["input_ids"])


def test_streamed_completion_equals_the_whole_one_with_usage_last(api, name):
    whole = api.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=11)
    chunks = list(
        api.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0.9,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"temperature": 1.0, "top_p": 0.8, "top_k": 20},
        {"temperature": 1.3, "min_p": 0.1},
        {"temperature": 0.9, "repetition_penalty": 1.5},
    ],
    ids=["temperature", "top_p+top_k", "min_p", "repetition_penalty"],
)
def test_seeded_sampling_over_http_equals_transformers(api, name, hf, params):
    extra = {k: v for k, v in params.items() if k not in ("temperature", "top_p")}
    answer = api.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=20,
        seed=5,
        temperature=params["temperature"],
        top_p=params.get("top_p"),
        extra_body=extra,
    )
    assert answer.choices[0].text == text_of(hf, sampled(hf, PROMPT, 20, seed=5, **params))


def test_concurrent_seeded_requests_keep_their_own_draws(cluster, api, name, hf):
    """Two requests at once (one runs, one waits): each equals its own single-process reference."""
    asks = {3: {"temperature": 0.8}, 4: {"temperature": 1.1, "top_k": 10}}

    def ask(seed):
        extra = {"top_k": asks[seed]["top_k"]} if "top_k" in asks[seed] else None
        r = api.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=24,
            seed=seed,
            temperature=asks[seed]["temperature"],
            extra_body=extra,
        )
        return r.choices[0].text

    got = dict(zip(asks, run_together([lambda s=s: ask(s) for s in asks]), strict=True))
    for seed, params in asks.items():
        assert got[seed] == text_of(hf, sampled(hf, PROMPT, 24, seed=seed, **params))


def test_chat_completion_applies_the_chat_template(cluster, api, name, hf):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop"}]
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(ids["input_ids"])
    answer = api.chat.completions.create(
        model=name, messages=messages, max_tokens=10, seed=9, temperature=0.8
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text_of(hf, sampled(hf, ids, 10, seed=9, temperature=0.8))
    assert answer.usage.prompt_tokens == len(ids)
    stream = api.chat.completions.create(
        model=name, messages=messages, max_tokens=10, seed=9, temperature=0.8, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_n_choices_each_equal_generate_with_its_seed(api, name, hf):
    """n=3: three choices, batched, sharing the prompt's prefill; choice i samples with seed + i,
    and equals transformers' generate with that seed, streamed or not."""
    answer = api.completions.create(model=name, prompt=PROMPT, max_tokens=12, n=3, seed=40, temperature=0.9)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    seeds = [c["seed"] for c in answer.model_extra["odmoe"]["choices"]]
    assert seeds == [40, 41, 42]
    for choice, seed in zip(answer.choices, seeds, strict=True):
        want = sampled(hf, PROMPT, 12, seed, temperature=0.9)
        assert choice.text == text_of(hf, want), f"choice with seed {seed}"
    assert answer.usage.completion_tokens == sum(
        len(sampled(hf, PROMPT, 12, s, temperature=0.9)) for s in seeds
    )
    stream = api.completions.create(
        model=name, prompt=PROMPT, max_tokens=12, n=3, seed=40, temperature=0.9, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in answer.choices]
    greedy = api.completions.create(model=name, prompt=PROMPT, max_tokens=8, n=2, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_ignore_eos_goes_on_past_the_end_of_sequence_as_benchmark_tools_ask(cluster, name, hf):
    """vLLM's `ignore_eos` (guidellm and aiperf send it to fix output lengths): the request runs its
    max_tokens, the end-of-sequence token included, as generate() with no eos_token_id."""
    model, tok = hf
    eos = model.generation_config.eos_token_id
    for p in (PROMPT, "    return sorted(items, key=", "import os\n", "x = ["):
        ids = tok(p, return_tensors="pt")["input_ids"]
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        if eos in plain[0, ids.shape[1] :].tolist():
            break
    else:
        pytest.skip("no prompt reaches the end-of-sequence token within 40 tokens")
    want = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, eos_token_id=None
    )[0, ids.shape[1] :].tolist()
    reply = httpx.post(
        cluster.http_url + "/v1/completions",
        json={"model": name, "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
        timeout=60,
        **cluster.http_auth,
    ).json()
    assert reply["usage"]["completion_tokens"] == 40 and reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["text"] == text_of(hf, want)


# -- raw HTTP: the edges ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"n": 65}, 400, "n"),
        ({"n": 0}, 400, "n"),
        ({"logprobs": 21}, 400, "logprobs"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"best_of_everything": 1}, 400, "best_of_everything"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": ["one", [1, 2]]}, 400, "prompt"),
        ({"max_tokens": 100000}, 400, None),
        ({"model": "gpt-4"}, 404, "model"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ],
)
def test_bad_parameters_get_an_openai_shaped_error(cluster, name, body, status, param):
    reply = httpx.post(
        cluster.http_url + "/v1/completions",
        json={"model": name, "prompt": PROMPT, **body},
        timeout=30,
        **cluster.http_auth,
    )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    if param:
        assert error["param"] == param or param in error["message"]


def test_malformed_json_is_a_400(cluster):
    reply = httpx.post(
        cluster.http_url + "/v1/completions",
        content=b"{nope",
        headers={"content-type": "application/json", **cluster.http_auth["headers"]},
        verify=cluster.http_auth["verify"],
    )
    assert reply.status_code == 400 and "error" in reply.json()


def test_text_that_is_not_unicode_is_a_400_naming_the_field_and_the_next_request_is_served(cluster, name):
    """Issue 50: a lone surrogate (valid JSON, not Unicode) answered 500 from the tokenizer's
    TypeError; a body that is not UTF-8 was answered 500 (a surrogate written as UTF-8) or, as the
    issue saw it, not at all. Each route that takes text, then a request answered as usual
    (tests/test_text_check.py has every field)."""
    cases = [
        ("/v1/completions", f'{{"model": "{name}", "prompt": "\\ud800abc"}}'.encode(), "prompt"),
        (
            "/v1/chat/completions",
            f'{{"model": "{name}", "messages": [{{"role": "user", "content": "\\ud800abc"}}]}}'.encode(),
            "messages[0].content",
        ),
        ("/tokenize", b'{"prompt": "\\udfffabc"}', "prompt"),
        ("/v1/completions", f'{{"model": "{name}", "prompt": "\xff\xfeabc"}}'.encode("latin-1"), None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', None),
    ]
    auth = cluster.http_auth
    headers = {"content-type": "application/json", **auth["headers"]}
    for path, raw, param in cases:
        reply = httpx.post(
            cluster.http_url + path, content=raw, headers=headers, verify=auth["verify"], timeout=30
        )
        assert reply.status_code == 400, (path, raw, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert "not valid Unicode" in error["message"] or "not valid UTF-8" in error["message"]
    body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(cluster.http_url + "/v1/completions", json=body, timeout=60, **auth)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"] == cluster.client.generate(PROMPT, max_new_tokens=8).text


def _sse(cluster, body: dict):
    """The data events of a streamed request, as raw JSON strings."""
    with httpx.stream(
        "POST", cluster.http_url + "/v1/completions", json=body, timeout=60, **cluster.http_auth
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: ")]


def test_a_stop_string_split_across_tokens_is_never_streamed(cluster, name):
    pieces = [p.text for p in cluster.client.stream(PROMPT, max_new_tokens=24)]
    at = next(i for i in range(1, len(pieces)) if pieces[i - 1] and pieces[i].strip())
    stop = pieces[at - 1][-1] + pieces[at][0]  # its first character ends one token, the rest starts the next
    full = "".join(pieces)
    want = full[: full.index(stop)]
    events = _sse(
        cluster,
        {"model": name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stop, "stream": True},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = httpx.post(
        cluster.http_url + "/v1/completions",
        json={"model": name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": [stop]},
        timeout=60,
        **cluster.http_auth,
    ).json()
    assert whole["choices"][0]["text"] == want and whole["choices"][0]["finish_reason"] == "stop"


def test_a_client_that_disconnects_mid_stream_cancels_its_request(cluster, name):
    cancelled = metric(cluster, 'odmoe:requests_total{finish_reason="cancelled"}')
    generated = metric(cluster, "odmoe:generation_tokens_total")
    body = {"model": name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", cluster.http_url + "/v1/completions", json=body, timeout=60, **cluster.http_auth
    ) as reply:
        lines = reply.iter_lines()
        read = 0
        while read < 3:
            read += next(lines).startswith("data: ")
    gone = time.monotonic()
    while metric(cluster, 'odmoe:requests_total{finish_reason="cancelled"}') == cancelled:
        assert time.monotonic() - gone < 5, "the request was not cancelled"
        time.sleep(0.05)
    assert metric(cluster, "odmoe:num_requests_running") == 0
    # stopped a few iterations after the client left, far from its 200 tokens
    assert metric(cluster, "odmoe:generation_tokens_total") - generated < 30


def test_a_full_queue_answers_429(cluster, name):
    """Two requests run (max_running=2), one waits (max_waiting=1): the next is refused."""
    long = {"model": name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    kept = []  # a dropped iterator closes its response (a disconnect)
    with contextlib.ExitStack() as streams:
        for _ in range(2):
            running = streams.enter_context(
                httpx.stream(
                    "POST", cluster.http_url + "/v1/completions", json=long, timeout=60, **cluster.http_auth
                )
            )
            lines = running.iter_lines()
            kept.append(lines)
            while not next(lines).startswith("data: "):
                pass
        waiting = threading.Thread(
            target=lambda: httpx.post(
                cluster.http_url + "/v1/completions",
                json={**long, "stream": False},
                timeout=5,
                **cluster.http_auth,
            )
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while metric(cluster, "odmoe:num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(
            cluster.http_url + "/v1/completions",
            json={**long, "stream": False},
            timeout=30,
            **cluster.http_auth,
        )
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    waiting.join(timeout=30)  # its client gave up after 5 s: that request is cancelled too
    deadline = time.monotonic() + 30
    while metric(cluster, "odmoe:num_requests_running") or metric(cluster, "odmoe:num_requests_waiting"):
        assert time.monotonic() < deadline, httpx.get(
            cluster.http_url + "/metrics", **cluster.http_auth
        ).text[-1500:]
        time.sleep(0.1)


def test_a_request_past_its_deadline_ends_with_deadline_exceeded(cluster):
    stub = odmoe_pb2_grpc.InferenceStub(cluster.credentials.channel(cluster.address))
    request = odmoe_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=200, timeout_s=0.3)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, metadata=cluster.credentials.metadata))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_metrics_page_has_the_promised_series(cluster, api, name):
    api.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
    page = httpx.get(cluster.http_url + "/metrics", **cluster.http_auth).text
    for series in (
        "odmoe:time_to_first_token_seconds_bucket",
        "odmoe:inter_token_latency_seconds_bucket",
        "odmoe:prompt_tokens_total",
        "odmoe:generation_tokens_total",
        "odmoe:num_requests_running",
        "odmoe:num_requests_waiting",
        'odmoe:experts_loaded_total{worker="worker0"}',
        'odmoe:expert_bytes_loaded_total{worker="worker1"}',
        "odmoe:reloads_total",
        "odmoe:stall_seconds_total",
        "odmoe:recall",
    ):
        assert series in page, series
    assert metric(cluster, "odmoe:generation_tokens_total") > 0


def test_odmoe_chat_one_shot_and_interactive_take_plain_text(cluster):
    prompt = "print(\"a = (b)\", end='')\n"  # parentheses, quotes, '=' and a newline: no grammar applies
    greedy = cluster.client.generate(prompt, max_new_tokens=8)
    one_shot = subprocess.run(
        [
            "odmoe-chat",
            "--url",
            cluster.http_url,
            "--key-dir",
            str(cluster.key_dir),
            "--completion",
            "--max-tokens",
            "8",
            "-",
        ],
        input=prompt,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one_shot.returncode == 0, one_shot.stderr
    assert one_shot.stdout == greedy.text + "\n"
    chat = subprocess.run(
        ["odmoe-chat", "--url", cluster.http_url, "--key-dir", str(cluster.key_dir), "--max-tokens", "6"],
        input="hello (there) = 'you'\n/reset\nagain\n/quit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0, chat.stderr
    assert "odmoe-chat:" in chat.stderr and "Traceback" not in chat.stderr
    refused = subprocess.run(
        ["odmoe-chat", "--url", cluster.http_url, "--key-dir", str(cluster.key_dir), "--top-p", "7", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "top_p" in refused.stderr


def test_health_is_503_when_no_worker_can_serve(cluster):
    """Last: it breaks the module's cluster."""
    cluster.kill("worker0")
    cluster.kill("worker1")
    deadline = time.monotonic() + 15
    while (reply := httpx.get(cluster.http_url + "/health", **cluster.http_auth)).status_code == 200:
        assert time.monotonic() < deadline, "health stayed 200 with every worker dead"
        time.sleep(0.1)
    assert reply.status_code == 503 and "layer" in reply.json()["reason"]


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_role_local_serve_keeps_serving_until_ctrl_c(model_dirs, reap_children):
    """`odmoe-launch role=local serve=true` prints the API's URL, answers on it, and Ctrl-C stops
    every node, even when started with SIGINT ignored (what a non-interactive shell's `&` does: it
    once left the launcher deaf to Ctrl-C)."""
    words = ["role=local", "serve=true", "server.http_port=0", f"model.path={model_dirs['mixtral']}"]
    launch = subprocess.Popen(
        ["bash", "-c", "trap '' INT; exec odmoe-launch \"$@\"", "bash", *words],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = launch.stderr.readline()
            assert line, "odmoe-launch exited before serving"
            if found := re.search(r"OpenAI-compatible API at (https://\S+)/v1.*--key-dir (\S+)", line):
                url, key_dir = found.group(1), found.group(2)
        creds = ClientCredentials.from_key_dir(key_dir)  # the ephemeral keys the cluster made
        auth = {"headers": {"Authorization": f"Bearer {creds.token}"}, "verify": creds.ssl_context()}
        assert url and httpx.get(url + "/health", **auth).json() == {"status": "ok"}
        name = httpx.get(url + "/v1/models", **auth).json()["data"][0]["id"]
        answer = httpx.post(
            url + "/v1/completions",
            json={"model": name, "prompt": PROMPT, "max_tokens": 4},
            timeout=60,
            **auth,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        launch.send_signal(2)  # SIGINT, as Ctrl-C
        code = launch.wait(timeout=60)
    assert code in (0, 130)
