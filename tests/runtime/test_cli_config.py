"""One CLI configuration: generate, serve and bench compose one engine node and spell every option
the same way; old spellings fail with one line naming the new one; bad values (corrupt checkpoints,
ports, limits, depths) end every CLI with one line, a non-zero status and no traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from helpers import ROOT, golden_case
from runtime.cli import CONF_DIR, UsageError, engine_config, register_schemas
from runtime.cli_args import check_spellings, old_spellings
from runtime.config import EngineConfig

register_schemas()

ENGINE = ["engine.kv_mode=shared", "engine.max_num_seqs=3", "engine.kv_dtype=int8", "engine.graphs=false",
          "engine.max_num_batched_tokens=64", "engine.max_num_loops=9", "engine.num_kv_blocks=40"]


def composed(name, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.mark.parametrize("cli", ["generate", "serve", "bench"])
def test_the_three_clis_share_one_engine_node(cli):
    config = engine_config(composed(cli, *ENGINE, "model.dtype=float16"))
    assert (config.kv_mode, config.max_num_seqs, config.kv_dtype, config.graphs, config.max_num_batched_tokens,
            config.max_num_loops, config.num_kv_blocks) == ("shared", 3, "int8", False, 64, 9, 40)
    assert composed(cli, "model.dtype=float16").model.dtype == "float16"
    spec = engine_config(composed(cli, "engine.speculative.num_tokens=2", "engine.speculative.mode=async"))
    assert (spec.speculative.num_tokens, spec.speculative.mode) == (2, "async")


@pytest.mark.parametrize("cli", ["generate", "serve", "bench"])
def test_model_num_loops_is_the_engines_default_depth(cli):
    """The passes the engine captures at start, and its KV plan, follow the depth requests take."""
    assert engine_config(composed(cli, "model=ouro-1.4b", "model.num_loops=2")).default_num_loops == 2
    assert engine_config(composed(cli, "model=ouro-1.4b")).default_num_loops is None
    with pytest.raises(UsageError, match="model.num_loops=0 is outside"):
        engine_config(composed(cli, "model=ouro-1.4b", "model.num_loops=0"))


def test_defaults_are_the_engine_configs():
    defaults = EngineConfig()
    for cli in ("generate", "serve"):
        assert engine_config(composed(cli)) == defaults
    assert engine_config(composed("bench")).max_num_batched_tokens == 8192       # bench's own default
    assert composed("bench").model.dtype == "bfloat16"


@pytest.mark.parametrize("old,new", [("kv_mode=shared", "engine.kv_mode=shared"),
                                     ("speculative.num_tokens=4", "engine.speculative.num_tokens=4"),
                                     ("kv_dtype=fp8", "engine.kv_dtype=fp8"), ("dtype=float32", "model.dtype=float32"),
                                     ("weights_dtype=fp8", "engine.weights_dtype=fp8"),
                                     ("graphs=false", "engine.graphs=false"),
                                     ("+async_scheduling=true", "engine.async_scheduling=true"),
                                     ("server.max_num_loops=8", "engine.max_num_loops=8")])
def test_an_old_spelling_names_the_new_one(old, new, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_spellings(["hal=cpu", old])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and new in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("config,arg,hint", [
    ("generate", "hal=cdua", "one of the hal options: ascend, ascend-sim, auto, cpu, cuda, rocm"),
    ("serve", "model=ouro-1.4", "ouro-1.4b, ouro-1.4b-thinking"),
    ("generate", "engine.max_num_seqs=abc", "give a whole number"),
    ("generate", "chat=maybe", "give true or false"),
    ("bench", "matmul_size=1.5", "give a whole number"),
    ("serve", "server.allowed_origins=*", "'server.allowed_origins=[...]'"),
    ("generate", "hydra/job_logging=nope", "hydra/job_logging=nope is not one of the hydra/job_logging options")])
def test_an_override_hydra_cannot_compose_ends_in_one_line(config, arg, hint, capsys):
    """Hydra's own message for these is a dozen lines ending in its search path."""
    from runtime.cli_args import check_composes
    register_schemas()
    with pytest.raises(SystemExit) as exit_info:
        check_composes(["hal=cpu", arg], config)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and hint in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    check_composes(["hal=cpu", "engine.max_num_seqs=4"], config)           # good overrides pass
    check_composes(["--help", "hal=cdua"], config)                          # Hydra's flags: Hydra's rules


@pytest.mark.parametrize("argv,hint", [(["--port", "8000"], "port="), (["--model=ByteDance/Ouro-1.4B"], "model.path="),
                                       (["--max-model-len", "4096"], "engine.max_model_len="),
                                       (["--enforce-eager"], "engine.graphs=false"),
                                       (["--trust-remote-code"], "trust_remote_code=...")])
def test_a_vllm_flag_names_the_override(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_spellings(["hal=cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and hint in err and "key=value" in err and len(err.strip().splitlines()) == 1
    check_spellings(["--cfg", "job", "-m", "--help", "port=8000"])          # Hydra's own flags pass


def test_unknown_keys_are_named_and_hydra_forms_pass(capsys):
    from runtime.cli_args import check_known_keys
    from runtime.config import BenchConfig, GenerateConfig, ServeConfig

    check_known_keys(["hal=cpu", "model=ouro-tiny", "hydra/job_logging=default", "hydra.run.dir=/tmp/x",
                      "+engine.kv_mode=full", "~prompt", "engine.speculative.num_tokens=2", "hal@hal=cpu",
                      "--cfg", "job", "max_tokens=3"], GenerateConfig, "runtime.generate")
    check_known_keys(["workloads.tiny.batch=3", "workload=[tiny]"], BenchConfig, "runtime.bench")
    check_known_keys(["server.max_num_requests=3", "port=0"], ServeConfig, "runtime.serve")
    with pytest.raises(SystemExit):             # set from the model node, not an option
        check_known_keys(["server.default_num_loops=3"], ServeConfig, "runtime.serve")
    assert "server.default_num_loops is set from the model node" in capsys.readouterr().err


@pytest.mark.parametrize("command,argv,hint", [
    ("runtime.generate", ["Hello world"], "'prompt=Hello world'"),
    ("runtime.bench", ["hal=cpu", "b1"], "workload=[b1]"),
    ("runtime.serve", ["8000"], "'8000' is not an override (key=value)"),
    ("runtime.generate", ["prompt=Hello,world"], "'prompt=\"Hello,world\"'"),
    ("runtime.bench", ["workload=b1,tiny"], "'workload=[b1,tiny]'"),
    ("runtime.generate", ["engine=5"], "engine is a node of options (engine.<field>=5)"),
    ("runtime.serve", ["engine.default_num_loops=3"], "set model.num_loops= instead (model.num_loops=3)"),
    ("runtime.serve", ["server.sampling.top_k=3"], "set model.top_k= instead (model.top_k=3)"),
    ("runtime.serve", ["server.sampling.min_p=0.1"], "it comes from the checkpoint's generation_config.json"),
    ("runtime.generate", ["max_tokens=2,3"], "one run per value, which needs -m")])
def test_arguments_hydra_would_answer_with_its_grammar_end_in_one_line(command, argv, hint, capsys):
    """A bare word (Hydra: a lexer error and a HYDRA_FULL_ERROR hint), a comma (a sweep: three lines
    on multirun), a node given a value (a traceback), a field the model node sets (`+key=` advice)."""
    from runtime.cli_args import check_argv
    from runtime.config import BenchConfig, GenerateConfig, ServeConfig

    schema = {"runtime.generate": GenerateConfig, "runtime.bench": BenchConfig, "runtime.serve": ServeConfig}[command]
    with pytest.raises(SystemExit) as exit_info:
        check_argv(argv, schema, command, command.split(".")[1], serves=command == "runtime.serve")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and hint in err and len(err.strip().splitlines()) == 1, err
    check_argv(["-m", "max_tokens=2,3"], GenerateConfig, "runtime.generate", "generate")     # a sweep on multirun
    check_argv(["hydra.mode=MULTIRUN", "max_tokens=2,3"], GenerateConfig, "runtime.generate", "generate")
    check_argv(["engine={max_num_seqs:4}"], GenerateConfig, "runtime.generate", "generate")   # a node's fields merge


def test_log_level_takes_any_case_and_refuses_other_words(capsys):
    from runtime.cli import setup_logging

    for level in ("debug", "Info", "WARNING", "warn", "FATAL"):
        setup_logging(level)
    with pytest.raises(SystemExit) as exit_info:
        setup_logging("verbose")
    assert exit_info.value.code == 2 and "log_level=verbose is not a level" in capsys.readouterr().err


def test_a_server_flag_outside_the_server_names_runtime_serve(capsys):
    with pytest.raises(SystemExit):
        check_spellings(["--port", "8000"], serves=True)
    assert "runtime.serve" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_spellings(["--port", "8000"])                                  # runtime.generate, bench
    err = capsys.readouterr().err
    assert "runtime.serve's port=" in err and "serves nothing" in err


def test_every_engine_field_has_one_spelling():
    renames = old_spellings()
    assert all(renames[name] == f"engine.{name}" for name in EngineConfig.__dataclass_fields__)
    check_spellings(["engine.kv_mode=shared", "model.dtype=float32", "prompt=kv_mode=x", "max_tokens=3"])


def test_bad_engine_values_name_the_setting():
    with pytest.raises(UsageError, match="engine.max_num_seqs must be an integer >= 1, got 0"):
        engine_config(composed("generate", "engine.max_num_seqs=0"))


# ----- through the command lines: one line, no traceback ----------------------------------------
def run(module, *args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def assert_one_line(proc, *needles):
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def broken_checkpoints(tmp_path_factory):
    source = golden_case("ouro-tiny").path
    folders = {}
    data = (source / "model.safetensors").read_bytes()
    for name, content in (("truncated", data[:len(data) // 3]), ("random", os.urandom(4096))):
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(source / "config.json", folder / "config.json")
        (folder / "model.safetensors").write_bytes(content)
        folders[name] = folder
    return folders


@pytest.mark.parametrize("kind", ["truncated", "random"])
@pytest.mark.parametrize("module", ["runtime.generate", "runtime.serve"])
def test_a_corrupt_checkpoint_is_one_line(module, kind, broken_checkpoints, tmp_path):
    folder = broken_checkpoints[kind]
    proc = run(module, "hal=cpu", f"model.path={folder}", "prompt_ids=[1,2]" if module == "runtime.generate"
               else "port=0", cwd=tmp_path)
    assert_one_line(proc, str(folder / "model.safetensors"), "download the checkpoint again")


@pytest.mark.parametrize("file,content,needles", [
    ("config.json", "[1, 2]", ["config.json must be a JSON object of settings, got a list"]),
    ("config.json", None, ["config.json: hidden_size must be int, got '64'"]),
    ("tokenizer.json", "{not json", ["tokenizer.json cannot be read by the tokenizers library"]),
    ("tokenizer_config.json", "[]", ["tokenizer_config.json must be a JSON object of settings, got a list"]),
    ("tokenizer_config.json", "{bad", ["tokenizer_config.json is not valid JSON"])])
def test_a_broken_settings_file_is_one_line_naming_it(file, content, needles, tmp_path):
    """These printed a TypeError, an AttributeError or the tokenizers library's bare Exception."""
    import json

    folder = tmp_path / "ckpt"
    shutil.copytree(ROOT / "zoo" / "checkpoints" / "ouro-tiny", folder)
    if content is None:                  # a number given as a string
        config = json.loads((folder / file).read_text())
        config["hidden_size"] = str(config["hidden_size"])
        content = json.dumps(config)
        needles = [needles[0].replace("'64'", repr(config["hidden_size"]))]
    (folder / file).write_text(content)
    proc = run("runtime.generate", "hal=cpu", f"model.path={folder}", "max_tokens=1", "prompt=Hi", cwd=tmp_path)
    assert_one_line(proc, str(folder / file), *needles)


@pytest.mark.parametrize("module,args,needles", [
    ("runtime.serve", ["port=99999"], ["port=99999", "1..65535"]),
    ("runtime.serve", ["engine.max_num_seqs=0"], ["engine.max_num_seqs", ">= 1"]),
    ("runtime.generate", ["engine.max_num_seqs=0"], ["engine.max_num_seqs", ">= 1"]),
    ("runtime.generate", ["model.num_loops=1000"], ["model.num_loops=1000", "engine.max_num_loops"]),
    ("runtime.serve", ["model.num_loops=1000"], ["model.num_loops=1000", "engine.max_num_loops"]),
    ("runtime.generate", ["kv_mode=shared"], ["engine.kv_mode=shared"]),
    ("runtime.bench", ["dtype=float32"], ["model.dtype=float32"]),
    ("runtime.generate", ["max_tokens=0"], ["max_tokens"]),
    ("runtime.generate", ["engine.kv_mode=half"], ["engine.kv_mode", "full"]),
    ("runtime.serve", ["server.max_num_requests=0"], ["server.max_num_requests"]),
    ("runtime.generate", ["engine.num_kv_blocks=1"], ["KV cache", "engine.num_kv_blocks"]),
    # found by a fuzz of the CLIs: each was a traceback, several lines of Hydra, or a process killed
    ("runtime.generate", ["max_tokenz=5"], ["max_tokenz is not an option of runtime.generate", "max_tokens=5"]),
    ("runtime.generate", ["+num_loops=3"], ["did you mean model.num_loops=3"]),
    ("runtime.serve", ["engine.max_num_seq=3"], ["engine.max_num_seqs=3"]),
    ("runtime.bench", ["workloadz=[tiny]"], ["workloadz is not an option of runtime.bench"]),
    ("runtime.generate", ["log_level=FOO"], ["log_level=FOO is not a level", "DEBUG"]),
    ("runtime.generate", ["logit_bias=[1,2]"], ["logit_bias maps token ids"]),
    ("runtime.generate", ["model.dtype=int8"], ["'int8' is not one a model computes in"]),
    ("runtime.generate", ["engine.num_kv_blocks=1000000000000"], ["more than the device's", "engine.num_kv_blocks"]),
    ("runtime.generate", ["engine.block_size=1000000"], ["engine.block_size=1000000", "use 16 (the Hal"]),
    ("runtime.generate", ["repetition_penalty=1e-300"], ["repetition_penalty must be in"]),
    ("runtime.bench", ["workload=[]"], ["workload= names no cell"]),
    ("runtime.bench", ["workload=[tiny]", "workloads.tiny.batch=0"], ["workloads.tiny.batch must be an integer"]),
    ("runtime.bench", ["workload=[tiny]", "model.num_loops=0"], ["model.num_loops=0 is outside"]),
])
def test_bad_values_end_the_cli_with_one_line(module, args, needles, tmp_path):
    case = golden_case("ouro-tiny")
    prompt = ["prompt_ids=[1,2]"] if module == "runtime.generate" else []
    proc = run(module, "hal=cpu", f"model.path={case.path}", *prompt, *args, cwd=tmp_path)
    assert_one_line(proc, *needles)


@pytest.mark.parametrize("overrides,message", [
    (["prompt=[]"], "prompt=\\[\\] is an empty list"),
    (["prompt_ids=[[1,2],3]"], "a list of such lists"),
    (["prompt=3.10"], "read by Hydra as a float"),
    (["prompt=true"], "read by Hydra as a bool"),
    (["prompt=[Hi,1e3]"], "read by Hydra as a float"),
    (["prompt=Hi", "stop=[1]"], "stop=1 was read by Hydra as a int"),
    (["prompt=Hi", "stop=[a,[b]]"], "a flat list of texts for stop; Hydra read a list inside it"),
    (["prompt=Hi", "enable_thinking=true"], "add chat=true"),
])
def test_prompts_that_would_be_lost_or_changed_are_refused(overrides, message):
    """An empty prompt list ran nothing and exited 0; Hydra's typing turned `prompt=3.10` into '3.1'
    silently; enable_thinking without chat was ignored."""
    from runtime.generate import run

    with pytest.raises(UsageError, match=message):
        run(composed("generate", "model=ouro-tiny", *overrides))


@pytest.mark.parametrize("args,needles", [
    (["prompt=true"], ["\"prompt='true'\" with the word as you typed it"]),
    (["model.path=/nonexistent", "prompt=hi"], ["no checkpoint folder at '/nonexistent'", "ouro-1.4b, ouro-1.4b-thinking",
                                                "ouro-tiny)"])])
def test_a_prompt_read_as_a_word_and_a_missing_folder_name_the_fix(args, needles, tmp_path):
    """Found by a CLI fuzzer: the quoting advice gave 'True' for true; a missing model.path folder was
    told to pass model.path=, and the packaged ouro-tiny was not among the known names."""
    assert_one_line(run("runtime.generate", "hal=cpu", *args, cwd=tmp_path), *needles)
