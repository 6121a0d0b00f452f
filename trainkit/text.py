"""Text for language-model jobs: a corpus (a folder of .txt/.jsonl files, or the built-in one),
a tokenizer (the model folder's own, or bytes), and the corpus as fixed-length blocks of token ids.

The driver reads and tokenizes the corpus once, before any worker starts, and every rank gets
the token ids with the job's config. The ids are cached by content (`$DLC_HOME/tokens/<sha256>.npy`,
the key covering every file's bytes and the tokenizer), so a rerun over the same files does not
tokenize them again.

The built-in corpus is the licence texts of the installed Python packages (each text once, in
package order): English prose every environment of this project holds, so the demo runs offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from .errors import UserError
from .flags import dlc_home

LICENCE = re.compile(r"(LICEN[CS]E|COPYING|NOTICE)[^/]*$", re.IGNORECASE)
SUFFIXES = (".txt", ".jsonl")


class ByteTokenizer:
    """Token ids 0-255 are a text's UTF-8 bytes; 256 ends a document. No files, no training:
    the tokenizer a model built from a config uses (its vocabulary: `vocab_size`)."""

    name = "bytes"
    eos = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class FolderTokenizer:
    """A Hugging Face tokenizer saved beside a model (`save_pretrained`), loaded from its folder
    only (nothing is fetched)."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.name = f"folder:{folder}"
        self.eos = self.tokenizer.eos_token_id
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def tokenizer_for(model_dir: Path | None):
    """The model folder's own tokenizer where it has one, else bytes."""
    if model_dir is not None and any((model_dir / f).is_file() for f in
                                     ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return FolderTokenizer(model_dir)
    return ByteTokenizer()


def builtin_documents() -> list[tuple[str, str]]:
    """(name, text) of every installed package's licence files, each distinct text once."""
    seen, docs = set(), []
    dists = sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    for dist in dists:
        for f in sorted(dist.files or [], key=str):
            if not LICENCE.search(str(f)):
                continue
            try:
                text = Path(str(dist.locate_file(f))).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha256(text.encode()).digest()
            if text.strip() and digest not in seen:
                seen.add(digest)
                docs.append((f"{dist.metadata['Name']}/{f}", text))
    return docs


def folder_documents(folder: Path) -> list[tuple[str, str]]:
    """(name, text) of every .txt file, and every line's "text" of every .jsonl file, in a folder
    (searched recursively, in path order); one line for a folder that holds none."""
    if not folder.is_dir():
        raise UserError(f"--data {folder}: no such folder; give a folder of .txt or .jsonl files")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    docs = []
    for path in files:
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--data: cannot read {path} as UTF-8 text ({e.__class__.__name__}); "
                            "fix or remove it") from None
        if path.suffix == ".txt":
            docs.append((str(path), content))
            continue
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                docs.append((f"{path}:{n}", record["text"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--data: {path} line {n} is not a JSON object with a \"text\" field; "
                                "fix it, or give .txt files") from None
    if not any(text.strip() for _, text in docs):
        raise UserError(f"--data {folder}: no text in it (.txt files, or .jsonl lines with a \"text\" "
                        f"field; found {len(files)} file(s)); add some, or leave --data out for the "
                        "built-in corpus")
    return docs


def tokenize(docs: list[tuple[str, str]], tokenizer, cache: Path | None = None) -> np.ndarray:
    """Every document's ids, each followed by the end-of-document id, as one array; cached by
    the documents' content and the tokenizer in `cache` (default $DLC_HOME/tokens)."""
    h = hashlib.sha256(tokenizer.name.encode())
    for name, text in docs:
        h.update(b"\0" + name.encode() + b"\0" + text.encode())
    cache = cache or dlc_home() / "tokens"
    path = cache / f"{h.hexdigest()}.npy"
    if path.is_file():
        return np.load(path)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    ids = np.fromiter((i for _, text in docs for i in (*tokenizer.encode(text), tokenizer.eos)), dtype=dtype)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, ids)
        tmp.replace(path)
    except OSError:
        pass  # no cache where the home is read-only: tokenized again next time
    return ids


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus cut into blocks of `block` ids, checked on the driver (sent to every rank)."""

    blocks: np.ndarray  # (n, block) token ids
    source: str  # what it is, for the run's first line
    documents: int
    tokens: int

    def describe(self) -> str:
        return (f"{self.source}: {self.documents} document(s), {self.tokens} tokens in "
                f"{len(self.blocks)} blocks of {self.blocks.shape[1]}")


def corpus(data: str | None, tokenizer, block: int, limit: int | None) -> Corpus:
    """The corpus as blocks: `--data` (a folder) or the built-in licences, the first `limit`
    tokens; one line when it does not hold two blocks (one to train on, one to validate)."""
    docs = folder_documents(Path(data).expanduser()) if data else builtin_documents()
    source = f"text in {data}" if data else "the installed packages' licence texts"
    if not docs:
        raise UserError("no built-in text found (no package licence files installed); give --data")
    ids = tokenize(docs, tokenizer)
    if limit is not None:
        ids = ids[:limit]
    n = len(ids) // block
    if n < 2:
        raise UserError(f"{source} holds {len(ids)} tokens, fewer than two blocks of --block-size "
                        f"{block}; give more text or a smaller --block-size")
    return Corpus(np.ascontiguousarray(ids[: n * block].reshape(n, block)), source, len(docs), len(ids))
