"""Data for `train_looped.py`: the corpus files, a byte-level BPE tokenizer, token windows.

The corpus folder holds `train.txt` and `valid.txt` (see `prepare_corpus.py`): documents separated
by a line `<|endoftext|>`. The tokenizer is trained on the train split only and is saved beside
the checkpoint in the files the runtime reads (`tokenizer.json`, `tokenizer_config.json`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, NamedTuple

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


def encode_documents(tokenizer, docs: list[str]) -> torch.Tensor:
    """`[N]` int64: each document's ids followed by EOS_ID (encoded in parallel by `tokenizers`)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += encoding.ids
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def encode_corpus(tokenizer, corpus: Corpus, device: torch.device) -> TokenData:
    return TokenData(encode_documents(tokenizer, corpus.train).to(device),
                     encode_documents(tokenizer, corpus.valid).to(device))


def random_windows(tokens: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """`[batch_size, seq_len]` windows at uniform random offsets, drawn on the tokens' device (no
    host sync). Windows cross document boundaries; the EOS between documents marks them."""
    if tokens.numel() <= seq_len:
        raise SystemExit(f"the train split has {tokens.numel()} tokens, fewer than seq_len={seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len + 1, (batch_size,), device=tokens.device,
                           generator=generator)
    return tokens[starts[:, None] + torch.arange(seq_len, device=tokens.device)]


def heldout_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """`[N, seq_len]` consecutive non-overlapping windows from the start of the held-out stream."""
    num_windows = tokens.numel() // seq_len
    if max_tokens is not None:
        num_windows = min(num_windows, max(1, max_tokens // seq_len))
    if num_windows == 0:
        raise SystemExit(f"the valid split has {tokens.numel()} tokens, fewer than seq_len={seq_len}")
    return tokens[: num_windows * seq_len].view(num_windows, seq_len)
