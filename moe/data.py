"""Training sequences from a mix file: step i of a run reads rows [i*B, (i+1)*B), so the data position
is the step and a resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from moeflow.tokenize import mix


def sequences(path: Path) -> np.ndarray:
    """A mix output file of one sequence length as an int64 array [rows, seq_len + 1]."""
    col = mix.read(path).column("tokens").combine_chunks()
    return col.flatten().to_numpy().astype(np.int64).reshape(len(col), col.type.list_size)


class Sequences:
    """The training sequences of a mix file, memory-mapped (a record batch of it at a time: nothing is
    copied but the rows asked for); rows of different phases differ in length."""

    def __init__(self, path: Path):
        table = mix.read(path)
        chunks = table.column("tokens").chunks
        self.values = [c.flatten().to_numpy() for c in chunks]
        self.bases = np.cumsum([0] + [len(v) for v in self.values])  # each chunk's first token
        offsets = [np.zeros(1, np.int64)]
        for c, base in zip(chunks, self.bases, strict=False):
            if isinstance(c, pa.FixedSizeListArray):
                local = np.arange(1, len(c) + 1, dtype=np.int64) * c.type.list_size
            else:
                local = c.offsets.to_numpy()[1:].astype(np.int64) - int(c.offsets[0].as_py())
            offsets.append(local + base)
        self.offsets = np.concatenate(offsets)
        self.phase = (
            table.column("phase").to_numpy()
            if "phase" in table.column_names
            else np.zeros(len(self.offsets) - 1, dtype=np.int16)
        )
        self.max_len = int(np.diff(self.offsets).max()) - 1 if len(self) else 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def token_counts(self, vocab: int) -> np.ndarray:
        """How often each token id below `vocab` occurs in the file's rows [vocab], a chunk at a time."""
        counts = np.zeros(vocab, dtype=np.int64)
        for v in self.values:
            counts += np.bincount(v, minlength=vocab)[:vocab]
        return counts

    def width(self, a: int, b: int) -> int:
        """The stored length shared by rows a..b-1 (model inputs + 1).

        A batch must not cross a phase boundary.
        """
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        width = int(self.offsets[a + 1] - lo)
        if hi - lo != width * (b - a) or self.phase[a] != self.phase[b - 1]:
            widths = sorted(set(np.diff(self.offsets[a : b + 1]).tolist()))
            raise ValueError(
                f"rows {a}..{b - 1} mix sequence lengths {widths}: a batch must not cross a phase boundary"
            )
        return width

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows a..b-1 as an int64 array [rows, length]."""
        width = self.width(a, b)
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        first = int(np.searchsorted(self.bases, lo, side="right")) - 1
        pieces, k = [], first
        while lo < hi:
            take = min(hi, int(self.bases[k + 1])) - lo
            pieces.append(self.values[k][lo - self.bases[k] : lo - self.bases[k] + take])
            lo, k = lo + take, k + 1
        flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return flat.astype(np.int64).reshape(b - a, width)
