"""Helpers of the HTTP server tests: a small tokenizer for the golden tiny Ouro, a live uvicorn
server on a loopback port in a background thread, and polling."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]     # ids 0..3, as in Ouro's
BYTE_TOKENS = ["<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
SENTENCES = ["the cat sat on the mat.", "a looped model applies the same weights again and again!",
             "hello, how are you? i am fine, thanks.", "user: what is the capital of france?",
             "assistant: the capital of france is paris.", "loops make a small model think longer."]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A BPE tokenizer (Llama-style byte fallback, so é and € split over byte tokens) trained on a
    few sentences, filling exactly the model's vocabulary, plus a ChatML-like chat template."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(BYTE_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz.,!?':\n▁"),
                                  show_progress=False)
    backend.train_from_iterator(SENTENCES, trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for token in BYTE_TOKENS:
        vocab[token] = len(vocab)
    assert len(vocab) == vocab_size, len(vocab)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))


class LiveServer:
    """`runtime.serve`'s uvicorn server for `app` on 127.0.0.1 (a free port) in a thread; `stop()` is
    the graceful shutdown SIGTERM starts."""

    def __init__(self, app, shutdown_timeout_s: float = 10.0) -> None:
        from runtime.server.http_server import make_server

        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = make_server(app, shutdown_timeout_s=shutdown_timeout_s, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def loop(self):
        return self.app.state.engine_loop

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the server did not shut down"
        self.socket.close()

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serving(engine, config):
    """Generator for module fixtures: `engine` behind the app built with `config`, live; afterwards
    the engine's block pool must be whole (nothing a request held leaks)."""
    from runtime.server.app import build_app

    live = LiveServer(build_app(engine, config)).start()
    yield live
    live.stop()
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
