"""Open the model at a path, whichever kind it is: a GGUF file (`*.gguf`; a shard names the set,
odmoe.models.gguf_checkpoint) or a safetensors directory (odmoe.models.checkpoint).

Contract: `open_checkpoint(path)` returns the checkpoint (the same interface for both kinds);
`load_tokenizer(path)` / `load_config(path)` give the tokenizer and the served config for the same
path, from a GGUF file's metadata as transformers builds them. The one module that knows both kinds.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from odmoe.models.checkpoint import Checkpoint
from odmoe.models.families import served_config
from odmoe.models.gguf_checkpoint import GgufCheckpoint, gguf_location


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`: a GGUF file (`*.gguf`; a shard names the set) or a safetensors directory."""
    if str(path).endswith(".gguf"):
        return GgufCheckpoint(path)
    return Checkpoint(path)


def load_tokenizer(path: str | Path):
    """`AutoTokenizer.from_pretrained` for the model at `path`; a GGUF file's tokenizer and chat
    template come from its metadata, as transformers builds them (`gguf_file=`)."""
    from transformers import AutoTokenizer

    if str(path).endswith(".gguf"):
        directory, name = gguf_location(path)  # a sharded set's first shard holds the tokenizer
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return AutoTokenizer.from_pretrained(Path(path).expanduser())


def load_config(path: str | Path) -> PretrainedConfig:
    """The config odmoe serves from the model at `path` (a wrapper's text model; a GGUF file's as
    `GgufCheckpoint` reads it), without reading a tensor."""
    if str(path).endswith(".gguf"):
        checkpoint = GgufCheckpoint(path)
        checkpoint.close()
        return checkpoint.config
    config, _ = served_config(AutoConfig.from_pretrained(Path(path).expanduser()))
    return config
