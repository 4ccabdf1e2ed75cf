"""Issue 18 on a CUDA device (marked `gpu`; skipped where torch sees no CUDA):

1. a worker's slots: pinned experts, copies on a copy stream of its own, compute waiting on the event,
   load time from CUDA events;
2. main and shadow on the GPU (bf16/fp16 and bitsandbytes int8/nf4 shadows), CUDA's own peak counter
   per node in the stats;
3. exactness: the worker's expert kernel equals transformers' experts module on the GPU, and a whole
   cluster on the GPU gives the tokens of `generate(do_sample=False)` on the same device and dtype,
   for each family (the core six and the focused ones), through prefill and decode;
4. many requests at once (issue 28): batched decode with main on the GPU gives each request its alone
   bits (cuBLAS's batched GEMM against the one-row linear is checked per shape there too), and
   concurrent clients of a GPU cluster each get `generate`'s tokens;
5. GGUF files (issue 46): the stored blocks dequantized on the GPU are the gguf package's bits, and a
   cluster on the GPU serving a GGUF file gives transformers' GGUF loading's tokens on the GPU.

    python -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe import LocalCluster
from odmoe.main.batched_decode import FAMILIES as BATCHED_FAMILIES
from odmoe.main.inprocess import engine_in_process
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import combine, expert_forward, split_by_expert
from odmoe.models.main_model import build_main_model
from odmoe.shadow.shadow_model import load_shadow_model, router_modules
from odmoe.worker.expert_store import DeviceSlots, ExpertStore
from tests.conftest import FAMILY_NAMES, FOCUSED_FAMILIES, generate_together
from tests.test_batched_decode import _alone, _requests, serve_with_logits
from tests.tiny_configs import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = "cuda"
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    " * 3]  # the second: a longer prefill
NEW_TOKENS = 16


def gpu_words(dtype: str = "bfloat16", shadow: str = "bf16") -> list[str]:
    return [
        f"model.dtype={dtype}",
        "model.device=cuda",
        "worker.device=cuda",
        "shadow.device=cuda",
        f"shadow.precision={shadow}",
        "cluster.torch_threads=1",
    ]


def reference_on(path: str, prompt: str, dtype: torch.dtype, new_tokens: int = NEW_TOKENS) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CUDA)
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")["input_ids"].to(CUDA)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
    return out[0, ids.shape[1] :].tolist()


# -- 1. device slots -------------------------------------------------------------------------------
def test_slots_load_pinned_experts_on_their_own_stream(model_dirs):
    ckpt = Checkpoint(model_dirs["mixtral"])
    store = ExpertStore.build(ckpt, ckpt.moe_layers, torch.bfloat16, pin_memory=True)
    assert all(store[k].gate_up.is_pinned() and store[k].down.is_pinned() for k in store.keys())
    slots = DeviceSlots(store, torch.device(CUDA), slots=2)
    assert slots.copier.stream != torch.cuda.current_stream()
    a = slots.load_async((0, 1), tag=("r", 1))
    b = slots.load_async((1, 2), tag=("r", 1))
    for slot, key in ((a, (0, 1)), (b, (1, 2))):
        slot.wait_filled()  # the enqueue; the copy itself may still run
        probe = slots.await_on_device(slot)  # this stream waits for it on the GPU
        # read on this stream, after the wait: the copy's bits (a float sum would compare the GPU's
        # and the CPU's reduction orders, not the copy)
        assert torch.equal(slot.gate_up, store[key].gate_up.to(CUDA))
        assert torch.equal(slot.down, store[key].down.to(CUDA))
        assert slots.device_wait_s(slot, probe) >= 0.0
        slots.settle(slot)
        assert slot.load_s > 0.0 and slot.nbytes == store[key].nbytes
        assert torch.equal(slot.gate_up.cpu(), store[key].gate_up)
        slots.evict(slot)
    assert slots.counters.loads == 2 and slots.counters.load_s > 0.0


def test_bus_peak_is_measured():
    from odmoe.worker.device_slots import host_to_device_peak

    assert host_to_device_peak(CUDA, 64 << 20, repeats=2) > 1e9  # any PCIe/NVLink moves > 1 GB/s


# -- 3. the worker's kernel on the GPU -------------------------------------------------------------
def worker_equivalent(experts, hidden, top_k_index, top_k_weights, kernel):
    """What main + workers compute: rows split on main's device, each expert on its own, combined."""
    parts = []
    shape = (top_k_index.numel(), experts.num_experts)
    for rows in split_by_expert(top_k_index, experts.num_experts, kernel):
        x = hidden[rows.token_idx].cpu().to(CUDA)  # the wire: through host memory
        gate_up = experts.gate_up_proj[rows.expert].detach().clone()  # a slot: its own allocation
        down = experts.down_proj[rows.expert].detach().clone()
        y = expert_forward(x, gate_up, down, experts.config.hidden_act, kernel, shape)
        parts.append((rows, y.cpu().to(CUDA)))
    return combine(hidden, parts, top_k_weights, kernel)


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 64, 300, 700])
def test_worker_kernel_equals_transformers_on_cuda(family, kernel, dtype, tokens):
    torch.manual_seed(tokens)
    # wide enough (N > 128) that PyTorch's grouped kernel can choose between its two tile shapes
    config = TINY[family]()
    for name in ("intermediate_size", "moe_intermediate_size"):
        if hasattr(config, name):
            setattr(config, name, 256)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=kernel).to(CUDA)
    block = model.model.layers[1].mlp
    hidden = torch.randn(tokens, model.config.hidden_size, device=CUDA).to(dtype)
    _, weights, index = block.gate(hidden)
    with torch.no_grad():
        want = block.experts(hidden, index, weights)
        got = worker_equivalent(block.experts, hidden, index, weights, kernel)
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"


# -- 2. main and shadow on the GPU -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_main_model_on_cuda_equals_transformers(family, model_dirs):
    """Main's skeleton on the GPU with a local expert call = the full model's logits on the GPU."""
    path = model_dirs[family]
    ckpt = Checkpoint(path)
    main = build_main_model(ckpt, torch.bfloat16, CUDA)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA).eval()
    modules = dict(
        (int(n.split(".layers.")[1].split(".")[0]), m)
        for n, m in full.named_modules()
        if n.endswith(".experts")
    )

    def local(layer, hidden, index, weights):
        return worker_equivalent(modules[layer], hidden, index, weights, main.kernel)

    main.attach(local)
    ids = torch.arange(5, 25, device=CUDA)[None]
    with torch.inference_mode():
        assert torch.equal(main.model(input_ids=ids).logits, full(input_ids=ids).logits)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8", "nf4"])
def test_shadow_runs_on_cuda(precision, model_dirs):
    pytest.importorskip("bitsandbytes")
    model = load_shadow_model(model_dirs["mixtral"], precision, CUDA)
    assert router_modules(model, 8)
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[5, 6, 7]], device=CUDA)).logits
    assert logits.is_cuda and torch.isfinite(logits).all()
    assert torch.cuda.max_memory_allocated() > 0


# -- 3. whole clusters on the GPU ------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cluster_on_cuda_equals_generate(family, model_dirs, reap_children):
    path = model_dirs[family]
    with LocalCluster(path, workers=4, group_size=2, overrides=gpu_words()) as cluster:
        stats = []
        for prompt in PROMPTS:
            got = cluster.client.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert got.token_ids == reference_on(path, prompt, torch.bfloat16), f"{family} on {prompt!r}"
            stats.append(got.stats)
        peaks = got.stats["device_peak_bytes"]
        assert set(peaks) == {"main", "shadow", "worker0", "worker1", "worker2", "worker3"}
        assert all(b > 0 for b in peaks.values()), peaks
        # experts were loaded onto the device (the first requests at least: by the last one the workers'
        # caches may hold every expert it needs, and it loads nothing)
        assert sum(s["worker_load_s"] for s in stats) > 0 and sum(s["bytes_loaded"] for s in stats) > 0


@pytest.mark.integration
@pytest.mark.parametrize("family", FOCUSED_FAMILIES)
def test_focused_family_cluster_on_cuda_equals_generate(family, model_dirs, reap_children):
    """The families added after the core six (GLM-4.5, Phi-3.5-MoE, Qwen3-Next, Qwen3.5-MoE, gpt-oss,
    Llama 4, ERNIE 4.5): their experts' kernels (gpt-oss's transposed layout, Llama 4's bmm) on CUDA."""
    path = model_dirs[family]
    with LocalCluster(path, workers=2, group_size=2, overrides=gpu_words()) as cluster:
        for prompt in PROMPTS:
            got = cluster.client.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert got.token_ids == reference_on(path, prompt, torch.bfloat16), f"{family} on {prompt!r}"


@pytest.mark.integration
@pytest.mark.parametrize("dtype,shadow", [("float32", "int8"), ("float16", "nf4"), ("bfloat16", "fp16")])
def test_cluster_on_cuda_with_quantized_shadows(dtype, shadow, model_dirs, reap_children):
    pytest.importorskip("bitsandbytes")
    path = model_dirs["mixtral"]
    with LocalCluster(path, workers=2, group_size=2, overrides=gpu_words(dtype, shadow)) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert got.token_ids == reference_on(path, PROMPTS[0], getattr(torch, dtype))
        assert got.stats["recall"]["overall"] is not None


# -- 4. many requests at once ----------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(BATCHED_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_decode_on_cuda_gives_each_request_its_alone_bits(model_dirs, family, dtype):
    engine, _ = engine_in_process(model_dirs[family], dtype, device=CUDA, max_running=4)
    assert engine.batched is not None
    passes: list[int] = []
    step = engine.batched.step
    engine.batched.step = lambda inputs, hook: passes.append(len(inputs)) or step(inputs, hook)
    got = serve_with_logits(engine, _requests())
    assert max(passes) == 4
    for request in _requests():
        tokens, final = _alone(engine, request)
        assert got[request.request_id][0] == tokens, f"{family} {request.request_id}"
        assert torch.equal(got[request.request_id][1], final), f"{family} {request.request_id}"
    verdicts = engine.batched.row_exact.verdicts
    print(f"{family} {dtype}: bmm exact on {sum(verdicts.values())} of {len(verdicts)} shapes")


@pytest.mark.integration
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_concurrent_clients_on_cuda_each_get_generate_tokens(family, model_dirs, reap_children):
    path = model_dirs[family]
    prompts = [*PROMPTS, "x = [", "for i in range(10):\n    print("]
    wanted = {p: reference_on(path, p, torch.bfloat16) for p in prompts}
    with LocalCluster(path, workers=2, group_size=2, overrides=gpu_words()) as cluster:
        assert generate_together(cluster, prompts, NEW_TOKENS) == wanted


# -- 5. GGUF files (issue 46) ----------------------------------------------------------------------
GGUF_ON_CUDA = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0"]  # Q5_0: dequantized by the package, then moved


@pytest.mark.parametrize("kind", GGUF_ON_CUDA)
def test_gguf_blocks_dequantize_on_cuda_to_the_package_bit(kind):
    """A CUDA worker's slot: the stored blocks copied to the GPU and dequantized there (into float32
    and bfloat16, one cast as transformers) give the gguf package's own bits."""
    gguf = pytest.importorskip("gguf")
    from odmoe.models.gguf_blocks import dequantize, dequantize_into

    kind = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(11 + int(kind))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 24, 2 * max(block_values, 256)
    raw = rng.integers(0, 256, size=(rows, cols // block_values * block_bytes), dtype=np.uint8)
    want = torch.from_numpy(gguf.dequantize(raw, kind).astype(np.float32).reshape(rows, cols))
    got = dequantize(torch.from_numpy(raw.copy()).to(CUDA), int(kind), (rows, cols))
    assert got.device.type == "cuda"
    _same_bits_but_nan_payloads(got.cpu(), want)
    for dtype in (torch.float32, torch.bfloat16):
        slot = torch.full((rows, cols), 7.0, dtype=dtype, device=CUDA)
        dequantize_into(torch.from_numpy(raw.copy()).reshape(-1).to(CUDA), int(kind), slot)
        _same_bits_but_nan_payloads(slot.cpu(), want.to(dtype))


def _same_bits_but_nan_payloads(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every value's bits equal, NaN where the package has NaN: random bytes make NaN and infinite
    scales, and CUDA's arithmetic gives a NaN its canonical payload (numpy's keeps the operand's)."""
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"NaN at {int((got.isnan() != nan).sum())} other places"
    differ = int((got.view(bits) != want.view(bits))[~nan].sum())
    assert differ == 0, f"{differ} of {int((~nan).sum())} values differ ({got.dtype})"


@pytest.mark.integration
@pytest.mark.parametrize("family, qtype", [("qwen3_moe", "Q4_K_M"), ("qwen2_moe", "Q8_0")])
def test_gguf_cluster_on_cuda_equals_transformers_gguf_loading(gguf_file, family, qtype, reap_children):
    """Every node on the GPU serving a GGUF file: the tokens of transformers' own GGUF loading on the
    same device (float32, as the file is loaded), the workers moving each expert's blocks as stored."""
    pytest.importorskip("gguf")
    from odmoe.models.gguf_checkpoint import GgufCheckpoint
    from odmoe.models.open_model import load_tokenizer
    from tests.test_gguf_checkpoint import reference_model

    path = gguf_file(family, qtype)
    model = reference_model(path).to(CUDA)
    ids = load_tokenizer(path)(PROMPTS[0], return_tensors="pt")["input_ids"].to(CUDA)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    want = out[0, ids.shape[1] :].tolist()
    model.cpu()
    words = [*gpu_words("auto", "bf16"), "preset=paper"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    assert got.token_ids == want
    checkpoint = GgufCheckpoint(path)
    stored = [checkpoint.quantized_expert(layer, 0).nbytes for layer in checkpoint.moe_layers]
    per_expert = got.stats["bytes_loaded"] / got.stats["experts_loaded"]
    assert min(stored) <= per_expert <= max(stored)  # the blocks as stored crossed, not float32
