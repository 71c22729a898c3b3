"""Key/value cache with one row per running sequence.

Each layer keeps two buffers shaped [rows, kv_heads, columns, head_dim]. A sequence owns one row and its
tokens sit in columns 0..len-1, so rows of different lengths live side by side and a decode step attends to
columns 0..max_len of the rows it runs, with a mask hiding each row's unused tail. The last column is a
scratch column that padding positions of a prefill batch write into.

Buffers are created when the model first writes a layer (so per-layer shapes come from the model itself) and
grow geometrically as rows and lengths grow (each growth copies the cache, so it must be rare).
"""
from __future__ import annotations

import torch

_COLUMN_CHUNK = 256
_MIN_ROWS = 8
_IDLE_KEEP_BYTES = 512 * 2**20  # buffers up to this size stay allocated while idle, ready for the next burst


def _round_up(value: int, chunk: int) -> int:
    return -(-value // chunk) * chunk


class SlotKVCache:
    def __init__(self, device: torch.device, dtype: torch.dtype, max_rows: int, max_len: int):
        self.device = device
        self.dtype = dtype
        self.max_rows = max_rows
        self.max_columns = max_len + 1  # + the scratch column
        self.rows = 0
        self.columns = 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    @property
    def scratch_column(self) -> int:
        return self.columns - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def reserve(self, rows: int, length: int) -> None:
        """Make room for `rows` rows of `length` tokens each (plus the scratch column)."""
        if rows > self.max_rows or length + 1 > self.max_columns:
            raise ValueError(f"KV cache request {rows}x{length} exceeds {self.max_rows}x{self.max_columns - 1}")
        if rows <= self.rows and length + 1 <= self.columns:
            return
        new_rows = self.rows if rows <= self.rows else min(self.max_rows, max(rows, 2 * self.rows, _MIN_ROWS))
        new_columns = self.columns
        if length + 1 > self.columns:
            new_columns = min(self.max_columns, max(_round_up(length + 1, _COLUMN_CHUNK), 2 * self.columns))
        self._resize(new_rows, new_columns)

    def release_if_idle(self) -> None:
        """With no sequence running, give back buffers that grew large for a burst of long sequences."""
        if self.nbytes > _IDLE_KEEP_BYTES:
            self.clear()

    def clear(self) -> None:
        self._k.clear()
        self._v.clear()
        self.rows = self.columns = 0

    def _resize(self, rows: int, columns: int) -> None:
        keep_rows = min(self.rows, rows)
        keep_columns = min(self.columns - 1, columns - 1)
        for store in (self._k, self._v):
            for layer, old in store.items():
                new = torch.zeros((rows, old.shape[1], columns, old.shape[3]), dtype=old.dtype, device=old.device)
                if keep_rows > 0 and keep_columns > 0:
                    new[:keep_rows, :, :keep_columns] = old[:keep_rows, :, :keep_columns]
                store[layer] = new
        self.rows, self.columns = rows, columns

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._k.get(layer)
        if k is None:
            shape = (self.rows, like.shape[1], self.columns, like.shape[3])
            k = self._k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return k, self._v[layer]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` columns of row `src` into row `dst` (compaction, and forking n choices)."""
        for store in (self._k, self._v):
            for buf in store.values():
                buf[dst, :, :length] = buf[src, :, :length]

    def export(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of columns [start, end) of a row, per layer (for the prefix cache)."""
        return [(self._k[i][row, :, start:end].clone(), self._v[i][row, :, start:end].clone())
                for i in sorted(self._k)]

    def load(self, row: int, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write per-layer blocks (from `export`) into a row at column `start`."""
        for i, (k, v) in enumerate(layers):
            kb, vb = self._buffers(i, k.unsqueeze(0))
            kb[row, :, start:start + k.shape[1]] = k
            vb[row, :, start:start + v.shape[1]] = v

    def step(self, rows: list[int], columns: torch.Tensor, kv_len: int) -> "StepCache":
        return StepCache(self, rows, columns, kv_len)


class StepCache:
    """The cache as one forward pass sees it: which rows run, which column each new token is written to,
    and how many columns attention reads. Passed to the model as `past_key_values`."""

    is_compileable = False

    def __init__(self, store: SlotKVCache, rows: list[int], columns: torch.Tensor, kv_len: int):
        self._store = store
        self._kv_len = kv_len
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self._row_slice = slice(rows[0], rows[0] + len(rows)) if contiguous else None
        self._row_index = torch.tensor(rows, device=store.device)
        self._write_rows = self._row_index.view(-1, 1)
        self._columns = columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k_buf, v_buf = self._store._buffers(layer_idx, key_states)
        # key_states: [batch, kv_heads, new_tokens, head_dim] -> rows x new-token columns
        k_buf[self._write_rows, :, self._columns] = key_states.transpose(1, 2).to(k_buf.dtype)
        v_buf[self._write_rows, :, self._columns] = value_states.transpose(1, 2).to(v_buf.dtype)
        if self._row_slice is not None:
            return k_buf[self._row_slice, :, :self._kv_len], v_buf[self._row_slice, :, :self._kv_len]
        return k_buf[self._row_index, :, :self._kv_len], v_buf[self._row_index, :, :self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len
