"""Data for `train_looped.py`: the corpus files, a byte-level BPE tokenizer, token windows.

The corpus folder holds `train.txt` and `valid.txt` (see `prepare_corpus.py`): documents separated
by a line `<|endoftext|>`. The tokenizer is trained on the train split only and is saved beside
the checkpoint in the files the runtime reads (`tokenizer.json`, `tokenizer_config.json`).

Tokenizing a large corpus takes minutes on a small machine, so it can be done once, apart:

    PYTHONPATH=. python examples/looped_data.py --corpus .out/corpus --out .out/tokens

writes `tokenizer.json`, `train.u16.xz` and `valid.u16.xz` (the ids as little-endian uint16,
xz-compressed: about 6 bits a token, small enough to carry to a GPU machine) and `tokens.json`
(counts, SHA-256 of the corpus files and of the outputs); `train_looped.py --tokens DIR` reads them.

With `--tokenizer FILE` (e.g. `zoo/checkpoints/ouro-tiny/tokenizer.json`) the ids are made with that
tokenizer instead of a newly trained one, so a lost token folder of a checkpoint is made again with
exactly its tokenizer (and in seconds rather than minutes: no BPE training).

A smaller token folder for a short run elsewhere (a fine-tune on a GPU machine with a transfer limit):

    PYTHONPATH=. python examples/looped_data.py --subset-of .out/tokens --train-tokens 24000000 --out DIR

keeps whole train documents picked at random (seeded) up to about that many tokens, the whole
held-out split, and a `tokens.json` naming the source and the tokenizer's SHA-256 (no tokenizer
file: `finetune_looped.py` uses its checkpoint's and checks it is the same).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import time
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import torch

# ids 0, 1, 2 as in Ouro's own tokenizer: OuroForCausalLM stops generation at ids 0 and 2, so those
# ids must be special tokens that plain text never produces
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = SPECIAL_TOKENS[0]
EOS_ID = 0
# no roles, no markup: a conversation is its messages' text, which the model continues
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}"
                       "{% if not loop.last %}\n\n{% endif %}{% endfor %}")


class Corpus(NamedTuple):
    train: list[str]     # documents
    valid: list[str]


class TokenData(NamedTuple):
    train: torch.Tensor  # [N] int64: every train document's ids, each followed by EOS_ID
    valid: torch.Tensor  # [M] int64


def read_documents(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [doc.strip("\n") for doc in text.split(f"\n{EOS_TOKEN}\n") if doc.strip()]


def read_corpus(folder: str | Path) -> Corpus:
    folder = Path(folder)
    missing = [name for name in ("train.txt", "valid.txt") if not (folder / name).is_file()]
    if missing:
        raise SystemExit(f"{folder} lacks {', '.join(missing)}; build the corpus first with\n"
                         f"    python examples/prepare_corpus.py --out {folder}")
    return Corpus(read_documents(folder / "train.txt"), read_documents(folder / "valid.txt"))


def train_tokenizer(docs: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 pre-tokenisation, no unknown tokens) with the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise SystemExit(f"vocab_size={vocab_size} leaves no room for merges: byte-level BPE starts from 256 "
                         f"bytes + {len(SPECIAL_TOKENS)} special tokens; use e.g. 4096-8192")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer=trainer)
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    return tokenizer


def save_tokenizer(tokenizer, folder: str | Path, model_max_length: int) -> None:
    """`tokenizer.json` plus the `tokenizer_config.json` facts the runtime reads (eos, specials)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    added = {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False} for i, token in enumerate(SPECIAL_TOKENS)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS_TOKEN,
              "pad_token": EOS_TOKEN, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "added_tokens_decoder": added, "chat_template": PLAIN_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer, docs: list[str], chunk: int = 2048) -> torch.Tensor:
    """`[N]` int64: each document's ids followed by EOS_ID (encoded in parallel by `tokenizers`,
    `chunk` documents at a time so a large corpus never holds all encodings at once)."""
    parts = [np.zeros(0, dtype=np.int64)]
    for start in range(0, len(docs), chunk):
        for encoding in tokenizer.encode_batch(docs[start:start + chunk], add_special_tokens=False):
            parts += [np.asarray(encoding.ids, dtype=np.int64), np.array([EOS_ID], dtype=np.int64)]
    return torch.from_numpy(np.concatenate(parts))


def encode_corpus(tokenizer, corpus: Corpus, device: torch.device) -> TokenData:
    return TokenData(encode_documents(tokenizer, corpus.train).to(device),
                     encode_documents(tokenizer, corpus.valid).to(device))


TOKEN_FILES = {"train": "train.u16.xz", "valid": "valid.u16.xz"}


def write_token_file(path: Path, ids: torch.Tensor) -> None:
    if ids.numel() and int(ids.max()) > np.iinfo(np.uint16).max:
        raise ValueError(f"token id {int(ids.max())} does not fit uint16")
    path.write_bytes(lzma.compress(ids.numpy().astype("<u2").tobytes(), preset=6))


def read_token_file(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2").astype(np.int64))


def tokenize_corpus(corpus_dir: str | Path, out: str | Path, vocab_size: int,
                    tokenizer_file: str | Path | None = None) -> dict:
    """Train the tokenizer on the train split (or take `tokenizer_file`'s, copied byte for byte),
    encode both splits, write the token folder."""
    from tokenizers import Tokenizer

    corpus_dir, out = Path(corpus_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    corpus = read_corpus(corpus_dir)
    if tokenizer_file is None:
        tokenizer = train_tokenizer(corpus.train, vocab_size)
        tokenizer.save(str(out / "tokenizer.json"))
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        if Path(tokenizer_file).resolve() != (out / "tokenizer.json").resolve():
            (out / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens, {time.time() - start:.0f}s", flush=True)
    manifest: dict = {"vocab_size": tokenizer.get_vocab_size(), "files": {}, "corpus": {}}
    for split, docs in (("train", corpus.train), ("valid", corpus.valid)):
        ids = encode_documents(tokenizer, docs)
        path = out / TOKEN_FILES[split]
        write_token_file(path, ids)
        chars = sum(map(len, docs))
        manifest["files"][path.name] = {"tokens": ids.numel(), "documents": len(docs),
                                        "chars_per_token": round(chars / max(ids.numel(), 1), 3),
                                        "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        print(f"{split}: {ids.numel():,} tokens, {path.stat().st_size / 1e6:.1f} MB, {time.time() - start:.0f}s",
              flush=True)
    for name in ("train.txt", "valid.txt", "corpus.json"):
        if (corpus_dir / name).is_file():
            manifest["corpus"][name] = sha256_file(corpus_dir / name)
    if (corpus_dir / "corpus.json").is_file():                         # packages, licences: travel along
        manifest["corpus_manifest"] = json.loads((corpus_dir / "corpus.json").read_text())
    (out / "tokens.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_tokens(folder: str | Path, device: torch.device):
    """(tokenizer, TokenData on `device`, tokens.json) from a folder made by `tokenize_corpus`."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    if not (folder / "tokens.json").is_file():
        raise SystemExit(f"{folder} has no tokens.json; make it with\n"
                         f"    PYTHONPATH=. python examples/looped_data.py --corpus .out/corpus --out {folder}")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    data = TokenData(*(read_token_file(folder / TOKEN_FILES[split]).to(device) for split in ("train", "valid")))
    return tokenizer, data, json.loads((folder / "tokens.json").read_text())


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def subset_tokens(source: str | Path, out: str | Path, train_tokens: int, seed: int = 0) -> dict:
    """A token folder with a random subset of `source`'s train documents (whole documents, each
    with its EOS, drawn in a seeded random order until `train_tokens` are reached, then kept in
    corpus order) and the same held-out split. Returns the `tokens.json` it writes."""
    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = read_token_file(source / TOKEN_FILES["train"]).numpy()
    ends = np.flatnonzero(ids == EOS_ID) + 1                             # one past each document's EOS
    starts = np.concatenate([[0], ends[:-1]])
    order = np.random.default_rng(seed).permutation(len(ends))
    take = np.searchsorted(np.cumsum((ends - starts)[order]), train_tokens) + 1
    chosen = np.sort(order[:take])
    subset = torch.from_numpy(np.concatenate([ids[starts[i]:ends[i]] for i in chosen]))
    write_token_file(out / TOKEN_FILES["train"], subset)
    valid = out / TOKEN_FILES["valid"]
    valid.write_bytes((source / TOKEN_FILES["valid"]).read_bytes())
    old = json.loads((source / "tokens.json").read_text())
    files = {TOKEN_FILES["train"]: {"tokens": subset.numel(), "documents": len(chosen),
                                    "bytes": (out / TOKEN_FILES["train"]).stat().st_size,
                                    "sha256": sha256_file(out / TOKEN_FILES["train"])},
             TOKEN_FILES["valid"]: old["files"][TOKEN_FILES["valid"]]}
    manifest = {"vocab_size": old["vocab_size"], "files": files, "tokenizer_sha256": sha256_file(source / "tokenizer.json"),
                "subset_of": {"train_tokens": int(ids.size), "documents": len(ends), "seed": seed,
                              "train_sha256": old["files"][TOKEN_FILES["train"]]["sha256"]},
                "corpus": old.get("corpus", {})}
    (out / "tokens.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def random_windows(tokens: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """`[batch_size, seq_len]` windows at uniform random offsets, drawn on the tokens' device (no
    host sync). Windows cross document boundaries; the EOS between documents marks them."""
    if tokens.numel() <= seq_len:
        raise SystemExit(f"the train split has {tokens.numel()} tokens, fewer than seq_len={seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len + 1, (batch_size,), device=tokens.device,
                           generator=generator)
    return tokens[starts[:, None] + torch.arange(seq_len, device=tokens.device)]


def epoch_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless `[batch_size, seq_len]` batches that see every token once an epoch: each epoch cuts
    the stream into non-overlapping windows at a random offset and visits them in a random order
    (a short run over a small split wastes none of it; `random_windows` repeats some windows and
    misses others). `generator` is a CPU generator."""
    if tokens.numel() < (batch_size + 1) * seq_len:
        raise SystemExit(f"the train split has {tokens.numel()} tokens, fewer than {batch_size + 1} windows of "
                         f"{seq_len}")
    while True:
        offset = int(torch.randint(0, seq_len, (1,), generator=generator))
        count = (tokens.numel() - offset) // seq_len
        windows = tokens[offset:offset + count * seq_len].view(count, seq_len)
        order = torch.randperm(count, generator=generator).to(tokens.device)
        for start in range(0, count - batch_size + 1, batch_size):
            yield windows[order[start:start + batch_size]]


def heldout_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """`[N, seq_len]` consecutive non-overlapping windows from the start of the held-out stream."""
    num_windows = tokens.numel() // seq_len
    if max_tokens is not None:
        num_windows = min(num_windows, max(1, max_tokens // seq_len))
    if num_windows == 0:
        raise SystemExit(f"the valid split has {tokens.numel()} tokens, fewer than seq_len={seq_len}")
    return tokens[: num_windows * seq_len].view(num_windows, seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the tokenizer and tokenize a corpus once (see the module doc)")
    parser.add_argument("--corpus", default=".out/corpus", help="folder with train.txt, valid.txt")
    parser.add_argument("--out", default=".out/tokens", help="folder for tokenizer.json, *.u16.xz, tokens.json")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to encode with (e.g. a checkpoint's) "
                                                          "instead of training one; --vocab-size is then unused")
    parser.add_argument("--subset-of", default=None, help="a token folder: write a random subset of its train "
                                                          "documents (and its held-out split) to --out instead")
    parser.add_argument("--train-tokens", type=int, default=24_000_000, help="with --subset-of: about this many")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.subset_of:
        manifest = subset_tokens(args.subset_of, args.out, args.train_tokens, args.seed)
    else:
        manifest = tokenize_corpus(args.corpus, args.out, args.vocab_size, args.tokenizer)
    print(json.dumps(manifest["files"], indent=2))


if __name__ == "__main__":
    main()
