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

from pathlib import Path

import torch

from odmoe.models.mxfp4 import quantize
from odmoe.tools.rewrite_checkpoint import rewrite_checkpoint

EXPERT_MATRICES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
RELEASE = {  # as openai/gpt-oss-20b's config.json has it
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def quantize_mxfp4(src: str | Path, out: str | Path) -> Path:
    def convert(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if not key.endswith(EXPERT_MATRICES):
            return {key: value}
        pairs = [quantize(value[e].t()) for e in range(value.shape[0])]  # [E, in, out]: W is its transpose
        return {
            f"{key}_blocks": torch.stack([b for b, _ in pairs]),
            f"{key}_scales": torch.stack([s for _, s in pairs]),
        }

    return rewrite_checkpoint(src, out, convert, RELEASE)
