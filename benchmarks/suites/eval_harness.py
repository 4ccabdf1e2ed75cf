"""Suite `eval`: lm-evaluation-harness against the cluster and against one process (needs the `eval` extra).

The same tasks run twice through lm-eval's own code:
- `--model hf`: transformers in this process (float32, batch size 1, on as many threads as a node
  computes with: a CPU's float32 matmul rounds otherwise over another number of threads);
- `--model local-completions`: a local cluster's OpenAI API (token-id prompts, `echo` + `logprobs`,
  `temperature=0`), as a user points the harness at a server;
- `--model odmoe-completions` (odmoe.serving.lm_eval_backend): local-completions summing each
  choice's token logprobs in float32, as `hf` sums them.
The tasks (benchmarks/eval/tasks/*.yaml: `odmoe_code_mc`, multiple choice by log-likelihood, and
`odmoe_code_gen`, greedy generation; data from benchmarks/eval/make_tasks.py) run offline.

Compared per document: each choice's log-likelihood and is-greedy flag, each generated text, each
document's metrics, and every task score. The harness sums a request's token logprobs in float32 for
`hf` (a tensor sum) and in float64 for local-completions (Python floats), so local-completions'
per-choice numbers may differ in their last bits while every token's logprob is the same; the suite
records the API's token logprobs as they arrive and sums them as `hf` does, which must give `hf`'s
number to the bit, and odmoe-completions must report `hf`'s numbers as they are.

Then the cost of scoring: prompt tokens/s of `echo` + `max_tokens=0` requests against the cluster (one
prompt per request, then `scoring_batch` prompts per request, which the cluster prefills together)
and of one process (transformers' forward + log_softmax, on a node's threads and on every core).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

import httpx
import torch
import yaml
from transformers import AutoModelForCausalLM

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir

EVAL_DIR = Path(__file__).resolve().parent.parent / "eval"
NODE_THREADS = 1  # conf/cluster/local.yaml: torch_threads of every local node
API_BACKENDS = ("local-completions", "odmoe-completions")


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.eval
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SystemExit("suite eval needs lm-evaluation-harness: pip install -e '.[eval]'") from None
    # the tasks' data are local files; nothing may reach for a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tasks_dir = Path(tempfile.mkdtemp(prefix="odmoe-eval-"))
    try:
        task_files(tasks_dir)
        start = time.perf_counter()
        one = harness_hf(model_path, tasks_dir, suite.tasks, suite.limit)
        one_s = time.perf_counter() - start
        seconds, backends = {"hf": one_s}, {}
        with odmoe.LocalCluster(model_path, overrides=cluster_words(cfg)) as cluster:
            for backend in API_BACKENDS:
                start = time.perf_counter()
                api, sent = harness_api(
                    cluster, model_path, tasks_dir, suite.tasks, suite.limit, suite.num_concurrent, backend
                )
                seconds[backend] = time.perf_counter() - start
                strict = backend == "odmoe-completions"  # its sums are hf's, as reported
                backends[backend] = {name: compare(name, one, api, sent, strict) for name in suite.tasks}
            scoring = scoring_throughput(cluster, model_path, suite.scoring_prompts, suite.scoring_batch)
    finally:
        shutil.rmtree(tasks_dir, ignore_errors=True)
    report = {
        "tasks": backends["local-completions"],
        "odmoe_completions": backends["odmoe-completions"],
        "harness_seconds": seconds,
        "num_concurrent": suite.num_concurrent,
        "scoring": scoring,
        "identical": all(t["identical"] for b in backends.values() for t in b.values()),
    }
    _print(report)
    out.write("eval", "eval", report)
    plots.eval_harness(report, out.path("eval", "png"), f"model {Path(model_path).name}")
    return report


def task_files(directory: Path) -> None:
    """The repository's task YAMLs with their data paths made absolute (the YAMLs name them from the
    repository's root, where `lm_eval --include_path benchmarks/eval/tasks` is run)."""
    for source in sorted((EVAL_DIR / "tasks").glob("*.yaml")):
        task = yaml.safe_load(source.read_text())
        files = task["dataset_kwargs"]["data_files"]
        for split, name in files.items():
            files[split] = str(EVAL_DIR / "data" / Path(name).name)
        (directory / source.name).write_text(yaml.safe_dump(task))


def _evaluate(lm, tasks_dir: Path, tasks: list[str], limit: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=limit or None,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def harness_hf(model_path: str, tasks_dir: Path, tasks: list[str], limit: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    before = torch.get_num_threads()
    torch.set_num_threads(NODE_THREADS)
    try:
        lm = HFLM(pretrained=model_path, dtype="float32", batch_size=1, device="cpu")
        return _evaluate(lm, tasks_dir, tasks, limit)
    finally:
        torch.set_num_threads(before)


def harness_api(
    cluster,
    model_path: str,
    tasks_dir: Path,
    tasks: list[str],
    limit: int,
    concurrent: int,
    backend: str = "local-completions",
):
    """lm-eval's `backend` (one of API_BACKENDS) against the cluster; also what the API sent: each
    request's token ids -> its continuation's token logprobs, as the harness read them."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from odmoe.serving.lm_eval_backend import OdmoeCompletions

    model_class = OdmoeCompletions if backend == "odmoe-completions" else LocalCompletionsAPI

    cert = str(cluster.key_dir / "tls" / "cert.pem")
    # the harness's requests read the key and the CA bundle from the environment in its synchronous path
    env = {"OPENAI_API_KEY": cluster.token, "REQUESTS_CA_BUNDLE": cert, "SSL_CERT_FILE": cert}
    name = httpx.get(f"{cluster.http_url}/v1/models", **cluster.http_auth).json()["data"][0]["id"]
    sent: dict[tuple[int, ...], list[float]] = {}
    parse = LocalCompletionsAPI.parse_logprobs

    def recording(outputs, tokens=None, ctxlens=None, **kwargs):
        for out in outputs if isinstance(outputs, list) else [outputs]:
            for choice, ids, ctxlen in zip(out["choices"], tokens, ctxlens, strict=False):
                sent[tuple(ids)] = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        return parse(outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)

    # both put back as they were when the harness is done (the environment, the parser)
    with (
        patch.dict(os.environ, env),
        patch.object(LocalCompletionsAPI, "parse_logprobs", staticmethod(recording)),
    ):
        lm = model_class(
            base_url=f"{cluster.http_url}/v1/completions",
            model=name,
            tokenizer=model_path,
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            num_concurrent=concurrent,
            max_retries=1,
            ca_cert_path=cert,
            auth_token=cluster.token,
        )
        results = _evaluate(lm, tasks_dir, tasks, limit)
        results["_encode_pair"] = lm._encode_pair
        return results, sent


def compare(task: str, one: dict, api: dict, sent: dict, strict: bool = False) -> dict:
    """Document by document, `hf` against an API backend; `strict`: each choice's log-likelihood
    must equal hf's as the backend reports it (else once summed as hf sums)."""
    a = {s["doc_id"]: s for s in one["samples"][task]}
    b = {s["doc_id"]: s for s in api["samples"][task]}
    metrics = [k for k in one["results"][task] if "," in k and "stderr" not in k]
    row = {
        "documents": len(a),
        "scores": {m: [one["results"][task][m], api["results"][task][m]] for m in metrics},
        "documents_differing": 0,
    }
    loglikelihood = one["samples"][task] and isinstance(one["samples"][task][0]["resps"][0][0], tuple | list)
    if loglikelihood:
        row.update(choices=0, ll_equal_as_reported=0, ll_equal_summed_in_float32=0, greedy_equal=0)
        row["ll_max_abs_diff_as_reported"] = 0.0
    else:
        row["generations_equal"] = 0
    for doc_id, x in a.items():
        y = b[doc_id]
        same = all(x[m.split(",")[0]] == y[m.split(",")[0]] for m in metrics)
        if loglikelihood:
            for (hf_ll, hf_greedy), (api_ll, api_greedy), args in zip(
                [r[0] for r in x["resps"]], [r[0] for r in y["resps"]], y["arguments"], strict=True
            ):
                context, continuation = args[0], args[1]
                ctx, cont = api["_encode_pair"](context, continuation)
                summed = float(torch.tensor(sent[tuple(ctx + cont)], dtype=torch.float32).sum())
                row["choices"] += 1
                row["ll_equal_as_reported"] += hf_ll == api_ll
                row["ll_equal_summed_in_float32"] += hf_ll == summed
                row["greedy_equal"] += hf_greedy == api_greedy
                row["ll_max_abs_diff_as_reported"] = max(
                    row["ll_max_abs_diff_as_reported"], abs(hf_ll - api_ll)
                )
                same &= hf_ll == (api_ll if strict else summed) and hf_greedy == api_greedy
        else:
            equal = x["filtered_resps"] == y["filtered_resps"]
            row["generations_equal"] += equal
            same &= equal
        row["documents_differing"] += not same
    scores_equal = all(v[0] == v[1] for v in row["scores"].values())
    row["identical"] = scores_equal and row["documents_differing"] == 0
    return row


def scoring_throughput(cluster, model_path: str, prompts: int, batch: int) -> dict:
    """Prompt tokens scored per second: `echo` + `max_tokens=0` through the API (one prompt per
    request; then `batch` per request) against transformers' forward + log_softmax in one process."""
    from odmoe_bench.workload import prompt_ids

    tok = load_tokenizer(model_path)
    ids = [prompt_ids(tok, i, 64 + 16 * (i % 5)) for i in range(prompts)]
    tokens = sum(len(x) for x in ids)
    url, auth = f"{cluster.http_url}/v1/completions", cluster.http_auth
    name = httpx.get(f"{cluster.http_url}/v1/models", **auth).json()["data"][0]["id"]
    body = {"model": name, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    out = {"prompts": prompts, "prompt_tokens": tokens}
    with httpx.Client(timeout=600, **auth) as http:
        http.post(url, json={**body, "prompt": ids[0]}).raise_for_status()  # warm-up
        for label, size in (
            ("cluster, 1 prompt per request", 1),
            (f"cluster, {batch} prompts per request", batch),
        ):
            start = time.perf_counter()
            for i in range(0, prompts, size):
                reply = http.post(url, json={**body, "prompt": ids[i : i + size]})
                reply.raise_for_status()
            out[label] = tokens / (time.perf_counter() - start)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    before = torch.get_num_threads()
    for label, threads in (
        (f"one process, {NODE_THREADS} thread", NODE_THREADS),
        (f"one process, {os.cpu_count()} threads", os.cpu_count()),
    ):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            model(torch.tensor([ids[0]]))
            start = time.perf_counter()
            for x in ids:
                torch.log_softmax(model(torch.tensor([x[:-1]])).logits.float(), dim=-1)
            out[label] = tokens / (time.perf_counter() - start)
    torch.set_num_threads(before)
    return out


def _print(report: dict) -> None:
    for backend, rows in (
        ("local-completions", report["tasks"]),
        ("odmoe-completions", report["odmoe_completions"]),
    ):
        print(f"\nlm-evaluation-harness: --model hf (one process) vs --model {backend} (the cluster)")
        _print_rows(rows)
    t = report["harness_seconds"]
    print(
        "harness wall time: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in t.items())
        + f" (num_concurrent={report['num_concurrent']})"
    )
    s = report["scoring"]
    print(f"prompt scoring (echo, max_tokens=0), {s['prompts']} prompts, {s['prompt_tokens']} tokens:")
    for label, value in s.items():
        if label not in ("prompts", "prompt_tokens"):
            print(f"  {label:40s} {value:8.0f} tokens/s")
    print(f"identical: {report['identical']}")


def _print_rows(rows: dict) -> None:
    for task, row in rows.items():
        scores = ", ".join(f"{m} {v[0]:.4f} / {v[1]:.4f}" for m, v in row["scores"].items())
        print(f"  {task:16s} {row['documents']} documents; scores hf / cluster: {scores}")
        if "choices" in row:
            print(
                f"  {'':16s} choices {row['choices']}: log-likelihoods equal as reported "
                f"{row['ll_equal_as_reported']}, equal summed in float32 as hf sums "
                f"{row['ll_equal_summed_in_float32']} (as reported, max |diff| "
                f"{row['ll_max_abs_diff_as_reported']:.3g}); is-greedy equal {row['greedy_equal']}"
            )
        else:
            print(f"  {'':16s} generations equal {row['generations_equal']} of {row['documents']}")
        print(f"  {'':16s} documents differing: {row['documents_differing']}")
