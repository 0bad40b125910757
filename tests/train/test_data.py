"""The data pipeline: deterministic file list and split, reproducible windows, per-process slices, the baseline."""

import numpy as np
import pytest

from train import data


@pytest.fixture(scope="module")
def train_corpus():
    return data.load_corpus("train", 10)


def test_file_list_is_sorted_and_stdlib_only():
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert all(path.endswith(".py") for path in files)
    assert not any("site-packages" in path or "dist-packages" in path for path in files)


def test_split_is_by_file_disjoint_and_stable():
    files = data.stdlib_files()
    validation = [f for f in files if data.split_of(f, 10) == "validation"]
    train = [f for f in files if data.split_of(f, 10) == "train"]
    assert not set(validation) & set(train) and len(validation) + len(train) == len(files)
    # About the asked share (CRC-32 is close to uniform over a few hundred names).
    assert 0.05 < len(validation) / len(files) < 0.15
    # The split of a path depends on the path alone: CRC-32 % 100 is 2 for "zipfile/__init__.py", 75 for
    # "json/decoder.py" (computed once with zlib and written down here).
    assert data.split_of("zipfile/__init__.py", 10) == "validation"
    assert data.split_of("json/decoder.py", 10) == "train"
    assert data.split_of("json/decoder.py", 80) == "validation"


def test_corpus_is_the_files_bytes_in_order(train_corpus):
    root = data.stdlib_root()
    first = next(f for f in data.stdlib_files() if data.split_of(f, 10) == "train")
    expected = np.frombuffer((root / first).read_bytes() + bytes([data.FILE_SEPARATOR]), np.uint8)
    np.testing.assert_array_equal(train_corpus[: expected.size], expected)
    np.testing.assert_array_equal(train_corpus, data.load_corpus("train", 10))
    validation = data.load_corpus("validation", 10)
    total = sum((root / f).stat().st_size + 1 for f in data.stdlib_files())
    assert train_corpus.size + validation.size == total


def test_batches_depend_on_seed_and_index_only(train_corpus):
    sampler = data.WindowSampler(train_corpus, seq_len=64, batch_size=8, seed=3)
    again = data.WindowSampler(train_corpus, seq_len=64, batch_size=8, seed=3)
    for index in (0, 1, 17):
        np.testing.assert_array_equal(sampler.batch(index).inputs, again.batch(index).inputs)
    assert not np.array_equal(sampler.batch(0).inputs, sampler.batch(1).inputs)
    other_seed = data.WindowSampler(train_corpus, seq_len=64, batch_size=8, seed=4)
    assert not np.array_equal(sampler.batch(0).inputs, other_seed.batch(0).inputs)


def test_batch_is_shifted_windows_of_the_corpus(train_corpus):
    sampler = data.WindowSampler(train_corpus, seq_len=32, batch_size=4, seed=0)
    batch = sampler.batch(5)
    assert batch.inputs.shape == batch.targets.shape == (4, 32) and batch.inputs.dtype == np.int32
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    for row, start in zip(batch.inputs, sampler.starts(5), strict=True):
        np.testing.assert_array_equal(row, train_corpus[start : start + 32])


def test_processes_split_the_global_batch(train_corpus):
    whole = data.WindowSampler(train_corpus, seq_len=16, batch_size=8, seed=1).batch(2)
    parts = [
        data.WindowSampler(train_corpus, 16, 8, seed=1, process_index=p, process_count=4).batch(2) for p in range(4)
    ]
    np.testing.assert_array_equal(np.concatenate([p.inputs for p in parts]), whole.inputs)


def test_sampler_rejects_bad_arguments(train_corpus):
    with pytest.raises(ValueError, match="batch_size"):
        data.WindowSampler(train_corpus, 16, 6, seed=0, process_count=4)
    with pytest.raises(ValueError, match="too short"):
        data.WindowSampler(np.zeros(10, np.uint8), 16, 2, seed=0)
    with pytest.raises(TypeError, match="uint8"):
        data.WindowSampler(np.zeros(100, np.int32), 16, 2, seed=0)
    with pytest.raises(ValueError, match="split"):
        data.load_corpus("test", 10)


def test_unigram_entropy_matches_float64_oracle():
    rng = np.random.default_rng(0)
    corpus = rng.choice(4, size=10_000, p=[0.5, 0.25, 0.125, 0.125]).astype(np.uint8)
    freqs = np.bincount(corpus) / corpus.size
    np.testing.assert_allclose(data.unigram_entropy(corpus), -np.sum(freqs * np.log(freqs)), rtol=1e-12)
    assert data.unigram_entropy(np.full(50, 7, np.uint8)) == 0.0
