"""Make a block-wise FP8 checkpoint from an unquantized one, as the FP8 releases are stored.

Contract: `quantize_fp8(src, out, block)` writes `out`: every matrix of the model quantized to float8
(e4m3) with one `weight_scale_inv` per `block` (the releases use 128 x 128), by transformers' own
quantizer (`Fp8Quantize`, what it runs to save an FP8 model), except what the releases keep as they
are: embeddings, norms, the routers and lm_head (and a matrix whose shape the block does not divide,
which transformers' quantizer passes through). The config gains the `quantization_config` a release
has, so transformers and odmoe both read `out` as a user's FP8 checkpoint. Tokenizer files are copied.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from odmoe.tools.rewrite_checkpoint import rewrite_checkpoint

KEPT = ("embed_tokens.", "lm_head.", "norm", ".mlp.gate.weight")  # what the releases store unquantized


def quantize_fp8(src: str | Path, out: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    quantizer = Fp8Quantize(
        SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=list(block)))
    )

    def convert(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if key.endswith(".weight") and value.dim() == 2 and not any(k in key for k in KEPT):
            return quantizer.convert({key: value})
        return {key: value}

    # as the releases write it (DeepSeek-V3's config.json), which transformers reads as its own
    release = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    return rewrite_checkpoint(src, out, convert, release)
