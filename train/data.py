"""Byte-level text that every machine has without downloading: the running interpreter's standard library sources.

The corpus is the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), sorted by
relative path, each followed by a NUL byte (which never occurs in source text) and concatenated into one uint8 array.
A file goes to validation when the CRC-32 of its relative path falls in the held-out percentage: the split is by file
and does not depend on which other files a given Python ships.

Training batches are random fixed-length windows. Batch ``i`` is a pure function of ``(seed, i)`` (counter-based
seeding of NumPy's generator), so the data position is one integer and a resumed run reads exactly the batches the
uninterrupted run would have read. Every process draws the same global batch and keeps its own rows.
"""

import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np

FILE_SEPARATOR = 0
VOCAB_SIZE = 256
SPLITS = ("train", "validation")
# Validation windows come from their own stream, so that changing the training seed leaves the validation set alone.
VALIDATION_STREAM = 0x76616C


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> list[str]:
    """Sorted relative paths (POSIX) of the standard library's ``*.py`` files, without third-party packages."""
    root = root or stdlib_root()
    files = (
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if path.is_file() and not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts)
    )
    return sorted(files)


def split_of(relative_path: str, validation_percent: int) -> str:
    """ "validation" for a stable ``validation_percent`` share of paths, else "train"."""
    return "validation" if zlib.crc32(relative_path.encode()) % 100 < validation_percent else "train"


def load_corpus(split: str, validation_percent: int, root: pathlib.Path | None = None) -> np.ndarray:
    """[N] uint8: the split's files, each followed by ``FILE_SEPARATOR``, in sorted path order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = root or stdlib_root()
    chunks = []
    for relative_path in stdlib_files(root):
        if split_of(relative_path, validation_percent) == split:
            chunks.append((root / relative_path).read_bytes())
            chunks.append(bytes([FILE_SEPARATOR]))
    if not chunks:
        raise ValueError(f"no standard-library sources for split {split!r} under {root}")
    return np.frombuffer(b"".join(chunks), np.uint8)


def unigram_entropy(corpus: np.ndarray) -> float:
    """Entropy in nats of the corpus's byte frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(corpus, minlength=VOCAB_SIZE).astype(np.float64)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


@dataclasses.dataclass(frozen=True)
class Batch:
    """inputs, targets: [B_local, S] int32; targets are inputs shifted left by one byte."""

    inputs: np.ndarray
    targets: np.ndarray


@dataclasses.dataclass(frozen=True)
class WindowSampler:
    """Random windows of ``seq_len + 1`` bytes; batch ``index`` depends on ``(seed, index)`` alone.

    ``process_index`` / ``process_count`` select this process's contiguous rows of the global batch.
    """

    corpus: np.ndarray
    seq_len: int
    batch_size: int
    seed: int
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        if self.corpus.ndim != 1 or self.corpus.dtype != np.uint8:
            raise TypeError(f"corpus must be a 1-D uint8 array, got {self.corpus.dtype} of shape {self.corpus.shape}")
        if self.corpus.size <= self.seq_len + 1:
            raise ValueError(f"corpus of {self.corpus.size} bytes is too short for seq_len={self.seq_len}")
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of the process count {self.process_count}"
            )

    def starts(self, index: int) -> np.ndarray:
        """[B] int64 window starts of global batch ``index``."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, self.corpus.size - self.seq_len - 1, size=self.batch_size, endpoint=True)

    def batch(self, index: int) -> Batch:
        rows = self.batch_size // self.process_count
        starts = self.starts(index)[self.process_index * rows : (self.process_index + 1) * rows]
        windows = self.corpus[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return Batch(inputs=windows[:, :-1], targets=windows[:, 1:])
