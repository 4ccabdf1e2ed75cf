"""The name a transformers release gives a model forward's K/V cache argument.

Contract: `with_cache(model, cache)` is the keyword arguments that hand `cache` to `model`'s forward:
`{"cache": cache}` where its forward takes `cache` (transformers 5.24 on), else
`{"past_key_values": cache}` (5.23, the oldest release odmoe supports). 5.24 renamed the argument and
warns on every call that uses the old name (a FutureWarning per decode step in every node's log),
and 5.40 removes the old name; one place picks the name so every forward pass (main's runs, the
shadow's batch, the replay benchmarks) works across the releases pyproject allows.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    return {_cache_name(type(model)): cache}


@functools.cache
def _cache_name(model_type: type) -> str:
    # inspect.signature follows the deprecation decorator's __wrapped__ to the forward's own arguments
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"
