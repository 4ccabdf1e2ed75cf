"""Make a block-wise FP8 checkpoint from an unquantized one, as the FP8 releases are stored.

Contract: `quantize_fp8(src, out, block)` writes `out`: every matrix of the model quantized to float8
(e4m3) with one `weight_scale_inv` per `block` (the releases use 128 x 128), by transformers' own
quantizer (`Fp8Quantize`, what it runs to save an FP8 model), except what the releases keep as they
are: embeddings, norms, the routers and lm_head (and a matrix whose shape the block does not divide,
which transformers' quantizer passes through). The config gains the `quantization_config` a release
has, so transformers and odmoe both read `out` as a user's FP8 checkpoint. Tokenizer files are copied.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

from safetensors import safe_open
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

KEPT = ("embed_tokens.", "lm_head.", "norm", ".mlp.gate.weight")  # what the releases store unquantized


def quantize_fp8(src: str | Path, out: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    src, out = Path(src), Path(out)
    config = FineGrainedFP8Config(weight_block_size=list(block))
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=config))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for item in src.iterdir():
            if item.suffix != ".safetensors" and item.is_file():
                shutil.copy2(item, tmp / item.name)
        for shard in sorted(src.glob("*.safetensors")):
            tensors = {}
            with safe_open(shard, "pt") as f:
                for key in f.keys():
                    value = f.get_tensor(key)
                    if key.endswith(".weight") and value.dim() == 2 and not any(k in key for k in KEPT):
                        tensors.update(quantizer.convert({key: value}))
                    else:
                        tensors[key] = value
            save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        _reindex(tmp)
        saved = json.loads((tmp / "config.json").read_text())
        # as the releases write it (DeepSeek-V3's config.json), which transformers reads as its own
        saved["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
        (tmp / "config.json").write_text(json.dumps(saved, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _reindex(model_dir: Path) -> None:
    """A sharded checkpoint's index names every tensor, the new scales too."""
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
