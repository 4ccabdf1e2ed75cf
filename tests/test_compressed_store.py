"""The lossless compressed expert store: bit-field split, chunked codec, pack file, store forms."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odmoe.config import OdmoeConfig
from odmoe.launch import pack as pack_cli
from odmoe.models.checkpoint import Checkpoint
from odmoe.tools.memory import parse_bytes
from odmoe.tools.model_factory import ModelSpec, make_model
from odmoe.validation import validate
from odmoe.worker.bitfields import byte_view, join_into, split
from odmoe.worker.compressed_tensor import CorruptChunkError, MemoryBytes, compress, decompress
from odmoe.worker.expert_pack import ExpertPack, PackError, pack_path, write_pack
from odmoe.worker.expert_store import DeviceSlots, ExpertStore

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INTS = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INTS[t.element_size()])


def random_bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is possible (NaN payloads, subnormals, both zeros), plus each special value."""
    g = torch.Generator().manual_seed(seed)
    ints = INTS[dtype.itemsize]
    info = torch.iinfo(ints)
    t = torch.randint(info.min, info.max, (n,), dtype=ints, generator=g).view(dtype).clone()
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, torch.finfo(dtype).tiny / 4]
    specials += [-torch.finfo(dtype).tiny / 8, torch.finfo(dtype).max, torch.finfo(dtype).min]
    specials = torch.tensor(specials, dtype=dtype)
    k = min(n, len(specials))
    t[:k] = specials[:k]
    if n > k:  # a NaN with a payload other than torch's default one
        t.view(ints)[k] = torch.tensor(-1, dtype=ints)
    return t


def weights_like(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 3000),
    chunk=st.integers(1, 700),
    seed=st.integers(0, 2**31),
    weights=st.booleans(),
)
def test_round_trip_restores_every_bit(dtype, n, chunk, seed, weights):
    t = weights_like(n, dtype, seed) if weights else random_bits(n, dtype, seed)
    ct, data = compress(t, chunk_elems=chunk)
    assert len(ct.chunks) == -(-n // chunk)
    out = decompress(ct, MemoryBytes(data))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (1,), (7, 3), (3, 1, 5)])
def test_split_join_odd_and_empty_shapes(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    t = random_bits(n, dtype, seed=n).reshape(shape)
    exponent, rest = split(t)
    assert exponent.shape == (n,) and rest.shape == (n, dtype.itemsize - 1)
    out = torch.full(shape, 1.5, dtype=dtype)
    join_into(byte_view(out), exponent, rest, dtype)
    assert torch.equal(bits(out), bits(t))


def test_exponent_byte_is_the_exponent_field():
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)  # biased exponents 127, 128, 126
    assert split(t)[0].tolist() == [127, 128, 126]
    t32 = torch.tensor([1.0, -2.0, 0.5])
    assert split(t32)[0].tolist() == [127, 128, 126]


def test_weights_compress_below_raw_and_unsupported_dtype_is_refused():
    t = weights_like(200_000, torch.bfloat16, 0)
    ct, data = compress(t)
    assert len(data) == ct.nbytes < 0.75 * ct.raw_nbytes  # exponent ~3 bits of 8, sign+mantissa raw
    with pytest.raises(ValueError, match="no bit-field split"):
        compress(torch.zeros(4, dtype=torch.float64))


def test_flipped_byte_in_memory_is_detected():
    t = weights_like(5000, torch.bfloat16, 1)
    ct, data = compress(t, chunk_elems=1000)
    broken = bytearray(data)
    broken[ct.chunks[3].offset + 5] ^= 0x10
    with pytest.raises(CorruptChunkError, match="chunk 3: checksum mismatch"):
        decompress(ct, MemoryBytes(bytes(broken)))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    spec = ModelSpec(
        family="qwen2_moe", layers=2, hidden=32, intermediate=48, experts=4, top_k=2, vocab=300, seed=3
    )
    return Path(make_model(spec, tmp_path_factory.mktemp("m") / "qwen"))


def reference(model: Path, dtype: torch.dtype) -> ExpertStore:
    ckpt = Checkpoint(model)
    return ExpertStore.build(ckpt, ckpt.moe_layers, dtype)


def all_loads_equal(store: ExpertStore, ref: ExpertStore, use_async: bool = False) -> bool:
    slots = DeviceSlots(store, torch.device("cpu"), slots=2)
    for key in store.keys():
        slot = slots.load_async(key) if use_async else slots.load(key)
        slot.wait_filled()
        ok = torch.equal(bits(slot.gate_up), bits(ref[key].gate_up))
        ok = ok and torch.equal(bits(slot.down), bits(ref[key].down))
        ok = ok and torch.equal(bits(store[key].down), bits(ref[key].down))
        slots.evict(slot)
        if not ok:
            return False
    return True


def test_pack_command_end_to_end(small_model, tmp_path, capsys):
    out = tmp_path / "pack"
    args = [str(small_model), "--out", str(out), "--dtype", "bfloat16", "--chunk-elems", "500"]
    assert pack_cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "verified bit-exact" in printed
    assert "bfloat16  gate_up" in printed and "bfloat16  down" in printed
    path = pack_path(out, torch.bfloat16)
    assert path.is_file()
    ckpt = Checkpoint(small_model)
    pack = ExpertPack(path, ckpt)
    assert set(pack.experts) == {(layer, e) for layer in ckpt.moe_layers for e in range(4)}
    store = ExpertStore.build(ckpt, ckpt.moe_layers, torch.bfloat16, "disk", pack_dir=str(out))
    assert store.pack_path == str(path)
    assert "pack" in store.describe()
    assert all_loads_equal(store, reference(small_model, torch.bfloat16), use_async=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["memory", "compressed", "disk"])
def test_every_store_loads_the_exact_bits(small_model, tmp_path, kind, dtype):
    ckpt = Checkpoint(small_model)
    ref = reference(small_model, dtype)
    for pack_dir in (None, tmp_path):  # without, then with a pack file
        if pack_dir is not None:
            write_pack(ckpt, pack_dir, dtype, chunk_elems=300)
        store = ExpertStore.build(ckpt, ckpt.moe_layers, dtype, kind, pack_dir=str(pack_dir or tmp_path))
        assert all_loads_equal(store, ref), (kind, dtype, pack_dir)


def test_host_memory_budget_and_bytes_moved(small_model, tmp_path):
    ckpt = Checkpoint(small_model)
    dtype = torch.bfloat16
    write_pack(ckpt, tmp_path, dtype)
    full = ExpertStore.build(ckpt, ckpt.moe_layers, dtype, "compressed", pack_dir=str(tmp_path))
    assert full.holdings()["compressed"]["experts"] == 8
    per_expert = full.nbytes // 8
    half = ExpertStore.build(ckpt, ckpt.moe_layers, dtype, "compressed", per_expert * 4, str(tmp_path))
    held = half.holdings()
    assert held["compressed"]["experts"] + held["disk"]["experts"] == 8
    assert 1 <= held["compressed"]["experts"] <= 4 and half.nbytes <= per_expert * 4
    assert all_loads_equal(half, reference(small_model, dtype))
    raw = reference(small_model, dtype)
    raw_bytes = raw[raw.keys()[0]].nbytes
    slots = DeviceSlots(half, torch.device("cpu"))
    slots.evict(slots.load(half.keys()[-1]))  # from the pack on disk: compressed bytes cross the link
    assert 0 < slots.counters.bytes_loaded < raw_bytes
    mem = ExpertStore.build(ckpt, ckpt.moe_layers, dtype, "memory", raw_bytes * 3)
    assert mem.holdings()["decompressed"]["experts"] == 3 and mem.holdings()["disk"]["experts"] == 5
    assert mem.pack_path is None  # store=memory is the uncompressed path: it never reads the pack


def test_flipped_byte_in_pack_is_a_clear_error(small_model, tmp_path):
    ckpt = Checkpoint(small_model)
    path = write_pack(ckpt, tmp_path, torch.bfloat16)
    pack = ExpertPack(path, ckpt)
    chunk = pack[(1, 2)].down.chunks[0]
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.exponent_len + 1] ^= 0x01  # one bit of one mantissa
    path.write_bytes(bytes(data))
    disk = ExpertStore.build(ckpt, ckpt.moe_layers, torch.bfloat16, "disk", pack_dir=str(tmp_path))
    slots = DeviceSlots(disk, torch.device("cpu"))
    slots.evict(slots.load((0, 0)))  # other experts still load
    with pytest.raises(CorruptChunkError, match=r"expert \(1, 2\) down chunk 0: checksum mismatch"):
        slots.load((1, 2))
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):  # held in memory: caught at start
        ExpertStore.build(ckpt, ckpt.moe_layers, torch.bfloat16, "compressed", pack_dir=str(tmp_path))
    header = bytearray(path.read_bytes())
    header[30] ^= 0x01
    path.write_bytes(bytes(header))
    with pytest.raises(PackError, match="header checksum"):
        ExpertPack(path, ckpt)


def test_truncated_or_foreign_pack_is_refused(small_model, tmp_path):
    ckpt = Checkpoint(small_model)
    path = write_pack(ckpt, tmp_path / "p", torch.float32)
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(PackError, match="truncated"):
        ExpertStore.build(ckpt, ckpt.moe_layers, torch.float32, "disk", pack_dir=str(tmp_path / "p"))
    path.write_bytes(whole[:10])
    with pytest.raises(PackError, match="truncated"):
        ExpertPack(path)
    path.write_bytes(whole)
    other = tmp_path / "other"
    shutil.copytree(small_model, other)
    spec = ModelSpec(
        family="qwen2_moe", layers=2, hidden=32, intermediate=48, experts=4, top_k=2, vocab=300, seed=4
    )
    make_model(spec, other)  # same shapes, other weights
    with pytest.raises(PackError, match="another checkpoint"):
        ExpertPack(path, Checkpoint(other))


def test_pack_command_refuses_bad_input(tmp_path, capsys):
    assert pack_cli.main([str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_store_settings_are_validated():
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("") == 0 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")
    cfg = OdmoeConfig()
    cfg.worker.store = "zip"
    with pytest.raises(ValueError, match="worker.store='zip'"):
        validate(cfg)
    cfg.worker.store, cfg.worker.host_memory = "compressed", "12 parsecs"
    with pytest.raises(ValueError, match="worker.host_memory"):
        validate(cfg)
