"""Read a local Hugging Face MoE checkpoint tensor by tensor.

Contract: nothing here loads a whole checkpoint. `Checkpoint` knows the config and the weight map
(`model.safetensors.index.json`, or the single `model.safetensors`), and hands out either the
non-expert tensors (what main needs) or one expert's three matrices (what a worker needs), read
with `pread`s of those bytes alone (odmoe.models.safetensors_file: no memory map stays resident
beside the copy), so other experts' bytes are never touched. `expert_into` reads an expert straight
into the buffers a worker computes from; `tensor_info` and `expert_bytes` answer from the files'
headers alone (a memory plan is made before anything is read).

What a real checkpoint may hold beyond the model transformers builds from its config: DeepSeek-V3's
multi-token-prediction layers (`num_nextn_predict_layers`, stored as `model.layers.{N}` and beyond
for N = `num_hidden_layers`) are used only for speculative training/decoding, never by
`generate()`; they are dropped from the weight map with a log line, so neither main nor any worker
reads them. Block-wise FP8 checkpoints (DeepSeek-V3's release: `weight_scale_inv` per block,
odmoe.models.fp8) are read as transformers reads them on a machine without FP8 kernels: main's
tensors and `expert` dequantized exactly so; `quantized_expert` hands a worker an expert as stored.
Other quantizations are refused.

A GGUF file is read by odmoe.models.gguf_checkpoint (the same interface); odmoe.models.open_model
opens either kind from a path.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from odmoe.models.checkpoint_index import SHARE_STATE
from odmoe.models.families import (
    Family,
    UnsupportedModelError,
    family_of,
    is_expert_key,
    layer_of_key,
    served_config,
)
from odmoe.models.fp8 import (
    SCALE_SUFFIX,
    BlockFp8,
    QuantizedExpert,
    QuantizedMatrix,
    block_fp8,
    dequantize,
    quantization_of,
    scale_key,
)
from odmoe.models.mxfp4 import Mxfp4Expert, Mxfp4Matrix
from odmoe.models.safetensors_file import SafetensorsFile, TensorInfo

log = logging.getLogger("odmoe.models.checkpoint")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _pulled_tensors(path: Path) -> frozenset[str] | None:
    """The tensors a pulled share holds (odmoe.models.share_pull's record), None for a whole checkpoint."""
    record = path / SHARE_STATE
    if not record.is_file():
        return None
    return frozenset(json.loads(record.read_text()).get("tensors", {}))


class CheckpointError(ValueError):
    """The directory is missing or is not a usable safetensors checkpoint."""


@dataclass(frozen=True)
class ExpertWeights:
    """One expert in the fused layout transformers computes with (gate rows first)."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]

    @property
    def nbytes(self) -> int:
        return (
            self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()
        )


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"model directory {self.path} does not exist")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{self.path} has no config.json: not a Hugging Face checkpoint")
        saved = AutoConfig.from_pretrained(self.path)
        self.config: PretrainedConfig
        self.config, self.wrapper = served_config(saved)
        self.family: Family = family_of(self.config)
        self.fp8: BlockFp8 | None = block_fp8(saved)  # raises on a quantization odmoe does not serve
        self.mxfp4 = quantization_of(saved).get("quant_method") == "mxfp4"
        if self.mxfp4 and self.family.expert_layout != "gpt_oss":
            raise UnsupportedModelError(f"MXFP4 experts are served for gpt-oss, not {self.family.model_type}")
        self.disk_key: dict[str, str] = {}  # a wrapped checkpoint: the text model's name -> its name on disk
        self._handles: dict[str, SafetensorsFile] = {}  # shard file name -> its reader
        weight_map = _read_weight_map(self.path, self._handles)
        if self.wrapper is not None:
            weight_map = _text_model_only(self, weight_map, saved.model_type)
        self.weight_map = _without_extra_layers(self.path, weight_map, int(self.config.num_hidden_layers))
        self.pulled = _pulled_tensors(self.path)  # a pulled share: only these hold bytes (None: all do)
        self.moe_layers = sorted({layer_of_key(k) for k in self.weight_map if is_expert_key(k)} - {None})
        if not self.moe_layers:
            raise UnsupportedModelError(f"{self.path} holds no routed-expert tensors")

    @property
    def num_experts(self) -> int:
        return int(getattr(self.config, self.family.num_experts_field))

    @property
    def top_k(self) -> int:
        return int(getattr(self.config, self.family.top_k_field))

    def _handle(self, key: str, reading: bool = True) -> SafetensorsFile:
        """`key`'s file; `reading` its bytes (not only its header entry): refused for a tensor a
        pulled share does not hold."""
        if key not in self.weight_map:
            raise CheckpointError(f"tensor {key} is not in {self.path}")
        if reading and self.pulled is not None and self.disk_key.get(key, key) not in self.pulled:
            raise CheckpointError(
                f"tensor {key} was not pulled to {self.path} (this box holds its share of the checkpoint "
                "only: odmoe.models.share_pull); its bytes there are a hole, never read"
            )
        shard = self.weight_map[key]
        if shard not in self._handles:
            self._handles[shard] = SafetensorsFile(self.path / shard)
        return self._handles[shard]

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle(key).read(self.disk_key.get(key, key))

    def tensor_info(self, key: str) -> TensorInfo:
        """A tensor's dtype, shape and bytes on disk, from its file's header (nothing read)."""
        return self._handle(key, reading=False).info(self.disk_key.get(key, key))

    def _read_into(self, key: str, row: int | None, out: torch.Tensor) -> None:
        """`key` (or its `row`-th slice) into `out`, converted to `out`'s dtype as `.to()` does."""
        handle, name = self._handle(key), self.disk_key.get(key, key)
        if handle.info(name).dtype == out.dtype and out.is_contiguous():
            handle.read(name, out) if row is None else handle.read_rows(name, row, out)
        else:
            out.copy_(handle.read(name) if row is None else handle.read_rows(name, row))

    def non_expert_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor but the routed experts, under the module names transformers uses (an FP8
        checkpoint's quantized ones dequantized to float32, as transformers does before its cast)."""
        return {
            self.family.module_key(key): self._dequantized(key)
            for key in self.weight_map
            if not is_expert_key(key) and not key.endswith(SCALE_SUFFIX)
        }

    def _dequantized(self, key: str) -> torch.Tensor:
        if self.fp8 is not None and scale_key(key) in self.weight_map:
            return dequantize(self.tensor(key), self.tensor(scale_key(key)))
        return self.tensor(key)

    def _slice(self, key: str, expert: int) -> torch.Tensor:
        return self._handle(key).read_rows(self.disk_key.get(key, key), expert)

    def quantized_expert(self, layer: int, expert: int) -> QuantizedExpert | Mxfp4Expert:
        """A quantized checkpoint's expert as stored (what a worker keeps in host memory)."""
        fam = self.family
        if self.mxfp4:  # gpt-oss: gate_up's then down's blocks, scales and bias, each fused [E, ...]
            parts = ("_blocks", "_scales", "_bias")
            keys = [fam.fused_key(layer, m) + part for m in ("gate_up_proj", "down_proj") for part in parts]
            rows = [self._slice(key, expert).contiguous() for key in keys]
            return Mxfp4Expert(Mxfp4Matrix(*rows[:3]), Mxfp4Matrix(*rows[3:]))
        keys = [fam.expert_key(layer, expert, p) for p in (fam.gate_proj, fam.up_proj, fam.down_proj)]
        if self.fp8 is None or any(scale_key(k) not in self.weight_map for k in keys):
            raise CheckpointError(
                f"{self.path}: expert {expert} of layer {layer} is not stored in FP8 per expert"
            )
        gate, up, down = (QuantizedMatrix(self.tensor(k), self.tensor(scale_key(k))) for k in keys)
        return QuantizedExpert(gate, up, down)

    @property
    def quantized_experts(self) -> str:
        """How the routed experts are stored quantized: "fp8" (per expert, each with its block
        scales), "mxfp4" (gpt-oss), or "" (not quantized)."""
        if self.mxfp4:
            return "mxfp4"
        if self.fp8 is None:
            return ""
        fam = self.family
        gate = fam.expert_key(self.moe_layers[0], 0, fam.gate_proj)
        return "fp8" if scale_key(gate) in self.weight_map else ""

    def _plain_expert_keys(self, layer: int, expert: int) -> tuple[str, str, str] | tuple[str, str] | None:
        """(gate, up, down) keys of an expert stored per expert, or (gate_up, down) of one stored in
        a fused [E, ...] pair, where its bytes are the expert itself (no scales, biases or blocks to
        combine); None otherwise."""
        fam = self.family
        gate_key = fam.expert_key(layer, expert, fam.gate_proj)
        if gate_key in self.weight_map:
            if self.fp8 is not None and scale_key(gate_key) in self.weight_map:
                return None
            return (
                gate_key,
                fam.expert_key(layer, expert, fam.up_proj),
                fam.expert_key(layer, expert, fam.down_proj),
            )
        if self.fp8 is not None or self.mxfp4 or fam.expert_layout == "gpt_oss":
            return None
        return fam.fused_key(layer, "gate_up_proj"), fam.fused_key(layer, "down_proj")

    def expert_shapes(self) -> tuple[torch.Size, torch.Size]:
        """The fused (gate_up [2I, H], down [H, I]) shapes of one expert, from the headers (gpt-oss:
        each with its bias row), without reading a weight."""
        layer = self.moe_layers[0]
        keys = self._plain_expert_keys(layer, 0)
        if keys is not None and len(keys) == 3:
            gate, _, down = (self.tensor_info(k).shape for k in keys)
            return torch.Size([2 * gate[0], *gate[1:]]), torch.Size(down)
        if keys is not None:
            gate_up, down = (self.tensor_info(k).shape[1:] for k in keys)
            return torch.Size(gate_up), torch.Size(down)
        w = self.expert(layer, 0)  # quantized or biased layouts: one expert read to learn its shapes
        return w.gate_up.shape, w.down.shape

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """One expert's bytes at `dtype`, as a worker holds it."""
        gate_up, down = self.expert_shapes()
        return (gate_up.numel() + down.numel()) * dtype.itemsize

    def expert_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """Expert `(layer, expert)` written into `gate_up` [2I, H] and `down` [H, I] at their dtype,
        bit for bit what `expert(...).gate_up.to(dtype)` gives: read straight into them where the
        checkpoint stores the expert's bytes as they are. Returns the bytes read from disk."""
        keys = self._plain_expert_keys(layer, expert)
        if keys is None:
            w = self.expert(layer, expert)
            gate_up.copy_(w.gate_up)
            down.copy_(w.down)
            return w.nbytes
        if len(keys) == 3:
            gate_key, up_key, down_key = keys
            rows = self.tensor_info(gate_key).shape[0]
            self._read_into(gate_key, None, gate_up[:rows])
            self._read_into(up_key, None, gate_up[rows:])
            self._read_into(down_key, None, down)
            return sum(self.tensor_info(k).nbytes for k in keys)
        self._read_into(keys[0], expert, gate_up)
        self._read_into(keys[1], expert, down)
        return sum(self.tensor_info(k).row_bytes for k in keys)

    def forget_expert(self, layer: int, expert: int) -> None:
        """Advise the kernel to drop the expert's pages from its cache (a worker now holds the bytes)."""
        self._advise_expert(layer, expert, forget=True)

    def prefetch_expert(self, layer: int, expert: int) -> None:
        """Advise the kernel to read the expert's pages into its cache now (a load will want them)."""
        self._advise_expert(layer, expert, forget=False)

    def _advise_expert(self, layer: int, expert: int, forget: bool) -> None:
        keys = self._plain_expert_keys(layer, expert)
        for key in keys or ():
            handle, name = self._handle(key), self.disk_key.get(key, key)
            row = None if len(keys) == 3 else expert
            handle.drop_cache(name, row) if forget else handle.prefetch(name, row)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        fam = self.family
        gate_key = fam.expert_key(layer, expert, fam.gate_proj)
        if gate_key in self.weight_map:
            if (keys := self._plain_expert_keys(layer, expert)) is not None:  # one buffer, no cat
                dtype = self.tensor_info(keys[0]).dtype
                w = ExpertWeights(*(torch.empty(shape, dtype=dtype) for shape in self.expert_shapes()))
                self.expert_into(layer, expert, w.gate_up, w.down)
                return w
            gate = self._dequantized(gate_key)
            up = self._dequantized(fam.expert_key(layer, expert, fam.up_proj))
            down = self._dequantized(fam.expert_key(layer, expert, fam.down_proj))
            return ExpertWeights(gate_up=torch.cat([gate, up], dim=0), down=down)
        if self.fp8 is not None:
            raise CheckpointError(f"{self.path}: FP8 experts in the fused layout are not served yet")
        # Fused layout on disk ([E, 2I, H] and [E, H, I]): read only this expert's slice.
        gate_up_key, down_key = fam.fused_key(layer, "gate_up_proj"), fam.fused_key(layer, "down_proj")
        if self.mxfp4:  # dequantized as transformers loads the release, in gpt-oss's slot layout
            q = self.quantized_expert(layer, expert)
            gate_up, down = (torch.empty(shape, dtype=torch.float32) for shape in q.shapes)
            q.load_into(gate_up, down)
            return ExpertWeights(gate_up=gate_up, down=down)
        if fam.expert_layout == "gpt_oss":  # transposed, each with its bias as one more row (ExpertMLP)
            fused_keys = (gate_up_key, f"{gate_up_key}_bias", down_key, f"{down_key}_bias")
            gate_up, gate_up_bias, down, down_bias = (self._slice(k, expert) for k in fused_keys)
            return ExpertWeights(
                gate_up=torch.cat([gate_up, gate_up_bias[None]]), down=torch.cat([down, down_bias[None]])
            )
        return ExpertWeights(gate_up=self._slice(gate_up_key, expert), down=self._slice(down_key, expert))


def _read_weight_map(path: Path, handles: dict[str, SafetensorsFile]) -> dict[str, str]:
    """Tensor name -> shard file, from the index or the single file's header (its reader then kept
    in `handles`)."""
    index = path / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    handles[SINGLE_FILE] = SafetensorsFile(single)
    return dict.fromkeys(handles[SINGLE_FILE].keys(), SINGLE_FILE)


def _text_model_only(checkpoint: Checkpoint, weight_map: dict[str, str], model_type: str) -> dict[str, str]:
    """A multimodal checkpoint's language-model tensors under the text model's names (each one's
    name on disk recorded in `checkpoint.disk_key`)."""
    assert checkpoint.wrapper is not None
    kept: dict[str, str] = {}
    skipped: set[str] = set()
    for disk_key, shard in weight_map.items():
        name = checkpoint.wrapper.text_key(disk_key)
        if name is None:
            skipped.add(".".join(disk_key.split(".")[:2]))
            continue
        kept[name] = shard
        checkpoint.disk_key[name] = disk_key
    log.info(
        "%s: a %s (vision-language) checkpoint: serving its language model (%s); the vision "
        "tower is skipped (%s)",
        checkpoint.path,
        model_type,
        checkpoint.config.model_type,
        ", ".join(sorted(skipped)) or "none saved",
    )
    return kept


def _without_extra_layers(path: Path, weight_map: dict[str, str], layers: int) -> dict[str, str]:
    """The weight map less layers beyond the model's `layers` (DeepSeek-V3's MTP layers)."""
    extra = sorted({n for k in weight_map if (n := layer_of_key(k)) is not None and n >= layers})
    if extra:
        log.info(
            "%s: skipping layers %s beyond num_hidden_layers=%d (multi-token-prediction layers; "
            "generate() never runs them)",
            path,
            extra,
            layers,
        )
    return {k: v for k, v in weight_map.items() if (layer_of_key(k) or 0) < layers}
