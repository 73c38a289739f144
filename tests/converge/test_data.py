"""The stdlib corpus: a fixed file list, a fixed split rule, batches that depend only on (seed, step)."""
import hashlib

import pytest
import torch

from qmoe.converge.data import (HELD_OUT_EVERY, SEPARATOR, Corpus, encode_files, held_out_batches, is_held_out,
                                load_corpus, split_files, stdlib_files, train_batch)


def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_file_list_is_sorted_and_skips_installed_packages_and_the_test_package(tmp_path):
    _tree(tmp_path, {"b.py": "b", "a/z.py": "z", "a/y.py": "y", "site-packages/pkg.py": "p",
                     "x/dist-packages/q.py": "q", "test/test_x.py": "t", "a/test/ok.py": "ok", "notes.txt": "n"})
    assert stdlib_files(tmp_path) == ["a/test/ok.py", "a/y.py", "a/z.py", "b.py"]


def test_empty_root_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no Python source files"):
        stdlib_files(tmp_path)


def test_split_rule_is_the_documented_hash():
    files = [f"pkg/mod{i}.py" for i in range(200)]
    train, held = split_files(files)
    assert sorted(train + held) == sorted(files) and not set(train) & set(held)
    for f in files:
        expect = int(hashlib.sha256(f.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0
        assert is_held_out(f) == expect
    assert 0.03 < len(held) / len(files) < 0.2  # about one in HELD_OUT_EVERY


def test_encode_ends_every_file_with_the_separator(tmp_path):
    _tree(tmp_path, {"a.py": "ab", "b.py": "c"})
    data = encode_files(tmp_path, ["a.py", "b.py"])
    assert data.dtype == torch.uint8
    assert data.tolist() == [ord("a"), ord("b"), SEPARATOR, ord("c"), SEPARATOR]


def test_stdlib_corpus_is_deterministic_and_split():
    c = load_corpus()
    assert c.train_files > 100 and c.held_out_files > 10
    assert c.train.numel() > 3 * c.held_out.numel() > 0
    assert int((c.train == SEPARATOR).sum()) == c.train_files
    files = stdlib_files()
    assert files == sorted(files)
    train, held = split_files(files)
    assert (len(train), len(held)) == (c.train_files, c.held_out_files)
    assert c.describe()["fingerprint"] == c.fingerprint


def _fake_corpus():
    train = torch.full((5000,), ord("a"), dtype=torch.uint8)
    train[::7] = ord("x")
    held = torch.full((3000,), ord("b"), dtype=torch.uint8)
    return Corpus("fake", train, held, 1, 1, "0")


def test_batches_are_a_function_of_seed_and_step():
    c = _fake_corpus()
    x1, y1 = train_batch(c, 3, batch=4, seq_len=16, data_seed=0)
    x2, y2 = train_batch(c, 3, batch=4, seq_len=16, data_seed=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one byte
    assert not torch.equal(x1, train_batch(c, 4, batch=4, seq_len=16, data_seed=0)[0])
    assert not torch.equal(x1, train_batch(c, 3, batch=4, seq_len=16, data_seed=1)[0])


def test_evaluation_reads_only_the_held_out_stream():
    c = _fake_corpus()
    batches = held_out_batches(c, 3, batch=2, seq_len=8, data_seed=0)
    assert len(batches) == 3
    assert all(bool((x == ord("b")).all() and (y == ord("b")).all()) for x, y in batches)
    again = held_out_batches(c, 3, batch=2, seq_len=8, data_seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert bool((train_batch(c, 0, 2, 8, 0)[0] != ord("b")).all())


def test_text_shorter_than_a_window_is_a_clear_error():
    c = Corpus("fake", torch.zeros(10, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8), 1, 1, "0")
    with pytest.raises(ValueError, match="shorter than seq_len"):
        train_batch(c, 0, batch=1, seq_len=16, data_seed=0)
