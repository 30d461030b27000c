"""Chat templates and tokenizers: rendering as Hugging Face does, each family's special tokens, the
CLI's chat=true path rendering the prompt and stopping on the family's stop token, and text prompts
getting the tokenizer's special tokens where chat prompts get only the template's."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors

import zoo
from helpers import ROOT
from runtime import LLM, SamplingParams
from runtime.text.chat import ChatTemplateError, apply_chat_template, render_chat
from runtime.text.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HUGINN = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|begin_header|>' + ('Huginn' if m['role'] == 'assistant' else m['role'])"
          " + '<|end_header|>\\n\\n' + m['content'] + '<|end_turn|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}")
NANBEIGE = ("{% if messages[0]['role'] not in ['system', 'user'] %}"
            "{{ raise_exception('conversations start with a system or user turn') }}{% endif %}"
            + CHATML.removesuffix("{% endif %}")
            + "{% if enable_thinking is defined and enable_thinking is false %}"
              "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")

# family -> tiny config, special tokens at their real ids, tokenizer_config, the stop token the test
# makes the model emit, and the prompt the template must render for one user turn "Hi"
FAMILIES = {
    "ouro": dict(
        config=dict(model_type="ouro", vocab_size=320, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, total_ut_steps=2,
                    eos_token_id=0),
        specials={"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        tokenizer_config=dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>", chat_template=CHATML),
        stop="<|im_end|>", rendered="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    "huginn": dict(
        config=dict(model_type="huginn_raven", vocab_size=65536, n_embd=16, n_heads=2, intermediate_size=32,
                    n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1, block_size=64,
                    mean_recurrence=2, init_values={"std": 0.1, "embed_scale": 4.0}, eos_token_id=65505),
        specials={"<|begin_text|>": 65504, "<|end_text|>": 65505, "<|begin_header|>": 65506,
                  "<|end_header|>": 65507, "<|end_turn|>": 65508, "<|pad|>": 65509},
        tokenizer_config=dict(bos_token="<|begin_text|>", eos_token="<|end_text|>",
                              pad_token={"content": "<|pad|>", "special": True}, chat_template=HUGINN),
        stop="<|end_text|>",
        rendered="<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
                 "<|begin_header|>Huginn<|end_header|>\n\n"),
    "nanbeige": dict(
        config=dict(model_type="nanbeige", vocab_size=166144, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    num_loops=2, eos_token_id=166101),
        specials={"<|im_start|>": 166100, "<|im_end|>": 166101, "<think>": 166102, "</think>": 166103},
        tokenizer_config=dict(eos_token={"content": "<|im_end|>", "special": True}, chat_template=NANBEIGE),
        stop="<|im_end|>", rendered="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"),
}


def byte_level_tokenizer(specials: dict[str, int]) -> Backend:
    """Byte-level BPE without merges (ids 3..258) plus the family's special tokens at their real ids."""
    vocab = {ch: 3 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(specials)
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def write_checkpoint(folder, family: str) -> Tokenizer:
    """A tiny random model whose greedy first reply token is the family's stop token: its head row for
    that token is set along the final hidden state of the prompt's last position (Huginn: zero
    initial state). That leaves the prompt's hidden states unchanged: the head is untied, or (Huginn,
    tied) the prompt does not hold the token."""
    spec = FAMILIES[family]
    folder.mkdir()
    byte_level_tokenizer(spec["specials"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(spec["tokenizer_config"]))
    tokenizer = Tokenizer.from_folder(folder)
    model = zoo.from_config(spec["config"], dtype="float32", seed=0)
    hi = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.encode(apply_chat_template(tokenizer, hi, enable_thinking=family == "nanbeige"))
    stop = spec["specials"][spec["stop"]]
    assert family != "huginn" or stop not in ids
    seen = {}
    hook = model.lm_head.register_forward_hook(
        lambda mod, args, out: seen.update(h=args[0][0, -1], top=out.max()))
    with torch.no_grad():
        model(torch.tensor([ids]), **({"init_scale": 0.0} if family == "huginn" else {}))
        hook.remove()
        model.lm_head.weight[stop] = seen["h"] * (seen["top"] + 10) / seen["h"].dot(seen["h"])
    state = {name: t.clone().contiguous() for name, t in model.state_dict().items()}   # tied: stored twice
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(spec["config"]))
    return tokenizer


def run_generate_in_process(*overrides: str) -> list[dict]:
    from hydra import compose, initialize_config_dir

    from runtime.generate import CONF_DIR, run

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run(compose("generate", overrides=list(overrides)))


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_chat_renders_and_stops_on_the_family_stop_token(family, tmp_path):
    spec = FAMILIES[family]
    tokenizer = write_checkpoint(tmp_path / family, family)
    [result] = run_generate_in_process("hal=cpu", f"model.path={tmp_path / family}", "prompt=Hi", "chat=true",
                                       "max_tokens=8", "temperature=0", "init_scale=0")
    assert result["prompt"] == spec["rendered"]
    assert result["prompt_token_ids"] == tokenizer.encode(spec["rendered"])
    special_ids = {i for t, i in spec["specials"].items() if t in spec["rendered"]}
    assert special_ids and special_ids <= set(result["prompt_token_ids"])
    assert result["token_ids"] == [spec["specials"][spec["stop"]]] and result["finish_reason"] == "stop"
    assert result["text"] == ""                                       # special tokens are not printed


def test_cli_chat_with_thinking_renders_and_stops(tmp_path):
    spec = FAMILIES["nanbeige"]
    write_checkpoint(tmp_path / "nanbeige", "nanbeige")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [f"model.path={tmp_path / 'nanbeige'}", "hal=cpu", "prompt=Hi", "chat=true",
            "enable_thinking=true", "max_tokens=8", "temperature=0", "output=json"]
    proc = subprocess.run([sys.executable, "-m", "runtime.generate", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["prompt"] == spec["rendered"]
    assert result["prompt_token_ids"][0] == 166100                   # <|im_start|>
    assert result["prompt_token_ids"][-2] == 166102                  # <think>, then "\n"
    assert result["token_ids"] == [166101] and result["finish_reason"] == "stop"


def test_chat_rejects_prompt_ids(tmp_path):
    from runtime.generate import UsageError

    with pytest.raises(UsageError, match="chat=true"):
        run_generate_in_process("hal=cpu", f"model.path={tmp_path}", "prompt_ids=[1,2]", "chat=true")


def test_render_like_hugging_face():
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% generation %}{{ m['role'] }}:{{ m['content'] | tojson }}{% endgeneration %}\n"
                "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    messages = [{"role": "user", "content": "é \"q\""}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "dropped by break"}]
    text = render_chat(template, messages, add_generation_prompt=True, special_tokens={"bos_token": "<s>"})
    # trim_blocks drops the newline after a block tag; tojson keeps non-ASCII
    assert text == '<s>user:"é \\"q\\""assistant:"ok"A:'
    with pytest.raises(ChatTemplateError, match="system or user"):
        render_chat(NANBEIGE, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        render_chat(CHATML, ["just a string"])
    for message, needle in (({"role": "user"}, "message 0 has no 'content'"), ({"role": 1, "content": "x"}, "role must"),
                            ({"role": "user", "content": 5}, "content must be text")):
        with pytest.raises(ValueError, match=needle):
            render_chat(CHATML, [message])
    with pytest.raises(ChatTemplateError, match="the chat template failed on these messages"):   # not a crash
        render_chat("{{ messages[0].name + '!' }}", [{"role": "user", "content": "x", "name": None}])


def test_null_content_parts_and_undefined_tools_render_as_vllm_and_transformers_do():
    """An assistant's tool call with null content renders an empty text (vLLM; not "None"), text
    parts join a line each (vLLM), and tools / documents are None in the template unless given
    (transformers), so `tools is not none` holds only with tools."""
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert render_chat(CHATML, [call], add_generation_prompt=False) == "<|im_start|>assistant\n<|im_end|>\n"
    assert render_chat("{{ messages[0].content }}", [{"role": "assistant", "tool_calls": [{"id": "1"}]}]) == ""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert render_chat("{{ messages[0].content }}", [{"role": "user", "content": parts}]) == "Hello\nworld"
    tools = "{% if tools is not none %}T{{ tools | tojson }}{% endif %}{{ documents is none }}"
    assert render_chat(tools, [{"role": "user", "content": "Hi"}]) == "True"
    assert render_chat(tools, [{"role": "user", "content": "Hi"}], tools=[{"name": "f"}]) == 'T[{"name": "f"}]True'


def test_continue_final_message_cuts_after_the_content_not_inside_the_closing_tag():
    """A last message whose text also occurs in the turn's closing tag ("end" in <|im_end|>) is cut
    where the template wrote it, not at its last occurrence."""
    tokenizer = Tokenizer(Backend(models.BPE()), {"chat_template": CHATML})
    for content in ("end", "m", "Well, the"):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
        text = apply_chat_template(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
        assert text == f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{content}"
    # a template that rewrites the content: its last occurrence, as transformers finds it
    upper = "{% for m in messages %}[{{ m.content | upper }}]{% endfor %}"
    assert apply_chat_template(tokenizer, [{"role": "user", "content": "A"}], add_generation_prompt=False,
                               continue_final_message=True, chat_template=upper) == "[A"


def test_thinking_opener_and_tokenizer_special_tokens(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    byte_level_tokenizer(FAMILIES["nanbeige"]["specials"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    special_map = {"bos_token": "<|im_start|>", "eos_token": "x"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    (folder / "chat_template.jinja").write_text(NANBEIGE)
    tok = Tokenizer.from_folder(folder)
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}   # config wins
    assert (tok.bos_token_id, tok.eos_token_id) == (166100, 166101)
    hi = [{"role": "user", "content": "Hi"}]
    # as transformers: enable_thinking reaches the template only when given; False makes this one close
    # an empty thought block itself, left out it keeps the template's default
    assert apply_chat_template(tok, hi).endswith("assistant\n")
    assert apply_chat_template(tok, hi, enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    thinking = apply_chat_template(tok, hi, enable_thinking=True)
    assert thinking.endswith("assistant\n<think>\n") and thinking.count("<think>") == 1
    assert not apply_chat_template(tok, hi, add_generation_prompt=False).endswith("<think>\n")
    huginn = byte_level_tokenizer(FAMILIES["huginn"]["specials"])
    no_think = Tokenizer(huginn, {"chat_template": HUGINN, "bos_token": "<|begin_text|>"})
    with pytest.raises(ValueError, match="<think> token"):
        apply_chat_template(no_think, hi, enable_thinking=True)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(Tokenizer(huginn, {}), hi)


def test_chat_template_jinja_wins_over_the_config_copy(tmp_path):
    """transformers reads chat_template.jinja over tokenizer_config.json's template: a checkpoint
    whose template was updated in the file renders the new one."""
    folder = tmp_path / "tok"
    folder.mkdir()
    byte_level_tokenizer(FAMILIES["ouro"]["specials"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "OLD"}))
    (folder / "chat_template.jinja").write_text("NEW")
    assert Tokenizer.from_folder(folder).chat_template == "NEW"


def test_named_templates_take_default_and_refuse_a_list_without_one():
    """A list of named templates (tokenizer_config.json's older form) renders the one named "default";
    without one, transformers raises rather than guessing, and so do we, naming the choices."""
    huginn = byte_level_tokenizer(FAMILIES["huginn"]["specials"])
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    assert Tokenizer(huginn, {"chat_template": listed}).chat_template == "PLAIN"
    no_default = Tokenizer(huginn, {"chat_template": listed[:1] + [{"name": "rag", "template": "RAG"}]})
    with pytest.raises(ValueError, match=r"named \['rag', 'tool_use'\] and none named 'default'"):
        apply_chat_template(no_default, [{"role": "user", "content": "hi"}])
    # with tools, transformers takes "tool_use" (default or not)
    hi = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(no_default, hi, tools=[{"type": "function"}]) == "TOOLS"
    with_default = Tokenizer(huginn, {"chat_template": listed})
    assert apply_chat_template(with_default, hi, tools=[{"type": "function"}]) == "TOOLS"


def post_processed(single: str) -> Tokenizer:
    """A byte-level tokenizer whose tokenizer.json post-processor follows `single`: "<s> $A" adds a
    BOS as Llama's does, "<s> $A </s>" an end token too, as Huginn-0125's does; its chat template
    writes the BOS itself."""
    backend = byte_level_tokenizer({"<s>": 0, "</s>": 1, "<|im_start|>": 2})
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 0), ("</s>", 1)])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ bos_token }}" + CHATML})


def test_a_text_prompt_gets_the_post_processors_bos_and_not_its_end_token():
    llama, huginn = post_processed("<s> $A"), post_processed("<s> $A </s>")
    plain = llama.encode("Hi there")
    assert plain == huginn.encode("Hi there") and len(plain) == 8 and not {0, 1} & set(plain)
    assert llama.encode_prompt("Hi there") == [0, *plain]
    assert huginn.encode("Hi there", add_special_tokens=True) == [0, *plain, 1]
    assert huginn.encode_prompt("Hi there") == [0, *plain]          # cut, as Huginn's model card does
    assert huginn.encode_prompt("Hi</s>") == [0, *huginn.encode("Hi"), 1]   # the text's own end token stays
    assert huginn.encode_prompt("") == [0]
    # no post-processor (the packaged ouro-tiny's tokenizer.json): nothing is added
    packaged = Tokenizer.from_folder(ROOT / "zoo" / "checkpoints" / "ouro-tiny")
    assert packaged.encode_prompt("In the beginning") == packaged.encode("In the beginning")


@pytest.mark.parametrize("single", ["<s> $A", "<s> $A </s>"])
def test_llm_gives_text_prompts_the_bos_and_chat_prompts_only_the_templates(single):
    """As vLLM: `generate` on text adds the tokenizer's special tokens; `chat` encodes the rendered
    template as written, so its BOS is not doubled."""
    tokenizer = post_processed(single)
    model = zoo.from_config(FAMILIES["ouro"]["config"], dtype="float32", seed=0)
    llm = LLM(model, hal="cpu", tokenizer=tokenizer, num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    hi = tokenizer.encode("Hi")
    assert llm.encode("Hi") == ("Hi", [0, *hi])
    assert llm.encode({"prompt_token_ids": hi}) == (None, hi)                # ids are taken as given
    out = llm.generate("Hi", greedy)[0]
    assert (out.prompt, out.prompt_token_ids) == ("Hi", [0, *hi])
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], greedy)
    assert chat.prompt == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt_token_ids == tokenizer.encode(chat.prompt)
    assert chat.prompt_token_ids[:2] == [0, 2] and chat.prompt_token_ids.count(0) == 1
    assert 1 not in chat.prompt_token_ids


def test_llm_chat_takes_vllms_template_arguments():
    """add_generation_prompt, continue_final_message (the text ends after the last message's content,
    the model continues it), chat_template and chat_template_kwargs, as LLM.chat in vLLM."""
    packaged = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
    llm = LLM(packaged, hal="cpu", dtype="float32", num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    source = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</>\n{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}{{ x }}")
    hi = [{"role": "user", "content": "Hi"}]

    def prompt(messages, **options):
        return llm.chat(messages, greedy, chat_template=source, **options)[0].prompt
    assert prompt(hi, chat_template_kwargs={"x": 7}) == "<user>Hi</>\n<assistant>7"
    assert prompt(hi, add_generation_prompt=False) == "<user>Hi</>\n"
    begun = hi + [{"role": "assistant", "content": "Well, the "}]
    assert prompt(begun, add_generation_prompt=False, continue_final_message=True) == \
        "<user>Hi</>\n<assistant>Well, the"
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        prompt(begun, continue_final_message=True)
    assert prompt(hi, chat_template_kwargs={"enable_thinking": False, "x": 1}).endswith("<assistant>1")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set special_tokens"):
        prompt(hi, chat_template_kwargs={"special_tokens": {}})
    assert llm.chat(begun, greedy, add_generation_prompt=False, continue_final_message=True)[0].prompt.endswith(
        "Well, the")                                 # the checkpoint's own template
