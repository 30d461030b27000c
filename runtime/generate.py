"""`python -m runtime.generate hal=cpu model=ouro-1.4b prompt="..."`: the generation CLI (Hydra)."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from runtime.cli import CONF_DIR, UsageError, clear_errors, known_models, register_schemas
from runtime.config import SamplingParams, SpeculativeConfig

log = logging.getLogger("runtime.generate")
# no model and no prompt given: the packaged tiny model continues this (when the install has it)
DEFAULT_MODEL = "ouro-tiny"
DEFAULT_PROMPT = "The meaning of life is"


def no_model_message() -> str:
    from zoo.loading import HUB_IDS

    lines = ["No model selected. Known models (model=NAME, found in the local Hugging Face cache):"]
    lines += [f"  {name:22s} {HUB_IDS.get(name, '')}" for name in known_models()]
    lines += ["Examples:",
              '  python -m runtime.generate model=ouro-1.4b prompt="The capital of France is"',
              "  python -m runtime.generate model.path=/path/to/checkpoint prompt_ids=[1,2,3] max_tokens=8",
              "Download a checkpoint first with e.g. `huggingface-cli download ByteDance/Ouro-1.4B`."]
    return "\n".join(lines)


def default_model() -> str | None:
    """The model of a bare `python -m runtime.generate`: the packaged ouro-tiny where this install has it."""
    from zoo.loading import packaged_checkpoint

    return DEFAULT_MODEL if packaged_checkpoint(DEFAULT_MODEL) else None


def prompts_from(cfg: Any, default_prompt: str | None = None) -> list[Any]:
    if cfg.prompt is not None and cfg.prompt_ids is not None:
        raise UsageError("give prompt= or prompt_ids=, not both")
    if cfg.prompt_ids is not None:
        ids = OmegaConf.to_object(cfg.prompt_ids) if OmegaConf.is_config(cfg.prompt_ids) else cfg.prompt_ids
        if not isinstance(ids, list) or not ids:
            raise UsageError(f"prompt_ids must be a non-empty list of token ids, got {ids!r}")
        batch = ids if isinstance(ids[0], list) else [ids]
        if not all(isinstance(t, int) for seq in batch for t in seq):
            raise UsageError(f"prompt_ids must hold integers, got {ids!r}")
        return batch
    if cfg.prompt is None and default_prompt is not None:
        return [default_prompt]
    if cfg.prompt is None:
        raise UsageError('no prompt: pass prompt="..." (or prompt_ids=[...] for token ids)')
    prompt = OmegaConf.to_object(cfg.prompt) if OmegaConf.is_config(cfg.prompt) else cfg.prompt
    return [str(p) for p in prompt] if isinstance(prompt, list) else [str(prompt)]


def run(cfg: Any) -> list[dict[str, Any]]:
    """The job behind the CLI, callable without Hydra: returns one dict per prompt."""
    from runtime.llm import LLM, follow
    from runtime.parallel.state import init_from_cli

    if cfg.output not in ("text", "json"):
        raise UsageError(f"output must be 'text' or 'json', got {cfg.output!r}")
    source = cfg.model.path or cfg.model.name or default_model()
    if not source:
        raise UsageError(no_model_message())
    prompts = prompts_from(cfg, DEFAULT_PROMPT if source == DEFAULT_MODEL else None)
    if cfg.chat and cfg.prompt_ids is not None:
        raise UsageError("chat=true renders text through the chat template: give prompt=, not prompt_ids=")
    params = sampling_params(cfg)
    hal_options = {"device_index": cfg.hal.device_index, "attention_backend": cfg.hal.attention_backend}
    hal = _hal(cfg.hal.name, hal_options)
    parallel = init_from_cli(hal, cfg)
    try:
        if not parallel.is_driver:                 # tensor parallelism: rank 0 prints, the others compute
            follow(source, hal, cfg.model.dtype, parallel)
            return []
        llm = LLM(source, hal=hal, dtype=cfg.model.dtype, parallel=parallel, **engine_options(cfg))
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
    results = []
    for out in outputs:
        results.append({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                        "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason})
        if out.metrics is not None and out.metrics.num_spec_rounds:
            results[-1].update(acceptance_rate=out.metrics.acceptance_rate,
                               mean_accepted_length=out.metrics.mean_accepted_length)
    return results


def engine_options(cfg: Any) -> dict[str, Any]:
    """`EngineConfig` keywords from the command line (`speculative.*`, `kv_dtype`, `weights_dtype`)."""
    spec = cfg.speculative
    return {"speculative": SpeculativeConfig(int(spec.num_tokens), int(spec.draft_loops), str(spec.mode)),
            "kv_dtype": str(cfg.get("kv_dtype", "auto")), "weights_dtype": str(cfg.get("weights_dtype", "auto"))}


def _first_set(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def sampling_params(cfg: Any) -> SamplingParams:
    """The request's settings: each of temperature / top_p / top_k from the command line when given,
    else the model config's (the checkpoint's generation_config), else greedy / off."""
    return SamplingParams(
        max_tokens=cfg.max_tokens, temperature=_first_set(cfg.temperature, cfg.model.temperature, 0.0),
        top_p=_first_set(cfg.top_p, cfg.model.top_p, 1.0), top_k=_first_set(cfg.top_k, cfg.model.top_k, 0),
        seed=cfg.seed, init_scale=cfg.init_scale, ignore_eos=cfg.ignore_eos,
        stop_token_ids=tuple(cfg.model.stop_token_ids), num_loops=cfg.model.num_loops,
        exit_threshold=cfg.model.exit_threshold)


def _hal(name: str, options: dict[str, Any]) -> Any:
    import hal

    return hal.get(name, **options)


def print_results(results: list[dict[str, Any]], output: str) -> None:
    for result in results:
        if output == "json":
            print(json.dumps(result), flush=True)
        elif result["text"] or result["prompt"] is not None:
            print(result["text"], flush=True)
        else:  # no tokenizer: show ids
            print(" ".join(map(str, result["token_ids"])), flush=True)


register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="generate")
def _main(cfg: DictConfig) -> None:
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    with clear_errors(cfg.log_level):
        print_results(run(cfg), cfg.output)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
