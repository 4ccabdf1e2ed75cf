"""The shadow's running requests as rows of one batched K/V cache: one forward pass per tick.

Why the shadow batches and main does not: main's output must be bit-identical to a request alone,
so it computes every request in its own shapes; the shadow only predicts, and a prediction that
differs in the last bits costs nothing but a reload. Stepping R requests one by one costs the shadow
R forward passes per tick (4.9 ms each on the benchmark model here, mostly per-op overhead); one
batched pass over all of them cost 8.7 ms for 8. So the shadow computes its requests together.

Contract: `ShadowBatch(model)` holds requests as rows of one `DynamicCache` ([rows, heads, width,
dim] per layer), each row left-padded, with a mask of the positions it really has (`valid`):
- `add(request, cache)`: a request prefilled on its own (batch 1) joins; whichever is shorter, the
  batch or the newcomer, is padded on the left so both end at the same position.
- `remove(request)`: it leaves (the columns no row uses any more are dropped).
- `step(tokens)`: one decode step of the rows named in `tokens` (request -> the token fed); the other
  rows idle: their new column is masked out for them (they compute too when most rows step; when few
  do, only those compute, on a copy of their rows). Returns each stepped row's own greedy next token.
  During the step `stepping` lists (row of the forward pass, request) for the router hooks.
- `row(request)`: a `RowCache` onto one row in its own (logical) positions, for alignment: `crop_to`
  (a speculative rollback: the row's later positions are masked out, never read again) and
  `overwrite` (main's K/V rows at the row's logical positions).
Positions: a row's logical position p is its p-th valid column. Each step feeds every row its own
logical position (`position_ids`), and RoPE is applied at that position when a column is written,
so holes left by rollbacks or idle steps change nothing a row attends to. Columns no row uses are
dropped by `compact` once they make up a quarter of the width.

Only caches whose every layer is a plain `DynamicLayer` (full attention) are batched; a model with
sliding-window or recurrent layers keeps one cache per request (`batchable`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from odmoe.models.cache_argument import with_cache
from odmoe.models.kv_rows import croppable, overwrite_rows, row_layers


def batchable(cache: DynamicCache) -> bool:
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


class RowCache:
    """One request's cache in its own positions: a batch-1 `DynamicCache`, or a row of the batch."""

    def __init__(
        self, cache: DynamicCache | None = None, batch: ShadowBatch | None = None, request: str = ""
    ):
        self.cache, self.batch, self.request = cache, batch, request

    @property
    def layers(self) -> int:
        """Layers with K/V rows (what an Align's tensors stack)."""
        return len(row_layers(self.cache or self.batch.cache))

    @property
    def croppable(self) -> bool:
        """False for a hybrid model's cache (its recurrent states cannot go back, see `crop_to`) and
        a sliding window's (it keeps nothing older than the window)."""
        return self.cache is None or croppable(self.cache)

    @property
    def length(self) -> int:
        if self.cache is not None:
            return self.cache.get_seq_length()
        return int(self.batch.valid[self.batch.index(self.request)].sum())

    def crop_to(self, length: int) -> None:
        if self.cache is not None:
            self.cache.crop(length - self.cache.get_seq_length())
            return
        b = self.batch.index(self.request)
        columns = self.batch.valid[b].nonzero().flatten()
        self.batch.valid[b, columns[length:]] = False

    def overwrite(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions [start, start + rows) of every layer := main's K/V rows ([layers, heads, rows, D])."""
        rows = keys.shape[2]
        if self.cache is not None:  # its own positions, a sliding window's offset taken into account
            overwrite_rows(self.cache, start, keys, values)
            return
        b = self.batch.index(self.request)
        where = self.batch.valid[b].nonzero().flatten()[start : start + rows]
        layers = row_layers(self.batch.cache)
        for i, layer in enumerate(layers):
            layer.keys[b, :, where] = keys[i].to(layer.keys.device, layer.keys.dtype)
            layer.values[b, :, where] = values[i].to(layer.values.device, layer.values.dtype)


class ShadowBatch:
    def __init__(self, model):
        self.model = model
        self.rows: list[str] = []
        self.cache: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, width]
        self.stepping: list[tuple[int, str]] = []  # during step(): (row, request) of the rows stepped

    def index(self, request: str) -> int:
        return self.rows.index(request)

    def row(self, request: str) -> RowCache:
        return RowCache(batch=self, request=request)

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def add(self, request: str, cache: DynamicCache) -> None:
        length = cache.get_seq_length()
        if self.cache is None:
            self.cache, self.rows = cache, [request]
            self.valid = torch.ones(1, length, dtype=torch.bool)
            return
        if length > self.width:  # the newcomer is longer: every row moves right
            self._pad_left(length - self.width)
        pad = self.width - length
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, _padded(theirs.keys, pad)])
            mine.values = torch.cat([mine.values, _padded(theirs.values, pad)])
        row = torch.cat([torch.zeros(pad, dtype=torch.bool), torch.ones(length, dtype=torch.bool)])
        self.valid = torch.cat([self.valid, row[None]])
        self.rows.append(request)

    def remove(self, request: str) -> None:
        if request not in self.rows:
            return
        keep = [b for b, r in enumerate(self.rows) if r != request]
        self.rows = [self.rows[b] for b in keep]
        if not keep:
            self.cache, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        index = torch.tensor(keep)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid = self.valid[index]
        self.compact()

    def step(self, tokens: dict[str, int]) -> dict[str, int]:
        """One decode step of the rows named in `tokens`; their own next tokens (greedy, as the shadow
        runs on). Fewer than half the rows: only they compute, on a copy of their rows (a copy of a
        few rows' cache costs less than the idle rows' compute); else every row computes and the
        idle rows' new column is masked out for them."""
        stepping = [(b, r) for b, r in enumerate(self.rows) if r in tokens]
        ids = torch.tensor([[tokens[r]] for _, r in stepping])
        if 2 * len(stepping) < len(self.rows):
            index = torch.tensor([b for b, _ in stepping])
            cache = DynamicCache(config=self.model.config)
            for i, layer in enumerate(self.cache.layers):
                cache.update(layer.keys[index], layer.values[index], i)
            valid = self.valid[index]
            own = self._forward(ids, valid, torch.ones(len(stepping), dtype=torch.bool), cache, stepping)
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                for name in ("keys", "values"):
                    old, new = getattr(mine, name), getattr(theirs, name)[:, :, -1:]
                    column = old.new_zeros(old.shape[0], old.shape[1], 1, old.shape[3])
                    column[index] = new
                    setattr(mine, name, torch.cat([old, column], dim=2))
            ran = torch.zeros(len(self.rows), dtype=torch.bool)
            ran[index] = True
        else:
            ran = torch.tensor([r in tokens for r in self.rows])
            everyone = torch.zeros(len(self.rows), 1, dtype=torch.long)
            everyone[[b for b, _ in stepping], 0] = ids[:, 0]
            own = self._forward(everyone, self.valid, ran, self.cache, stepping, full=True)
        self.valid = torch.cat([self.valid, ran[:, None]], dim=1)
        if self.width - int(self.valid.sum(1).max()) > max(32, self.width // 4):
            self.compact()
        return {r: own[i] for i, (_, r) in enumerate(stepping)}

    def _forward(self, ids, valid, ran, cache, stepping, full: bool = False) -> list[int]:
        """The model over `cache`'s rows; each stepped row's own next token, in `stepping` order.
        `stepping` holds (row of this forward, request) for the router hooks meanwhile."""
        positions = valid.sum(1, keepdim=True)  # each row's own next position
        mask = torch.cat([valid, ran[:, None]], dim=1).long()
        device = self.model.device
        rows = [b for b, _ in stepping] if full else list(range(len(stepping)))
        self.stepping = [(row, r) for row, (_, r) in zip(rows, stepping, strict=True)]
        try:
            logits = self.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                **with_cache(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        finally:
            self.stepping = []
        own = logits.argmax(-1).tolist()
        return [own[row] for row in rows]

    def compact(self) -> None:
        """Drop the columns no row uses; left-pad each row again to the longest one."""
        lengths = self.valid.sum(1)
        width = int(lengths.max()) if len(lengths) else 0
        if width == self.width:
            return
        columns = [self.valid[b].nonzero().flatten() for b in range(len(self.rows))]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(old.shape[0], old.shape[1], width, old.shape[3])
                for b, where in enumerate(columns):
                    new[b, :, width - len(where) :] = old[b, :, where]
                setattr(layer, name, new)
        valid = torch.zeros(len(self.rows), width, dtype=torch.bool)
        for b, where in enumerate(columns):
            valid[b, width - len(where) :] = True
        self.valid = valid

    def _pad_left(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = _padded(layer.keys, n), _padded(layer.values, n)
        self.valid = torch.cat([torch.zeros(len(self.rows), n, dtype=torch.bool), self.valid], dim=1)


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, heads, width, dim] with n zero columns on the left."""
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t
