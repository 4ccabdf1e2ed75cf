import msgpack
import pytest
import torch

from odmoe.transport.codec import CodecError, decode, encode
from odmoe.transport.messages import ComputeExperts, ExpertsResult, Step, from_frames, to_frames

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 2), (0, 4), (1,), ()])
def test_round_trip_is_bit_exact(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    header, (back,) = decode(encode({"x": 1}, [t]))
    assert header == {"x": 1}
    assert back.dtype == dtype and back.shape == t.shape
    # compare bytes, not values: -0.0 vs 0.0 or NaN payloads must survive too
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_non_contiguous_input_travels_as_its_values():
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    _, (back,) = decode(encode({}, [t]))
    assert torch.equal(back, t)


def test_messages_round_trip():
    msg = ComputeExperts.single(Step("r1", 3, 5), 6, "eager", 2, positions=[[0, 1]])
    back, (x,) = from_frames(to_frames(msg, [torch.ones(2, 3)]))
    assert back == msg and torch.equal(x, torch.ones(2, 3))
    res = ExpertsResult(
        step=Step("r1", 3, 5),
        worker=1,
        experts=[6],
        load_s=[0.1],
        compute_s=[0.2],
        bytes_loaded=[9],
        preloaded=[True],
        waited_s=[0.0],
        peak_rss=10,
        part=2,
    )
    assert from_frames(to_frames(res))[0] == res


def test_malformed_messages_are_rejected():
    frames = encode({}, [torch.ones(4)])
    with pytest.raises(CodecError, match="bytes"):
        decode([frames[0], b"\x00" * 3])
    with pytest.raises(CodecError, match="frames follow"):
        decode([frames[0]])
    with pytest.raises(CodecError, match="header"):
        decode([b"\xc1garbage"])
    with pytest.raises(CodecError, match="unknown message kind"):
        from_frames([msgpack.packb({"kind": "nope", "_tensors": []})])


@pytest.mark.parametrize("offset", [4, 8, 12])
def test_a_tensor_received_off_alignment_is_decoded_aligned(offset):
    """ZeroMQ puts a long message's bytes 8 bytes off a 16-byte boundary; the CPU's float32 matmul
    gave other last bits for such rows (AMD EPYC, MKL), so a cluster's fp32 logits were close to
    transformers' but not equal. Decoded tensors start where torch's own allocations do."""
    from odmoe.transport.codec import ALIGN

    t = torch.randn(3, 16)
    header, frame = encode({}, [t])
    data = bytes(frame)
    raw = bytearray(len(data) + 128)
    base = (-torch.frombuffer(raw, dtype=torch.uint8).data_ptr()) % 64
    view = memoryview(raw)[base + offset : base + offset + len(data)]
    view[:] = data
    _, (back,) = decode([header, view])
    assert back.data_ptr() % ALIGN == 0 and torch.equal(back, t)
