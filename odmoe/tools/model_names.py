"""The model names every command accepts, and the one place they become checkpoint directories.

Contract: `resolve_model(name, cache_dir)` returns a checkpoint directory for `model.path`
(odmoe-launch, LocalCluster, Ray), `model=` (odmoe-bench) and odmoe-profile's argument alike:
- `demo`: the small model trained on first use from the corpus shipped with odmoe (odmoe-launch's
  default); `tiny`: the random-init model the tests use (also what an unset `model.path` means);
- `trained` / `trained_deepseek` / `trained_qwen3_next`: the benchmark models (Mixtral-style,
  DeepSeek-V3-shaped, Qwen3-Next hybrid; 5-10 min of training on first use);
- anything else: a directory, `~` expanded (write `./demo` for a directory named like a model).
Models are made under `cache_dir` (default ~/.cache/odmoe/models) once, safely under concurrency.
A name that is neither a model nor an existing path raises CheckpointError (a ValueError) naming
both, so every front end reports it the same way.
"""

from __future__ import annotations

from pathlib import Path

from odmoe.models.checkpoint import CheckpointError

BUILTIN = ("demo", "tiny")  # odmoe-launch's own: made in a second (tiny) or two minutes (demo)
# benchmark models -> family
TRAINED = {"trained": "mixtral", "trained_deepseek": "deepseek_v3", "trained_qwen3_next": "qwen3_next"}
MODEL_NAMES = (*BUILTIN, *TRAINED)


def resolve_model(name: str | None, cache_dir: str | Path | None = None) -> str:
    """A model name or a checkpoint directory -> the directory (odmoe's own models made on first use)."""
    from odmoe.tools.training import ensure_builtin_model, ensure_trained_model

    name = name or "tiny"  # as before the names existed
    cache = Path(cache_dir).expanduser() if cache_dir else None
    if name in TRAINED:
        return str(ensure_trained_model(cache, family=TRAINED[name]))
    if name in BUILTIN:
        return str(ensure_builtin_model(name, cache))
    path = Path(name).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"model directory {path} does not exist (nor is {name!r} one of odmoe's own models: "
            f"{', '.join(MODEL_NAMES)})"
        )
    return str(path.resolve())
