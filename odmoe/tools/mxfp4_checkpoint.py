"""Make gpt-oss's MXFP4 release layout from an unquantized gpt-oss checkpoint.

Contract: `quantize_mxfp4(src, out)` writes `out` with every expert matrix as the release stores it —
`*_proj_blocks` / `*_proj_scales` of W [out, in] (odmoe.models.mxfp4: 32 values a block, E8M0 scales),
the biases and every other tensor unchanged (bf16 as the release keeps them) — and the release's
`quantization_config` (quant_method mxfp4, attention, router, embeddings and lm_head not converted),
so transformers and odmoe both read `out` as a user's gpt-oss download. Tokenizer files are copied.
The values come from odmoe's own MXFP4 rounding (the OCP MX rule): transformers' quantizer needs
triton kernels this machine does not have; what must match is how the checkpoint is *read*.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odmoe.models.mxfp4 import quantize

EXPERT_MATRICES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def quantize_mxfp4(src: str | Path, out: str | Path) -> Path:
    src, out = Path(src), Path(out)
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
                    if key.endswith(EXPERT_MATRICES):  # [E, in, out] in gpt-oss's layout: W is its transpose
                        pairs = [quantize(value[e].t()) for e in range(value.shape[0])]
                        tensors[f"{key}_blocks"] = torch.stack([b for b, _ in pairs])
                        tensors[f"{key}_scales"] = torch.stack([s for _, s in pairs])
                    else:
                        tensors[key] = value
            save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        index = tmp / "model.safetensors.index.json"
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"] = {}
            for shard in sorted(tmp.glob("*.safetensors")):
                with safe_open(shard, "pt") as f:
                    data["weight_map"].update(dict.fromkeys(f.keys(), shard.name))
            index.write_text(json.dumps(data, indent=2))
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = {  # as openai/gpt-oss-20b's config.json has it
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
