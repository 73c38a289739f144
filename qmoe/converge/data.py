"""Text every machine has: the Python standard library's own source, as bytes.

The corpus is the `.py` files under `sysconfig.get_paths()["stdlib"]` of the Python running qmoe,
without installed packages (`site-packages`, `dist-packages`) and without the top-level `test`
package (some distributions ship it, some do not). The list is sorted by relative path, so it
does not depend on the file system's order.

Train / held-out split: a file is held out when the first 8 hex digits of the SHA-256 of its
relative path (POSIX form), read as an integer, are divisible by `HELD_OUT_EVERY`. The rule
looks only at the path, so a file stays on its side whatever else is installed.

Tokens are bytes (vocabulary 256); the files are concatenated, each followed by a NUL byte
(which Python source does not contain) marking the document boundary.

Batches do not come from an iterator with state: batch `step` is drawn from a generator seeded
by (data seed, step), so every recipe and every bf16 seed sees the same batches in the same
order, and a resumed run needs only its step to continue where it stopped.
"""
from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_EVERY = 10  # about one file in ten is held out
EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages"})
SEPARATOR = 0  # NUL ends every file


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus' files under `root` (default: this Python's stdlib), sorted."""
    root = Path(root) if root is not None else stdlib_root()
    rel = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if EXCLUDED_PARTS.intersection(parts) or parts[0] == "test" or not path.is_file():
            continue
        rel.add(Path(*parts).as_posix())
    if not rel:
        raise ValueError(f"no Python source files found under {str(root)!r} (sysconfig's stdlib path)")
    return sorted(rel)


def is_held_out(rel_path: str) -> bool:
    """The fixed split rule (see the module docstring)."""
    return int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out), each in the input's order."""
    held = [f for f in files if is_held_out(f)]
    return [f for f in files if not is_held_out(f)], held


def encode_files(root: Path, files: list[str]) -> torch.Tensor:
    """The files' bytes, each followed by SEPARATOR: [N] uint8."""
    chunks = []
    for f in files:
        chunks.append((root / f).read_bytes())
        chunks.append(bytes([SEPARATOR]))
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@dataclass
class Corpus:
    """The byte streams of the two splits and what they were made from."""

    root: str
    train: torch.Tensor  # [N_train] uint8
    held_out: torch.Tensor  # [N_held] uint8
    train_files: int
    held_out_files: int
    fingerprint: str  # SHA-256 over the file list and both streams: equal fingerprints, equal data

    def describe(self) -> dict:
        return {"source": "python stdlib", "root": self.root, "train_files": self.train_files,
                "held_out_files": self.held_out_files, "train_bytes": int(self.train.numel()),
                "held_out_bytes": int(self.held_out.numel()), "held_out_rule":
                f"sha256(relative path)[:8] % {HELD_OUT_EVERY} == 0", "fingerprint": self.fingerprint}


@functools.lru_cache(maxsize=2)
def load_corpus(root: str | None = None) -> Corpus:
    """The stdlib corpus (cached: every run in a process shares one copy)."""
    base = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(base)
    train_files, held_files = split_files(files)
    if not train_files or not held_files:
        raise ValueError(f"the corpus under {str(base)!r} has {len(files)} files: too few to split")
    train, held = encode_files(base, train_files), encode_files(base, held_files)
    h = hashlib.sha256("\n".join(files).encode())
    h.update(train.numpy().tobytes())
    h.update(held.numpy().tobytes())
    return Corpus(str(base), train, held, len(train_files), len(held_files), h.hexdigest()[:16])


def _windows(stream: torch.Tensor, generator: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    if stream.numel() < seq_len + 2:
        raise ValueError(f"the text ({stream.numel()} bytes) is shorter than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx].long()


def train_batch(corpus: Corpus, step: int, batch: int, seq_len: int,
                data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step`: (inputs [B, S], targets [B, S]) int64 on the CPU, random windows of the train stream.

    A pure function of (data_seed, step): the data order is the same for every run.
    """
    g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    w = _windows(corpus.train, g, batch, seq_len)
    return w[:, :-1], w[:, 1:]


def held_out_batches(corpus: Corpus, num_batches: int, batch: int, seq_len: int,
                     data_seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation set: `num_batches` (inputs, targets) pairs from the held-out stream."""
    g = torch.Generator().manual_seed(data_seed * 1_000_003 - 1)
    out = []
    for _ in range(num_batches):
        w = _windows(corpus.held_out, g, batch, seq_len)
        out.append((w[:, :-1], w[:, 1:]))
    return out
