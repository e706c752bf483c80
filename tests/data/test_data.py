"""Sources (MNIST, text), the byte tokenizer and the grain Input pipeline."""

import numpy as np
import pytest

from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.sources import MNIST, TextWindows
from titanax.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "To be, or not to be -- ça dépend. 🙂"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tokenizer.decode(ids) == text


def test_bundled_mnist_split_is_class_balanced_and_disjoint():
    train = MNIST.default_config().set(split="train").instantiate()
    test = MNIST.default_config().set(split="test").instantiate()
    assert (len(train), len(test)) == (4000, 1000)
    assert np.bincount(test.labels).tolist() == [100] * 10
    example = train[0]
    assert example["image"].shape == (28, 28) and 0.0 <= example["image"].min()
    assert example["image"].max() <= 1.0
    train_rows = {row.tobytes() for row in train.images.reshape(len(train), -1)}
    assert not any(row.tobytes() in train_rows for row in test.images.reshape(len(test), -1))


def test_mnist_reads_idx_files(tmp_path):
    import gzip  # pylint: disable=import-outside-toplevel
    images = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)
    labels = np.array([7, 1, 4], np.uint8)
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + (3).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
                + images.tobytes())
    with open(tmp_path / "t10k-labels-idx1-ubyte", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + labels.tobytes())
    source = MNIST.default_config().set(data_dir=str(tmp_path), split="test").instantiate()
    assert len(source) == 3 and source[2]["label"] == 4
    np.testing.assert_allclose(source[1]["image"], images[1] / 255.0)
    with pytest.raises(errors.DataError) as info:
        MNIST.default_config().set(data_dir=str(tmp_path), split="train").instantiate()
    assert info.value.path == "data_dir"


def test_text_windows_targets_are_inputs_shifted_and_splits_disjoint(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 4, encoding="utf-8")
    cfg = TextWindows.default_config().set(files=[str(tmp_path / "*.txt")], seq_len=8,
                                           held_out_fraction=0.25)
    train = cfg.instantiate()
    test = cfg.clone(split="test").instantiate()
    example = train[1]
    np.testing.assert_array_equal(example["target_ids"][:-1], example["input_ids"][1:])
    assert ByteTokenizer().decode(example["input_ids"]) == "ijklmnop"
    assert len(train.tokens) + len(test.tokens) == 104
    with pytest.raises(errors.DataError):
        TextWindows.default_config().set(files=[str(tmp_path / "*.nothing")]).instantiate()


def test_bundled_shakespeare():
    source = TextWindows.default_config().set(seq_len=64).instantiate()
    assert len(source) > 50_000
    text = ByteTokenizer().decode(source.tokens)
    assert text.startswith("# A Midsummer Night's Dream") and "# Hamlet" in text


def test_input_batches_are_deterministic_and_cover_an_epoch():
    cfg = Input.default_config().set(source=MNIST.default_config().set(split="test"),
                                     global_batch_size=100, num_epochs=1, seed=3)
    first = [b["label"] for b in cfg.instantiate()]
    again = [b["label"] for b in cfg.instantiate()]
    assert len(first) == 10 and all(b.shape == (100,) for b in first)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert np.bincount(np.concatenate(first)).tolist() == [100] * 10
    other_seed = [b["label"] for b in cfg.clone(seed=4).instantiate()]
    assert not np.array_equal(first[0], other_seed[0])


def test_each_process_reads_its_rows_of_the_global_batch():
    cfg = Input.default_config().set(source=MNIST.default_config().set(split="test"),
                                     global_batch_size=8, seed=0)
    whole = next(iter(cfg.instantiate()))
    halves = [next(iter(cfg.instantiate(process_index=i, process_count=2))) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["label"] for h in halves]), whole["label"])
    with pytest.raises(errors.DataError):
        cfg.clone(global_batch_size=9).instantiate(process_index=0, process_count=2)
