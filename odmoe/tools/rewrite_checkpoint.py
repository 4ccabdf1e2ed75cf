"""Write a checkpoint's tensors through a conversion, as a quantized release of it would be stored.

Contract: `rewrite_checkpoint(src, out, convert, quantization_config)` writes `out` atomically (built
beside it, then renamed into place; `out` may be `src`): every non-weight file copied, every tensor of
every shard passed to `convert(key, tensor) -> {key: tensor, ...}` (what it returns is stored: the
tensor itself, or its quantized parts), a sharded checkpoint's index rebuilt, and the config given the
release's `quantization_config`. Used by the FP8 and MXFP4 makers (odmoe.tools.fp8_checkpoint,
odmoe.tools.mxfp4_checkpoint).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odmoe.tools.model_factory import built_beside

Convert = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def rewrite_checkpoint(src: str | Path, out: str | Path, convert: Convert, quantization_config: dict) -> Path:
    src, out = Path(src), Path(out)
    with built_beside(out) as tmp:
        for item in src.iterdir():
            if item.suffix != ".safetensors" and item.is_file():
                shutil.copy2(item, tmp / item.name)
        for shard in sorted(src.glob("*.safetensors")):
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(shard, "pt") as f:
                for key in f.keys():
                    tensors.update(convert(key, f.get_tensor(key)))
            save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        _reindex(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _reindex(model_dir: Path) -> None:
    """A sharded checkpoint's index names every tensor, the new ones too."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return
    data = json.loads(index.read_text())
    weight_map = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    data["weight_map"] = weight_map
    index.write_text(json.dumps(data, indent=2))
