"""Fixtures for the HTTP server tests: the golden tiny Ouro with a small tokenizer and chat template,
engines over it, and a live uvicorn server on a loopback port in a background thread.

Test modules that need the `serve` extra (FastAPI, uvicorn, ...) skip without it, saying so; CI
installs it through the `dev` extra."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hal
import zoo
from helpers import GOLDEN
from live_server import LiveServer, serving, write_tokenizer
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A copy of the golden ouro-tiny checkpoint with tokenizer.json and tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("ouro-tiny-chat")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / "ouro-tiny" / name, folder / name)
    write_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    return folder


@pytest.fixture(scope="session")
def tiny_model(checkpoint):
    return zoo.from_pretrained(checkpoint, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer.from_folder(checkpoint)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # the engine thread, the event loop and the client share 2 cores; torch's spinning intra-op
    # threads would starve them (a step of the tiny model takes 50x longer)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine(tiny_model, tokenizer):
    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 512)
        return LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(**options), tokenizer)
    return make


@pytest.fixture
def live_server():
    """`live_server(app, shutdown_timeout_s=...)` starts one; all are stopped at the end of the test."""
    servers = []

    def start(app, **options) -> LiveServer:
        servers.append(LiveServer(app, **options).start())
        return servers[-1]
    yield start
    for server in servers:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    """A live server over a fresh engine on the tiny model; when the module is done, no KV block
    may still be held."""
    from runtime.server.config import ServerConfig

    engine = LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(num_kv_blocks=512), tokenizer)
    yield from serving(engine, ServerConfig(model_name="tiny"))


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client on `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
