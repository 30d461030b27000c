"""`python -m runtime.generate hal=cpu model=ouro-1.4b prompt="..."`: the generation CLI (Hydra)."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from runtime.cli import (CONF_DIR, DEFAULT_MODEL, UsageError,  # noqa: F401
                         clear_errors, default_model, engine_config, known_models,  # noqa: F401
                         make_hal, model_source, register_schemas, setup_logging, checkpoint_sampling)  # noqa: F401
from runtime.cli_args import check_argv
from runtime.config import GenerateConfig
from runtime.sampling_params import SamplingDefaults, SamplingParams

log = logging.getLogger("runtime.generate")
# no model and no prompt given: the packaged tiny model continues this (when the install has it)
DEFAULT_PROMPT = "The meaning of life is"


def no_model_message() -> str:
    from zoo.resolve import HUB_IDS

    lines = ["No model selected. Known models (model=NAME, found in the local Hugging Face cache):"]
    lines += [f"  {name:22s} {HUB_IDS.get(name, '')}" for name in known_models()]
    lines += ["Examples:",
              '  python -m runtime.generate model=ouro-1.4b prompt="The capital of France is"',
              "  python -m runtime.generate model.path=/path/to/checkpoint prompt_ids=[1,2,3] max_tokens=8",
              "Download a checkpoint first with e.g. `huggingface-cli download ByteDance/Ouro-1.4B`."]
    return "\n".join(lines)


def prompts_from(cfg: Any, default_prompt: str | None = None) -> list[Any]:
    if cfg.prompt is not None and cfg.prompt_ids is not None:
        raise UsageError("give prompt= or prompt_ids=, not both")
    if cfg.prompt_ids is not None:
        ids = OmegaConf.to_object(cfg.prompt_ids) if OmegaConf.is_config(cfg.prompt_ids) else cfg.prompt_ids
        if not isinstance(ids, list) or not ids:
            raise UsageError(f"prompt_ids must be a non-empty list of token ids, got {ids!r}")
        batch = ids if isinstance(ids[0], list) else [ids]
        if not all(isinstance(seq, list) for seq in batch) or \
                not all(isinstance(t, int) and not isinstance(t, bool) for seq in batch for t in seq):
            raise UsageError(f"prompt_ids must be a list of token ids ([1,2,3]) or a list of such lists "
                             f"([[1,2],[3]]), got {ids!r}")
        return batch
    if cfg.prompt is None and default_prompt is not None:
        return [default_prompt]
    if cfg.prompt is None:
        raise UsageError('no prompt: pass prompt="..." (or prompt_ids=[...] for token ids)')
    prompt = OmegaConf.to_object(cfg.prompt) if OmegaConf.is_config(cfg.prompt) else cfg.prompt
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts:
        raise UsageError('no prompt: prompt=[] is an empty list; pass prompt="..." or a list of texts')
    return [typed_text("prompt", p) for p in prompts]


def typed_text(name: str, value: Any) -> str:
    """`value` of a text option, which Hydra may have read as a number or a boolean (`prompt=3.10`
    arrives as 3.1): refused with the quoting that keeps the text as typed."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):          # stop=[a,[b]]: a list inside the list
        raise UsageError(f"error: {name} takes text, or a flat list of texts for stop; Hydra read a "
                         f"{type(value).__name__} inside it: {value!r}")
    typed, what = (str(value).lower(), "word as you typed it") if isinstance(value, bool) else (value, "digits as you typed them")
    raise UsageError(f"{name}={value!r} was read by Hydra as a {type(value).__name__}, which would change "
                     f"the text; quote it as text: \"{name}='...'\" (e.g. \"{name}='{typed}'\" with the "
                     f"{what})")


def run(cfg: Any) -> list[dict[str, Any]]:
    """The job behind the CLI, callable without Hydra: returns one dict per prompt."""
    from runtime.llm import LLM, follow
    from runtime.parallel.state import init_from_cli

    if cfg.output not in ("text", "json"):
        raise UsageError(f"output must be 'text' or 'json', got {cfg.output!r}")
    source = model_source(cfg)
    if not source:
        raise UsageError(no_model_message())
    prompts = prompts_from(cfg, DEFAULT_PROMPT if source == DEFAULT_MODEL else None)
    if cfg.chat and cfg.prompt_ids is not None:
        raise UsageError("chat=true renders text through the chat template: give prompt=, not prompt_ids=")
    if cfg.get("enable_thinking") and not cfg.chat:
        raise UsageError("enable_thinking=true works through the chat template: add chat=true")
    engine = engine_config(cfg)
    params = sampling_params(cfg)
    hal = make_hal(cfg.hal)
    parallel = init_from_cli(hal, cfg)
    try:
        if not parallel.is_driver:                 # tensor parallelism: rank 0 prints, the others compute
            follow(source, hal, cfg.model.dtype, parallel)
            return []
        llm = LLM(source, hal=hal, dtype=cfg.model.dtype, parallel=parallel, engine_config=engine,
                  stop_token_ids=tuple(cfg.model.stop_token_ids))
        try:
            if cfg.chat:
                conversations = [[{"role": "user", "content": p}] for p in prompts]
                outputs = llm.chat(conversations, params, enable_thinking=cfg.enable_thinking)
            else:
                outputs = llm.generate(prompts, params)
        finally:
            llm.close()
    finally:
        parallel.shutdown()
    return [result_of(out) for out in outputs]


def result_of(out: Any) -> dict[str, Any]:
    """One prompt's JSON result: its first sample's fields, every sample under "samples" when n > 1,
    logprobs as [token, logprob, rank, [[token, logprob], ...]] lists when asked."""
    result = {"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
              "text": out.text, "finish_reason": out.finish_reason}
    if out.outputs[0].stop_reason is not None:
        result["stop_reason"] = out.outputs[0].stop_reason
    if out.error:
        result["error"] = out.error
    if out.logprobs is not None:
        result["logprobs"] = [lp.as_list() for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        result["prompt_logprobs"] = [lp.as_list() if lp is not None else None for lp in out.prompt_logprobs]
    if len(out.outputs) > 1:
        result["samples"] = [{"index": s.index, "token_ids": s.token_ids, "text": s.text,
                              "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                              "cumulative_logprob": s.cumulative_logprob,
                              **({"logprobs": [lp.as_list() for lp in s.logprobs]} if s.logprobs is not None
                                 else {})}
                             for s in out.outputs]
    if out.metrics is not None and out.metrics.num_spec_rounds:
        result.update(acceptance_rate=out.metrics.acceptance_rate,
                      mean_accepted_length=out.metrics.mean_accepted_length)
    return result


def sampling_params(cfg: Any) -> SamplingParams:
    """The request's settings: each of temperature / top_p / top_k / min_p / repetition_penalty from
    the command line when given, else the model config's (the checkpoint's generation_config), else
    greedy / off; the server applies the same defaults (`SamplingDefaults`)."""
    bias = cfg.get("logit_bias")
    bias = OmegaConf.to_object(bias) if OmegaConf.is_config(bias) else (bias or {})
    stop = cfg.get("stop")
    stop = OmegaConf.to_object(stop) if OmegaConf.is_config(stop) else stop
    stops = [] if stop is None else stop if isinstance(stop, list) else [stop]
    stop = tuple(typed_text("stop", s) for s in stops)
    defaults = SamplingDefaults.from_model(cfg.model, checkpoint_sampling(cfg))
    try:
        return SamplingParams(
            max_tokens=cfg.max_tokens, **defaults.resolve(cfg.temperature, cfg.top_p, cfg.top_k, cfg.get("min_p"),
                                                          cfg.get("repetition_penalty")),
            seed=cfg.seed, init_scale=cfg.init_scale, ignore_eos=cfg.ignore_eos,
            n=cfg.get("n", 1), best_of=cfg.get("best_of"), presence_penalty=cfg.get("presence_penalty", 0.0),
            frequency_penalty=cfg.get("frequency_penalty", 0.0),
            logit_bias=bias,
            min_tokens=cfg.get("min_tokens", 0), stop=stop, logprobs=cfg.get("logprobs"),
            prompt_logprobs=cfg.get("prompt_logprobs"),
            num_loops=cfg.model.num_loops,
            exit_threshold=cfg.model.exit_threshold)
    except ValueError as exc:
        raise UsageError(f"error: {exc}") from None


def print_results(results: list[dict[str, Any]], output: str) -> None:
    for result in results:
        if output == "json":
            print(json.dumps(result), flush=True)
            continue
        for sample in result.get("samples", [result]):
            if sample["text"] or result["prompt"] is not None:
                print(sample["text"], flush=True)
            else:  # no tokenizer: show ids
                print(" ".join(map(str, sample["token_ids"])), flush=True)


register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="generate")
def _main(cfg: DictConfig) -> None:
    setup_logging(cfg.log_level)
    with clear_errors(cfg.log_level):
        print_results(run(cfg), cfg.output)


def main() -> None:
    check_argv(sys.argv[1:], GenerateConfig, "runtime.generate", "generate")
    _main()


if __name__ == "__main__":
    main()
