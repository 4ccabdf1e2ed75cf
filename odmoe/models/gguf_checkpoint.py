"""Read a GGUF file (llama.cpp's format, as Ollama, LM Studio and llama.cpp serve it) tensor by tensor.

Contract: `GgufCheckpoint` answers what `Checkpoint` answers (config, family, weight map, `tensor`,
`expert`, `expert_into`, `quantized_expert`, headers-only sizes), for the file
`model.path=/models/Qwen3-30B-A3B-Q4_K_M.gguf` (or a directory plus `model.gguf_file=`; sharded
files `-00001-of-0000N.gguf` are read as one), with the numbers transformers' own GGUF loader gives
(`from_pretrained(dir, gguf_file=...)`, its legacy path in 5.24 for `qwen2moe` / `qwen3moe`):

- every tensor is the `gguf` package's `dequantize` of its bytes (float32; odmoe.models.gguf_blocks
  does the common types with torch, equal to the bit and fast enough for a worker's loads), passed through
  transformers' tensor processor for the architecture (Qwen's shared-expert gate gets its leading
  axis back), then cast to the parameter's dtype by the caller, as the loader casts;
- the names are transformers' own GGUF -> model map (`get_gguf_hf_weights_map` over a meta skeleton);
  a tensor the map does not name is not loaded, as transformers does not load it;
- an expert is a contiguous run of rows of the fused `blk.{l}.ffn_{gate,up,down}_exps` tensors
  ([E, I, H] / [E, H, I]); transformers puts gate then up into `gate_up_proj` [E, 2I, H], so
  `expert` gives (gate rows, up rows) fused the same way. `quantized_expert` hands a worker those
  rows' bytes as stored (`GgufExpert`, form "gguf"), which it dequantizes into its slot.
- the config is transformers' (`AutoConfig.from_pretrained(dir, gguf_file=...)`), with one
  difference: transformers 5.24's GGUF config map reads no `expert_feed_forward_length` (nor Qwen2's
  `expert_shared_feed_forward_length`), so it leaves `moe_intermediate_size` at the class default
  (768 for Qwen3-MoE, 1408 / 5632 for Qwen2-MoE) and refuses every file whose experts are another
  width. odmoe takes those widths from the file (logged where they differ); where they agree, as
  for Qwen3-30B-A3B, the config is transformers' own, and elsewhere it is what
  `from_pretrained(dir, gguf_file=..., config=that config)` loads.

Every tensor is read with `pread`s of its own bytes (no memory map stays resident). Refused at
open, before any tensor is read, with one line each: an architecture transformers cannot load from
GGUF as served here (Mixtral- or DeepSeek-shaped files; gpt-oss, whose experts transformers 5.24
leaves unread: its name map has `blk.N.ffn_down_exps` and `blk.N.attn_sinks` without the `.weight`
llama.cpp writes, maps no `ffn_gate_exps` / `ffn_up_exps` nor the experts' biases, and looks its
tensor processor up as `gpt_oss` where the file says `gpt-oss`, so every expert and sink stays
newly initialised — tests/test_gguf_checkpoint.py checks this still holds), a truncated or corrupt
file, a quantization type the `gguf` package cannot dequantize, shards that do not match.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from odmoe.models.checkpoint import Checkpoint, CheckpointError, ExpertWeights
from odmoe.models.families import UnsupportedModelError, family_of, is_expert_key, layer_of_key
from odmoe.models.gguf_blocks import dequantize, dequantize_into
from odmoe.models.gguf_files import shard_set
from odmoe.models.safetensors_file import TensorInfo

log = logging.getLogger("odmoe.models.gguf_checkpoint")

# general.architecture -> what odmoe serves it as (transformers' legacy GGUF loader reads these MoEs)
SERVED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# general.architecture of MoE files transformers 5.24 does not load as the model they are
NOT_LOADED = {
    "gpt-oss": "transformers 5.24 maps none of its experts, their biases or its attention sinks from "
    "GGUF (they stay newly initialised); its safetensors release (MXFP4) is served",
    "llama": "transformers reads a llama GGUF as a dense Llama, not as a Mixtral MoE",
    "deepseek2": "transformers cannot load DeepSeek's architecture from GGUF",
    "minimax-m2": "odmoe does not serve MiniMax-M2",
}
_EXPERTS = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<w>gate|up|down)_exps\.weight$")
_WIDTHS = (  # (config field transformers leaves at its default, the GGUF key that holds it)
    ("moe_intermediate_size", "expert_feed_forward_length"),
    ("shared_expert_intermediate_size", "expert_shared_feed_forward_length"),
)


def gguf_location(path: str | Path) -> tuple[Path, str]:
    """(directory, file name) as transformers' `from_pretrained(dir, gguf_file=...)` takes them: of a
    sharded set the first shard, which holds the metadata (config, tokenizer, chat template)."""
    first = shard_files(Path(path).expanduser(), check=False)[0]
    return first.parent, first.name


def shard_files(path: Path, check: bool = True) -> list[Path]:
    """Every shard of `path` (a file; `-0000K-of-0000N.gguf` names its N shards), in order."""
    files = shard_set(path)
    missing = [f.name for f in files if not f.is_file()]
    if missing and check:
        raise CheckpointError(f"{path}: shards missing beside it: {', '.join(missing)}")
    return files


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's bytes are and how they are stored."""

    name: str
    file: int  # index of its shard
    start: int  # absolute byte offset in that shard
    nbytes: int
    ggml_type: int
    shape: tuple[int, ...]  # values, numpy order ([E, rows, cols] for stacked experts)
    stored: tuple[int, ...]  # what `dequantize` is handed: values for F32/F16, else [..., row bytes] uint8

    def row_range(self, first_axis_index: int) -> tuple[int, int]:
        """(offset, bytes) of slice `first_axis_index` of the first axis (an expert of [E, ...])."""
        row = self.nbytes // self.shape[0]
        return self.start + first_axis_index * row, row


@dataclass(frozen=True)
class GgufMatrix:
    """Rows of one GGUF tensor as stored (one expert's slice of `ffn_*_exps`)."""

    raw: torch.Tensor  # uint8 bytes, as in the file
    ggml_type: int
    shape: tuple[int, int]  # [rows, cols] values

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def values(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [rows, cols] on `device` (the stored bytes moved there first), exactly as
        transformers dequantizes it."""
        return dequantize(self.raw.to(device), self.ggml_type, self.shape)


@dataclass(frozen=True)
class GgufExpert:
    """One routed expert as a GGUF file stores it: its rows of the gate, up and down tensors."""

    gate: GgufMatrix  # [I, H]
    up: GgufMatrix  # [I, H]
    down: GgufMatrix  # [H, I]
    form = "gguf"

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @property
    def shapes(self) -> tuple[torch.Size, torch.Size]:
        """(gate_up [2I, H], down [H, I]): the fused layout transformers computes with."""
        rows, cols = self.gate.shape
        return torch.Size([rows + self.up.shape[0], cols]), torch.Size(self.down.shape)

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Dequantized into a slot's tensors (float32, then cast by the copy as transformers casts):
        gate rows first, as transformers fuses them."""
        rows, device = self.gate.shape[0], down.device  # dequantized where the slot is: bytes move
        dequantize_into(self.gate.raw.to(device), self.gate.ggml_type, gate_up[:rows])
        dequantize_into(self.up.raw.to(device), self.up.ggml_type, gate_up[rows:])
        dequantize_into(self.down.raw.to(device), self.down.ggml_type, down)


class GgufCheckpoint(Checkpoint):
    """A GGUF file read as `Checkpoint` reads safetensors (module contract)."""

    def __init__(self, path: str | Path):  # noqa: PLR0915 - one straight line of checks
        path = Path(path).expanduser()
        try:
            import gguf  # noqa: F401 - an extra: say so in one line rather than a traceback
        except ImportError as exc:
            raise CheckpointError(
                f"{path}: reading GGUF files needs the gguf package: pip install 'odmoe[gguf]'"
            ) from exc
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        self.files = shard_files(path)
        self.path = self.files[0]  # a sharded set is named by its first shard, whichever was given
        self.wrapper = None
        self.fp8 = None
        self.mxfp4 = False
        self.disk_key = {}
        self._handles = {}
        self.tensors = self._read_headers()
        self.architecture = self._architecture()
        self.config = self._config()
        self.family = family_of(self.config)
        self._fds = [os.open(f, os.O_RDONLY) for f in self.files]
        self.weight_map = self._names()
        self.moe_layers = sorted({layer_of_key(k) for k in self.weight_map if is_expert_key(k)} - {None})
        if not self.moe_layers:
            raise UnsupportedModelError(f"{self.path} holds no routed-expert tensors (ffn_*_exps)")

    # -- opening: every check before a tensor is read ------------------------------------------------

    def _read_headers(self) -> dict[str, GgufTensor]:
        from gguf import GGMLQuantizationType, GGUFReader

        tensors: dict[str, GgufTensor] = {}
        self.metadata: dict[str, object] = {}
        count = len(self.files)
        for index, file in enumerate(self.files):
            try:
                reader = GGUFReader(file)
            except (ValueError, KeyError, IndexError, OSError) as exc:  # a bad magic, a cut file, ...
                raise CheckpointError(_unreadable(file, exc)) from exc
            fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
            if index == 0:
                self.metadata = fields
            declared = int(fields.get("split.count", 1))  # type: ignore[call-overload]
            number = int(fields.get("split.no", 0))  # type: ignore[call-overload]
            if declared != count or number != index:
                raise CheckpointError(
                    f"{file}: shard {number + 1} of {declared} by its metadata, "
                    f"found as {index + 1} of {count}: the shards do not match"
                )
            size = file.stat().st_size
            for t in reader.tensors:
                kind = int(t.tensor_type)
                if t.data_offset + t.n_bytes > size:
                    raise CheckpointError(
                        f"{file}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes:,}, "
                        f"the file has {size:,}"
                    )
                shape = tuple(int(n) for n in reversed(t.shape.tolist()))
                tensors[t.name] = GgufTensor(
                    t.name, index, int(t.data_offset), int(t.n_bytes), kind, shape, tuple(t.data.shape)
                )
                _check_dequantizable(file, t.name, GGMLQuantizationType(kind))
            del reader
        want = self.metadata.get("split.tensors.count")
        if want is not None and int(want) != len(tensors):  # type: ignore[call-overload]
            raise CheckpointError(
                f"{self.path}: the shards hold {len(tensors)} tensors, the first says {int(want)}: "  # type: ignore[call-overload]
                "the shards do not match"
            )
        return tensors

    def _architecture(self) -> str:
        arch = str(self.metadata.get("general.architecture", ""))
        if arch in SERVED:
            return arch
        experts = self.metadata.get(f"{arch}.expert_count")
        why = NOT_LOADED.get(arch, "transformers cannot load it from GGUF as an MoE served here")
        raise UnsupportedModelError(
            f"{self.path}: a GGUF file of architecture {arch!r}"
            + (f" ({experts} experts)" if experts else "")
            + f": not served ({why}); odmoe serves GGUF files of {', '.join(SERVED)} "
            "(Qwen2-MoE, Qwen3-MoE), and safetensors checkpoints of every family in its README"
        )

    def _config(self):
        import transformers

        config = transformers.AutoConfig.from_pretrained(self.path.parent, gguf_file=self.files[0].name)
        for field, key in _WIDTHS:
            stored = self.metadata.get(f"{self.architecture}.{key}")
            if stored is None or not hasattr(config, field) or getattr(config, field) == int(stored):  # type: ignore[call-overload]
                continue
            log.info(
                "%s: %s=%d from the file's %s (transformers %s's GGUF config leaves it at %d and its "
                "from_pretrained refuses this file without config=)",
                self.path,
                field,
                int(stored),  # type: ignore[call-overload]
                key,
                transformers.__version__,
                getattr(config, field),
            )
            setattr(config, field, int(stored))  # type: ignore[call-overload]
        # transformers: tied where no tensor is `output.weight`, looking at the one file it reads; of a
        # sharded set the head may be in another shard
        config.tie_word_embeddings = "output.weight" not in self.tensors
        return config

    def _names(self) -> dict[str, str]:
        """The model's name -> the file's, as transformers maps them; experts as fused keys."""
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

        from odmoe.models.load_dtypes import meta_skeleton

        self._processor = TENSOR_PROCESSORS[self.architecture](config=self.config.to_dict())
        skeleton = meta_skeleton(copy.deepcopy(self.config), torch.float32)  # leaves config.dtype alone
        gguf_to_hf = get_gguf_hf_weights_map(skeleton, self._processor)
        weight_map: dict[str, str] = {}
        for name in self.tensors:
            if m := _EXPERTS.match(name):
                fused = "gate_up_proj" if m["w"] in ("gate", "up") else "down_proj"
                weight_map[self.family.fused_key(int(m["layer"]), fused)] = name
            elif name in gguf_to_hf:
                weight_map[gguf_to_hf[name]] = name
            else:
                log.debug("%s: %s is not loaded (transformers maps it to no parameter)", self.path, name)
        return weight_map

    # -- reading -------------------------------------------------------------------------------------

    def _raw(self, t: GgufTensor, start: int, nbytes: int) -> np.ndarray:
        buffer = bytearray(nbytes)
        view, done = memoryview(buffer), 0
        while done < nbytes:
            n = os.preadv(self._fds[t.file], [view[done:]], start + done)
            if n == 0:
                raise CheckpointError(f"{self.files[t.file]}: ended inside tensor {t.name}")
            done += n
        return np.frombuffer(buffer, dtype=np.uint8)

    def tensor(self, key: str) -> torch.Tensor:
        """A non-expert tensor in float32, as transformers' loader has it before its cast."""
        if key not in self.weight_map:
            raise CheckpointError(f"tensor {key} is not in {self.path}")
        t = self.tensors[self.weight_map[key]]
        values = dequantize(torch.from_numpy(self._raw(t, t.start, t.nbytes)), t.ggml_type, t.shape).numpy()
        values = self._processor.process(weights=values, name=t.name).weights
        return torch.from_numpy(np.copy(values))

    def tensor_info(self, key: str) -> TensorInfo:
        """The tensor's shape as the model has it, float32 (what it dequantizes to), and its bytes in
        the file (`nbytes`; for `gate_up_proj` the gate's and the up's together): headers only."""
        if key not in self.weight_map:
            raise CheckpointError(f"tensor {key} is not in {self.path}")
        t = self.tensors[self.weight_map[key]]
        shape, nbytes = t.shape, t.nbytes
        if key.endswith("experts.gate_up_proj"):  # gate and up, fused as transformers fuses them
            shape, nbytes = (shape[0], 2 * shape[1], shape[2]), 2 * t.nbytes
        elif t.name.startswith("blk.") and "ffn_gate_inp_shexp" in t.name:  # [H] -> [1, H], as loaded
            shape = (1, *shape)
        return TensorInfo(torch.float32, shape, t.start, t.start + nbytes)

    def file_tensors(self, key: str) -> list[str]:
        """The file's tensors behind one of the model's keys (a fused gate_up_proj: the gate's and the
        up's): what a node pulls to have that key (launch.pull)."""
        name = self.weight_map[key]
        if key.endswith("experts.gate_up_proj") and (m := _EXPERTS.match(name)):
            return [f"blk.{m['layer']}.ffn_{w}_exps.weight" for w in ("gate", "up")]
        return [name]

    def _expert_tensors(self, layer: int) -> tuple[GgufTensor, GgufTensor, GgufTensor]:
        return tuple(self.tensors[f"blk.{layer}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))  # type: ignore[return-value]

    def quantized_expert(self, layer: int, expert: int) -> GgufExpert:  # type: ignore[override]
        parts = []
        for t in self._expert_tensors(layer):
            start, nbytes = t.row_range(expert)
            raw = torch.from_numpy(self._raw(t, start, nbytes))  # a buffer of its own
            parts.append(GgufMatrix(raw, t.ggml_type, (t.shape[1], t.shape[2])))
        return GgufExpert(*parts)

    @property
    def quantized_experts(self) -> str:
        return "gguf"

    def expert_shapes(self) -> tuple[torch.Size, torch.Size]:
        gate, _, down = self._expert_tensors(self.moe_layers[0])
        return torch.Size([2 * gate.shape[1], gate.shape[2]]), torch.Size(down.shape[1:])

    def _plain_expert_keys(self, layer: int, expert: int) -> None:  # type: ignore[override]
        return None  # never the bytes a worker computes with: dequantized on every read

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        q = self.quantized_expert(layer, expert)
        gate_up, down = (torch.empty(shape, dtype=torch.float32) for shape in q.shapes)
        q.load_into(gate_up, down)
        return ExpertWeights(gate_up, down)

    def expert_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        q = self.quantized_expert(layer, expert)
        q.load_into(gate_up, down)
        return q.nbytes

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _check_dequantizable(file: Path, name: str, kind) -> None:
    """A type the `gguf` package cannot dequantize is refused at open, not at the first load."""
    from gguf import GGML_QUANT_SIZES
    from gguf import dequantize as gguf_dequantize

    if kind.value in (0, 1):
        return
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    try:
        gguf_dequantize(np.zeros((1, block_bytes), dtype=np.uint8), kind)
    except (NotImplementedError, KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{file}: tensor {name} is stored as {kind.name}, which the gguf package cannot dequantize "
            f"({exc}); nothing here can serve it"
        ) from exc


def _unreadable(file: Path, exc: Exception) -> str:
    """One line for a file the gguf package's reader could not parse."""
    unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
    if unknown:
        return (
            f"{file}: a tensor is stored as ggml type {unknown[1]}, a quantization type the gguf package "
            "does not know (a newer llama.cpp's?); nothing here can dequantize it"
        )
    return f"{file}: not a readable GGUF file: truncated or corrupt ({exc})"
