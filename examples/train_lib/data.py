"""Offline data: a real text corpus every machine has, a byte-level tokenizer, jsonl and synthetic.

The default corpus is the Python standard library's own source files (present wherever
Python is), read in a fixed order, so every run and every rank sees the same text. Tokens
are bytes (vocabulary 256), so no tokenizer download is needed. Sequences are fixed-length
windows; the last 5 % of the corpus is held out for validation.
"""

from __future__ import annotations

import json
import os
import sysconfig

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256  # byte-level


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenization: UTF-8 bytes as token ids."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """Inverse of ``encode`` (invalid UTF-8 is replaced)."""
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_corpus(max_mb: float) -> str:
    """Concatenated ``.py`` files of the standard library, sorted by path, up to ``max_mb``."""
    root = sysconfig.get_paths()["stdlib"]
    limit, parts, size = int(max_mb * 2**20), [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            parts.append(text)
            size += len(text)
            if size >= limit:
                return "\n".join(parts)[:limit]
    return "\n".join(parts)


def jsonl_corpus(path: str) -> str:
    """Texts of a jsonl file (one object with a ``text`` field per line), joined."""
    with open(path) as f:
        return "\n".join(json.loads(line)["text"] for line in f if line.strip())


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens (inputs double as labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.seq_len = seq_len
        self.tokens = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class SyntheticTokens(Dataset):
    """Random tokens from a fixed seed (throughput runs; the loss cannot fall much)."""

    def __init__(self, num: int, seq_len: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB_SIZE, (num, seq_len), generator=gen)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


def batch_for_cp_rank(batch: torch.Tensor) -> torch.Tensor:
    """This rank's part of each sequence when context parallelism is on (SMP's layout).

    The sequence is cut into ``2 * cp`` chunks and context parallel rank ``r`` keeps chunks
    ``r`` and ``2 * cp - 1 - r`` (``torch.sagemaker.context_parallel.split_sequence``).
    """
    from torch.sagemaker.context_parallel import split_sequence

    return split_sequence(batch, dim=1)


def build_datasets(
    dataset: str, seq_len: int, corpus_mb: float, data_path: str | None, num_synthetic: int
) -> tuple[Dataset, Dataset | None]:
    """Train and validation datasets (validation is ``None`` for synthetic data)."""
    if dataset == "synthetic":
        return SyntheticTokens(num_synthetic, seq_len), None
    if dataset == "jsonl":
        if not data_path:
            raise ValueError(
                "--dataset jsonl needs --data-path FILE.jsonl (one {'text': ...} per line)"
            )
        text = jsonl_corpus(data_path)
    else:
        text = stdlib_corpus(corpus_mb)
    tokens = encode(text)
    split = int(len(tokens) * 0.95)
    return TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len)
