"""The pread reader gives safetensors' own bytes, into buffers of the caller's, and maps nothing."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odmoe.models.checkpoint import Checkpoint
from odmoe.models.safetensors_file import SafetensorsError, SafetensorsFile
from odmoe.node_memory import process_memory
from tests.conftest import FAMILY_NAMES

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.fixture
def mixed_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, 4, 2, generator=g),
        "f16": torch.randn(6, generator=g).to(torch.float16),
        "fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(10),
        "u8": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_every_tensor_reads_as_safe_open_reads_it(mixed_file):
    path, tensors = mixed_file
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    with safe_open(path, "pt") as reference:
        for key in tensors:
            assert _same(f.read(key), reference.get_tensor(key)), key
            info = f.info(key)
            assert info.dtype == tensors[key].dtype and info.shape == tuple(tensors[key].shape)


def test_rows_and_reads_into_a_given_buffer(mixed_file):
    path, tensors = mixed_file
    f = SafetensorsFile(path)
    for i in range(5):
        assert _same(f.read_rows("bf16", i), tensors["bf16"][i])
    out = torch.empty(3, 4, 2)
    assert f.read("f32", out) is out and _same(out, tensors["f32"])
    row = torch.empty(4, 2)
    f.read_rows("f32", 2, row)
    assert _same(row, tensors["f32"][2])
    with pytest.raises(SafetensorsError, match="no row 5"):
        f.read_rows("bf16", 5)
    with pytest.raises(SafetensorsError, match="cannot read"):
        f.read("f32", torch.empty(3, 4, 2, dtype=torch.float16))
    with pytest.raises(SafetensorsError, match="not in"):
        f.read("missing")


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(SafetensorsError):
        SafetensorsFile(bad)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="too short"):
        SafetensorsFile(short)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_expert_into_a_buffer_is_the_expert_at_that_dtype(model_dirs, family):
    ckpt = Checkpoint(model_dirs[family])
    gate_up_shape, down_shape = ckpt.expert_shapes()
    for dtype in (torch.float32, torch.bfloat16):
        assert ckpt.expert_bytes(dtype) == (gate_up_shape.numel() + down_shape.numel()) * dtype.itemsize
        for layer in ckpt.moe_layers[:2]:
            for e in (0, ckpt.num_experts - 1):
                w = ckpt.expert(layer, e)
                gate_up, down = torch.empty(gate_up_shape, dtype=dtype), torch.empty(down_shape, dtype=dtype)
                ckpt.expert_into(layer, e, gate_up, down)
                assert _same(gate_up, w.gate_up.to(dtype)) and _same(down, w.down.to(dtype))
                ckpt.forget_expert(layer, e)  # advice only: nothing to see but that it does not fail


def test_reading_maps_nothing_of_the_file(tmp_path):
    """The point of the reader: what it read lives in its buffer only, not also in mapped pages
    (safetensors 0.8's safe_open hands out tensors over its mmap: every page touched stays resident
    as file-backed memory while the file is open, and a copy made from them sits beside it)."""
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.ones(64, 1 << 20, dtype=torch.uint8)}, str(path))  # 64 MiB
    f = SafetensorsFile(path)
    before = process_memory().file_backed
    rows = [f.read_rows("w", i) for i in range(64)]
    assert sum(int(r.sum()) for r in rows) == 64 << 20  # every page touched
    assert process_memory().file_backed - before < 8 << 20


def test_a_tensor_read_sits_where_a_memory_map_would_put_it(mixed_file):
    """from_pretrained computes with tensors over safetensors' mmap; oneMKL's matmul bits depend on
    the operands' alignment, so main's tensors keep the file's alignment (a fresh 64-byte aligned
    lm_head gave other final logits than the reference: tests/test_cache_cluster.py)."""
    path, tensors = mixed_file
    f = SafetensorsFile(path)
    with safe_open(path, "pt") as reference:
        for key in ("bf16", "f32", "i64", "u8"):
            got, mapped = f.read(key), reference.get_tensor(key)
            assert got.data_ptr() % 4096 == f.info(key).start % 4096 == mapped.data_ptr() % 4096, key
            assert _same(got, mapped)
