"""Briefly trained models: the benchmark models, so recall is measured on routers with real
margins, and the demo model odmoe-launch answers with by default.

Contract: `train_model(spec, out_dir, settings)` trains a small Mixtral-architecture model from
scratch on Python sources (the benchmark models: the interpreter's standard library, which every
machine has; the demo: the corpus shipped in odmoe/data, the same everywhere), for a fixed number of
steps (not a wall-clock budget: the weights must not depend on the machine's speed), logs progress,
and saves checkpoint + tokenizer atomically, with `odmoe_training.json` beside them: held-out loss
before and after, and routing statistics (per-layer expert load, top-k margin distribution).
Random-init routers have near-zero margins between the k-th and (k+1)-th expert, which makes
recall meaningless; a trained router does not.

The router load-balancing loss is computed per layer and averaged: transformers' built-in version
pools all layers, and a layer then ended with a dead expert.

`TRAINED_SPECS` holds two benchmark models: the Mixtral-style one (`trained`) and a DeepSeek-V3-shaped
one (`trained_deepseek`: MLA, a dense first layer, a shared expert, 16 small routed experts top-4 in
4 groups of which 2 may be used, sigmoid scores). DeepSeek-V3 balances its experts without an
auxiliary loss, by nudging each router's `e_score_correction_bias` after every step (up for experts
under the mean load, down for those over it, by `bias_update_rate`); this trainer does the same, so
the saved bias is a trained one, and keeps the small per-layer balance loss as V3's complementary
sequence-wise loss.

`DEMO_SPEC` is the demo model (`model.path=demo`): small enough to train on first use in about two
minutes on two cores, long enough that its greedy continuation of `def fibonacci(n):` looks like
Python. It trains in a child process with torch's and MKL's kernels pinned (DEMO_KERNELS), so every
Intel x86-64 CPU trains the same bits and prints the README's text; MKL does not take the pin on
other CPUs (AMD), which train other weights and print other text (`cpu_vendor()`, logged).
`ensure_builtin_model("demo" | "tiny")` makes them; odmoe.tools.model_names maps every name to a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from odmoe.shadow.router_tap import RouterTap
from odmoe.shadow.shadow_model import choice_scores
from odmoe.tools.corpora import code_only
from odmoe.tools.demo_corpus import CORPUS_SHA256
from odmoe.tools.model_factory import (
    ModelSpec,
    add_chat_template,
    build_tokenizer,
    built_beside,
    corpus_documents,
    default_cache_dir,
    ensure_default_model,
    hf_config,
)

log = logging.getLogger("odmoe.tools.training")

TRAINED_SPEC = ModelSpec(
    family="mixtral",
    layers=4,
    hidden=256,
    intermediate=512,
    experts=8,
    top_k=2,
    heads=8,
    kv_heads=4,
    vocab=4096,
    max_positions=512,
    seed=0,
)
# ~8 M parameters: 1 dense + 3 MoE layers, experts a quarter of the Mixtral-style model's width.
TRAINED_DEEPSEEK_SPEC = replace(
    TRAINED_SPEC, family="deepseek_v3", intermediate=128, experts=16, top_k=4, kv_heads=8
)
# Hybrid attention (Qwen3-Next: 3 gated-DeltaNet layers to 1 full attention), so the shadow's recall
# is measured where alignment leaves the recurrent states to the shadow; experts half as wide as
# the Mixtral-style model's, so a step costs about as much.
TRAINED_QWEN3_NEXT_SPEC = replace(TRAINED_SPEC, family="qwen3_next", intermediate=256)
TRAINED_SPECS = {
    "mixtral": TRAINED_SPEC,
    "deepseek_v3": TRAINED_DEEPSEEK_SPEC,
    "qwen3_next": TRAINED_QWEN3_NEXT_SPEC,
}
# The demo model (`model.path=demo`, odmoe-launch's default): ~2 M parameters, 4 layers of 8 narrow
# experts top-2, trained on first use in about two minutes on two cores so that the first command
# prints recognisable Python. Narrow experts and a 1,024-token vocabulary (the lm_head was half of a
# step at 4,096) are what make a step cheap.
DEMO_SPEC = replace(TRAINED_SPEC, hidden=128, intermediate=128, heads=4, kv_heads=2, vocab=1024)


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 850  # ~10 minutes on 2 CPU cores at ~3,000 tokens/s
    batch: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 50
    aux_loss_coef: float = 0.02
    corpus_bytes: int = 12_000_000
    held_out_batches: int = 16
    seed: int = 0
    bias_update_rate: float = 1e-3  # DeepSeek-V3's e_score_correction_bias step per optimizer step
    threads: int = 0  # torch intra-op threads while training; 0: leave torch's setting alone
    code_only: bool = False  # train on code_only(source): no comments or docstrings
    corpus: str = "stdlib"  # "stdlib" (this interpreter's sources) or "demo" (shipped with odmoe)


# Per family: the step count is fixed (not a wall-clock budget). The DeepSeek model's 16 experts x
# 3 layers make a step slower on CPU than its size suggests, so it trains for fewer.
TRAINED_SETTINGS = {
    "mixtral": TrainSettings(),
    "deepseek_v3": TrainSettings(steps=400, warmup=30),
    "qwen3_next": TrainSettings(steps=400, warmup=30),  # ~5 min here (3,100 tokens/s)
}
# The demo: the corpus that ships with odmoe (odmoe.tools.demo_corpus: standard-library code without
# comments or docstrings, the same text on every Python version), small batches (more updates in
# the same time learnt faster than 16 x 128), one thread (as fast here as two for these small
# matmuls, faster when the cores are busy, and the same reduction order on every machine).
DEMO_SETTINGS = TrainSettings(
    steps=700,
    batch=8,
    seq_len=128,
    lr=4e-3,
    warmup=30,
    corpus_bytes=0,  # the whole shipped corpus (2.4 MB of code)
    held_out_batches=4,
    threads=1,
    corpus="demo",
)
# The demo's weights must be the same bits on every machine, and the CPU chooses the arithmetic:
# torch runs its vector kernels at the widest width the CPU has (AVX-512 here) and MKL picks its
# own code path, and each changes the rounding. Measured here (60 steps): the default, torch at
# AVX2, MKL at AVX2, and both at AVX2 gave four different sets of weights. So the demo trains in a
# child process with both pinned to AVX2, which every x86-64 CPU of the last decade runs. MKL takes
# its pin on Intel CPUs only: on others it runs its own choice of code ("the AUTO branch is used
# instead", Intel's oneMKL guide on MKL_CBWR), and a 700-step run amplifies a last-bit difference
# into other weights (measured: an AMD EPYC and an Intel Xeon, both pinned, printed different text;
# so did fp64 training with MKL's AVX2 and COMPATIBLE branches on one machine). So an AMD or ARM
# CPU trains a demo of its own (a warning says so); the cluster's tokens equal generate()'s for it.
DEMO_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
PROGRESS_EVERY_S = 5.0  # a user waits for the demo model: a progress line at least this often


def cpu_vendor() -> str:
    """The x86 CPU's vendor string (GenuineIntel, AuthenticAMD), else the machine's architecture."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _token_stream(tokenizer, settings: TrainSettings) -> torch.Tensor:
    ids: list[int] = []
    for text in corpus_documents(settings.corpus, settings.corpus_bytes):
        ids.extend(tokenizer(code_only(text) if settings.code_only else text, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _per_layer_balance_loss(
    router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int
) -> torch.Tensor:
    losses = [load_balancing_loss_func((logits,), experts, top_k) for logits in router_logits]
    return torch.stack(losses).mean()


@torch.no_grad()
def _held_out_loss(model, stream: torch.Tensor, settings: TrainSettings) -> float:
    gen = torch.Generator().manual_seed(settings.seed + 1)
    losses = []
    for _ in range(settings.held_out_batches):
        x = _batches(stream, settings.batch, settings.seq_len, gen)
        losses.append(float(model(input_ids=x, labels=x).loss))
    return sum(losses) / len(losses)


def _num_experts(model) -> int:
    from odmoe.models.families import family_of

    return int(getattr(model.config, family_of(model.config).num_experts_field))


@torch.no_grad()
def _update_correction_bias(choices: RouterTap, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias += rate * sign(mean load - expert load)."""
    for layer, router in choices.routers:
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is None or layer not in choices.chosen:
            continue
        load = torch.bincount(choices.chosen[layer].flatten(), minlength=bias.numel()).float()
        bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def routing_stats(model, stream: torch.Tensor, settings: TrainSettings, top_k: int) -> dict:
    """Per-layer share of routed tokens per expert, and the gap between the k-th and (k+1)-th
    expert's score as the router ranks them (softmax probability; DeepSeek-V3: sigmoid + bias within
    the allowed groups): misses concentrate where that gap is tiny."""
    gen = torch.Generator().manual_seed(settings.seed + 2)
    x = _batches(stream, settings.batch, settings.seq_len, gen)
    choices = RouterTap(model, _num_experts(model))
    try:
        model(input_ids=x)
    finally:
        choices.close()
    loads, gaps = {}, []
    for layer, router in choices.routers:
        logits, index = choices.logits[layer], choices.chosen[layer]
        scores = choice_scores(router, logits).topk(top_k + 1, dim=-1).values
        counts = torch.bincount(index.flatten(), minlength=logits.shape[-1]).float()
        loads[layer] = (counts / counts.sum()).tolist()
        gaps.append(scores[:, top_k - 1] - scores[:, top_k])
    gap = torch.cat(gaps)
    return {
        "expert_load_per_layer": loads,
        "min_expert_share": min(min(v) for v in loads.values()),
        "topk_gap_median": float(gap.median()),
        "topk_gap_below_0.01": float((gap < 0.01).float().mean()),
    }


def train_model(
    out_dir: str | Path, spec: ModelSpec = TRAINED_SPEC, settings: TrainSettings = TrainSettings()
) -> Path:
    if not settings.threads:
        return _train(Path(out_dir), spec, settings)
    before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _train(Path(out_dir), spec, settings)
    finally:
        torch.set_num_threads(before)


def _train(out_dir: Path, spec: ModelSpec, settings: TrainSettings) -> Path:
    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer(spec.vocab, spec.max_positions, settings.corpus)
    stream = _token_stream(tokenizer, settings)
    split = int(len(stream) * 0.98)
    train, held_out = stream[:split], stream[split:]
    log.info("corpus: %d tokens (%d held out)", len(stream), len(held_out))
    config = hf_config(spec)
    config.router_aux_loss_coef = 0.0  # out.loss is then the LM loss alone; balance is added per layer
    model = AutoModelForCausalLM.from_config(config)
    loss_before = _held_out_loss(model.eval(), held_out, settings)
    start = time.perf_counter()
    _fit(model.train(), train, spec, settings)
    model.eval()
    report = {
        "spec": asdict(spec),
        "settings": asdict(settings),
        "held_out_loss_before": loss_before,
        "held_out_loss_after": _held_out_loss(model, held_out, settings),
        "train_seconds": time.perf_counter() - start,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector kernels used
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "cpu_vendor": cpu_vendor(),  # MKL's pin holds on GenuineIntel only
        **routing_stats(model, held_out, settings, spec.top_k),
    }
    _save(model, tokenizer, spec, report, out_dir)
    log.info(
        "held-out loss %.2f -> %.2f; median top-k gap %.3f",
        report["held_out_loss_before"],
        report["held_out_loss_after"],
        report["topk_gap_median"],
    )
    return out_dir


def _lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(settings.steps - settings.warmup, 1)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * progress))


def _fit(model, train: torch.Tensor, spec: ModelSpec, settings: TrainSettings) -> None:
    """settings.steps of AdamW on random batches of `train`, each layer's balance loss added; the
    learning rate warms up linearly, then follows a cosine to 0."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(settings.seed)
    choices = RouterTap(model, _num_experts(model))  # DeepSeek-V3's bias updates read its choices
    start = last_log = time.perf_counter()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        x = _batches(train, settings.batch, settings.seq_len, gen)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        balance = _per_layer_balance_loss(out.router_logits, spec.experts, spec.top_k)
        loss = out.loss + settings.aux_loss_coef * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        _update_correction_bias(choices, settings.bias_update_rate)
        now = time.perf_counter()
        if step % 25 == 0 or step == settings.steps - 1 or now - last_log >= PROGRESS_EVERY_S:
            last_log = now
            elapsed = now - start
            log.info(
                "step %d/%d  loss %.3f  balance %.3f  %.0f tokens/s  ETA %.0fs",
                step + 1,
                settings.steps,
                out.loss.item(),
                float(balance.detach()),
                (step + 1) * settings.batch * settings.seq_len / elapsed,
                elapsed / (step + 1) * (settings.steps - step - 1),
            )
    choices.close()


def _save(model, tokenizer, spec: ModelSpec, report: dict, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with built_beside(out_dir) as tmp:
        model.config.output_router_logits = False
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "odmoe_model.json").write_text(json.dumps(asdict(spec), indent=2))
        (tmp / "odmoe_training.json").write_text(json.dumps(report, indent=2))


def _ensure(target: Path, spec: ModelSpec, settings: TrainSettings, what: str, train=None) -> Path:
    """Train into target once; concurrent callers (nodes started together) wait for one trainer."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "odmoe_training.json").is_file():
            log.info("training %s into %s (first use only)", what, target)
            (train or train_model)(target, spec, settings)
        add_chat_template(target)  # a model trained before the template existed
    return target


def ensure_trained_model(
    cache_dir: Path | None = None, settings: TrainSettings | None = None, family: str = "mixtral"
) -> Path:
    """The trained benchmark model of `family` (a key of TRAINED_SPECS), trained once per cache
    directory (Mixtral-style: about 10 minutes on 2 cores)."""
    spec = TRAINED_SPECS[family]
    settings = settings or TRAINED_SETTINGS[family]
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    return _ensure(
        cache_dir / f"trained-{spec.name}-steps{settings.steps}", spec, settings, "the benchmark model"
    )


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo model, trained once per cache directory (about two minutes on 2 cores). Its name
    carries a digest of its spec, settings, corpus and kernels, so changing any trains a new one."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    recipe = [asdict(DEMO_SPEC), asdict(DEMO_SETTINGS), CORPUS_SHA256, DEMO_KERNELS]
    digest = hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:8]
    name = f"demo-{DEMO_SPEC.name}-steps{DEMO_SETTINGS.steps}-{digest}"
    return _ensure(
        cache_dir / name,
        DEMO_SPEC,
        DEMO_SETTINGS,
        "the demo model (about two minutes on two cores)",
        train=lambda *args: _train_with_pinned_kernels(*args),  # looked up when called (tests stub it)
    )


def train_demo(out_dir: str | Path) -> Path:
    """The demo model into out_dir, as `model.path=demo` makes it (pinned kernels: the same bits)."""
    _train_with_pinned_kernels(Path(out_dir), DEMO_SPEC, DEMO_SETTINGS)
    return Path(out_dir)


def _train_with_pinned_kernels(target: Path, spec: ModelSpec, settings: TrainSettings) -> None:
    """Train in a child process whose torch and MKL start with DEMO_KERNELS (both read them once,
    when first used, so the process that asks, which has torch loaded already, cannot)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.warning(
            "this %s CPU computes with other kernels than the x86-64 ones the demo pins: its demo "
            "model, and so its text, differ from the README's",
            platform.machine(),
        )
        train_model(target, spec, settings)
        return
    code = (
        "import logging, sys; from pathlib import Path; import odmoe.tools.training as t; "
        "logging.basicConfig(level='INFO', format='%(asctime)s %(name)s %(levelname)s %(message)s'); "
        "t.train_model(Path(sys.argv[1]), t.ModelSpec(**t.json.loads(sys.argv[2])), "
        "t.TrainSettings(**t.json.loads(sys.argv[3])))"
    )
    argv = [sys.executable, "-c", code, str(target), json.dumps(asdict(spec)), json.dumps(asdict(settings))]
    done = subprocess.run(argv, env={**os.environ, **DEMO_KERNELS}, check=False)
    if done.returncode:
        raise RuntimeError(f"training the demo model failed (exit {done.returncode}); its log is above")
    report = json.loads((target / "odmoe_training.json").read_text())
    if report["cpu_vendor"] != "GenuineIntel":
        log.warning(
            "MKL pins its kernels on Intel CPUs only, and this one is %s: its demo model, and so its "
            "text, differ from the README's (the cluster's text still equals generate()'s for it)",
            report["cpu_vendor"],
        )
    elif report["cpu_capability"] != DEMO_KERNELS["ATEN_CPU_CAPABILITY"].upper():
        log.warning(
            "the demo trained with %s kernels, not AVX2 (this CPU has no AVX2?): its text may differ "
            "slightly from the README's",
            report["cpu_capability"],
        )


BUILTIN_MODELS = ("demo", "tiny")  # model.path names: odmoe's own models, made on first use


def ensure_builtin_model(name: str, cache_dir: Path | None = None) -> Path:
    """`demo`: a small Mixtral trained to write Python (odmoe-launch's default, ~2 min on first use);
    `tiny`: random init, made in a second (tests, benchmarks of the protocol)."""
    if name == "demo":
        return ensure_demo_model(cache_dir)
    if name == "tiny":
        return ensure_default_model(cache_dir)
    raise ValueError(f"{name!r} is not one of odmoe's own models ({', '.join(BUILTIN_MODELS)})")
