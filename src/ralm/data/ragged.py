"""A ragged array of int sequences on disk: `values.bin` (flat, raw) + `offsets.npy`.

Memory-mapped on read, streamed on write, so 13M blocks of tokens never sit in RAM.
Row i is values[offsets[i]:offsets[i+1]].
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np

from ralm.atomic import read_npy
from ralm.errors import RalmError


class RaggedWriter:
    def __init__(self, folder: str | os.PathLike, dtype=np.int32):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._values = open(self.folder / "values.bin", "wb")
        self._offsets = array("q", [0])

    def append(self, row) -> None:
        row = np.asarray(row, dtype=self.dtype)
        self._values.write(row.tobytes())
        self._offsets.append(self._offsets[-1] + len(row))

    def extend(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """Append rows of `lengths` at once, their `values` flat (a run of another array's rows)."""
        self._values.write(np.asarray(values, dtype=self.dtype).tobytes())
        self._offsets.extend((self._offsets[-1] + np.cumsum(lengths, dtype=np.int64)).tolist())

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> None:
        self._values.close()
        np.save(self.folder / "offsets.npy", np.frombuffer(self._offsets, dtype=np.int64))
        (self.folder / "dtype").write_text(self.dtype.str)


class RaggedArray:
    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        try:
            dtype = np.dtype((folder / "dtype").read_text().strip())
        except (OSError, UnicodeDecodeError, TypeError):
            raise RalmError(f"{folder / 'dtype'} is missing or damaged; rebuild it") from None
        self.offsets = read_npy(folder / "offsets.npy")
        if len(self.offsets) == 0:
            raise RalmError(f"{folder / 'offsets.npy'} is damaged (empty); rebuild it")
        size = int(self.offsets[-1])
        values = folder / "values.bin"
        found = values.stat().st_size if values.is_file() else 0
        if found != size * dtype.itemsize:
            raise RalmError(f"{values} is damaged ({found} bytes, its offsets say {size * dtype.itemsize}); rebuild it")
        # np.memmap refuses empty files; an empty array needs no mapping.
        self.values = (
            np.memmap(values, dtype=dtype, mode="r", shape=(size,))
            if size
            else np.zeros(0, dtype=dtype)
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.values[self.offsets[i] : self.offsets[i + 1]])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)
