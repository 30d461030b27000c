"""Per-request sampling settings (`SamplingParams`) and the model's defaults for them
(`SamplingDefaults`). They live apart from the engine's configuration because they travel with
every request, through the API, the server, the scheduler and the sampler, while the engine's
settings are fixed once when it starts."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Mapping

import numpy as np

INT64_LIMIT = 2 ** 63          # integers the persistent batch stores (runtime/execution/row_params.py)
TOP_K_LIMIT = 2 ** 31
FLOAT32_MAX = 3.4028234663852886e38   # the device holds the float settings as float32: past it, inf
FLOAT32_TINY = 1.1754943508222875e-38  # and below it (a repetition penalty) 0, and -inf * 0 is NaN
MIN_TEMPERATURE = 1e-5         # below it sampling is greedy (logits / 1e-40 overflow to inf: NaN softmax)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (vLLM's names; the looped-model fields last).

    `max_tokens=None` generates up to the context (what the KV cache holds of a request at its
    depth), as in vLLM. `temperature=0` is greedy, and so is any temperature below 1e-5 (as in
    vLLM). `top_k` 0 or -1 and `top_p=1` disable those filters. `seed` makes
    sampling (and Huginn's random initial state) reproducible per request, greedy included; a
    seeded request's tokens do not depend on what else is in the batch.

    The logits of a step pass, in this order: `logit_bias` (token id -> added to its logit),
    `min_tokens` (stop tokens masked until that many tokens were generated), `repetition_penalty`
    (> 1 discourages every token of the prompt and the output: a positive logit is divided by it,
    a negative one multiplied), `frequency_penalty` (subtracted once per earlier occurrence in the
    output) and `presence_penalty` (subtracted once if it occurred), then temperature, `min_p` (tokens
    less likely than min_p times the most likely one are dropped, as in vLLM; 0: off), top-k, top-p.
    Greedy requests take the argmax after the penalties.

    A sample ends at a stop token (`stop_token_ids`, and the model's end tokens unless `ignore_eos`)
    or where its text first holds one of the `stop` strings, after `min_tokens` tokens. Its text
    leaves special tokens out unless `skip_special_tokens=False`. Its text
    then ends before the stop token's or string's text (`include_stop_str_in_output`: after it),
    as in vLLM; its tokens keep the one that stopped it (runtime/engine/stop_strings.py).

    `n` samples are returned per prompt (they share the prompt's KV); with `best_of > n`, `best_of`
    are generated and the `n` of highest mean log-probability per token are returned. `logprobs=k`
    reports the sampled token's log-probability and the k most likely tokens at each generated
    position; `prompt_logprobs=k` the same for every prompt token after the first. Log-probabilities
    are those of the model's own distribution (log_softmax of the logits the token was sampled from,
    before penalties and temperature).

    `num_loops` and `exit_threshold` default to the model's own values when None. `init_scale`
    scales Huginn's random initial state (None: the reference's 1.0; 0.0: a zero state).
    `priority` orders requests under `scheduling_policy="priority"`: lower is more urgent (vLLM's
    convention), first come first served within a level.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()                        # stop strings; one string is accepted too
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True                  # the text leaves special tokens out (as vLLM)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()    # a {token id: bias} dict is accepted too
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_loops: int | None = None
    exit_threshold: float | None = None
    min_loops: int = 1
    init_scale: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:          # the range checks below compare values: wrong types stop here, each by name
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))

        def whole(name: str) -> int | None:
            """The field as Python's int (a numpy integer too), or None where it is no integer: True is not."""
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, (bool, np.bool_)):
                return None
            object.__setattr__(self, name, int(value))
            return int(value)

        def integer(name: str, low: int, allow_none: bool = False) -> None:
            given = getattr(self, name)
            if given is None and allow_none:
                return
            value = whole(name)
            if value is None or value < low:
                problems.append(f"{name} must be an integer >= {low}, got {given!r}")
            elif value >= INT64_LIMIT:          # the device batch holds these as int64
                problems.append(f"{name} must be below 2^63, got {value!r}")

        integer("max_tokens", 1, allow_none=True)     # None: up to the context (the engine sets it)
        integer("n", 1)
        integer("best_of", 1, allow_none=True)
        integer("min_tokens", 0)
        integer("logprobs", 0, allow_none=True)
        integer("prompt_logprobs", 0, allow_none=True)
        if not 0 <= self.temperature <= FLOAT32_MAX:       # inf would turn a banned token's -inf into NaN
            problems.append(f"temperature must be a number in [0, {FLOAT32_MAX:.4g}], got {self.temperature!r}")
        elif self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1] (0: off), got {self.min_p!r}")
        top_k = whole("top_k")
        if top_k is None or not -1 <= top_k < TOP_K_LIMIT:
            problems.append(f"top_k must be -1 or 0 (off) or a positive integer below 2^31, got {self.top_k!r}")
        if self.seed is not None and not (whole("seed") is not None and -INT64_LIMIT <= self.seed < INT64_LIMIT):
            problems.append(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        bad_stops = [t for t in self.stop_token_ids if not 0 <= t < INT64_LIMIT]
        if bad_stops:
            problems.append(f"stop_token_ids must be token ids in [0, 2^63), got {bad_stops[:3]}")
        bad_strings = [s for s in self.stop if not (isinstance(s, str) and s)]
        if bad_strings:
            problems.append(f"stop takes non-empty strings (an empty one would end every answer at once), "
                            f"got {bad_strings[:3]!r}")
        if self.best_of is not None and isinstance(self.n, int) and isinstance(self.best_of, int) \
                and self.best_of < self.n:
            problems.append(f"best_of ({self.best_of}) must be >= n ({self.n})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:    # finite and nonzero in float32
            problems.append(f"repetition_penalty must be in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.4g}] (1 = off), "
                            f"got {self.repetition_penalty!r}")
        bad_bias = [(t, b) for t, b in self.logit_bias if not 0 <= t < INT64_LIMIT or not -100 <= b <= 100]
        if bad_bias:
            problems.append(f"logit_bias takes token ids in [0, 2^63) with biases in [-100, 100], got {bad_bias[:3]}")
        if isinstance(self.max_tokens, int) and isinstance(self.min_tokens, int) and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.num_loops is not None and not (whole("num_loops") is not None and self.num_loops >= 1):
            problems.append(f"num_loops must be an integer >= 1, got {self.num_loops!r}")
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            problems.append(f"exit_threshold must be in (0, 1], got {self.exit_threshold!r}")
        if self.init_scale is not None and not (self.init_scale >= 0 and math.isfinite(self.init_scale)):
            problems.append(f"init_scale must be >= 0, got {self.init_scale!r}")
        integer("min_loops", 1)          # past num_loops: every token takes its last loop
        if whole("priority") is None:
            problems.append(f"priority must be an integer (lower = more urgent), got {self.priority!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt (`best_of`, else `n`)."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)

    @property
    def changes_logits(self) -> bool:
        """Whether anything but temperature / top-k / top-p acts on the logits."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
OPTIONAL_REAL_FIELDS = ("exit_threshold", "init_scale")
BOOL_FIELDS = ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos")


def _type_problems(p: SamplingParams) -> list[str]:
    """What of `p` has the wrong type, by field: a number given as a string, a flag as "no" (which
    Python would take as true), token ids that are not integers, a stop list that is one number."""
    def is_real(v: Any) -> bool:
        return isinstance(v, Real) and not isinstance(v, bool)

    def is_int(v: Any) -> bool:
        return isinstance(v, Integral) and not isinstance(v, bool)

    def is_sequence(v: Any) -> bool:
        return not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__iter__")

    def is_id(v: Any) -> bool:         # vLLM takes "50256" as a key too (JSON objects have string keys)
        return is_int(v) or isinstance(v, str) and v.isascii() and v.isdigit()

    # an iterator (a generator) is read once here: the checks below and the conversion after them
    # must see the same items
    for name in ("stop_token_ids", "stop", "logit_bias"):
        value = getattr(p, name)
        if is_sequence(value) and not isinstance(value, (list, tuple)) and iter(value) is value:
            object.__setattr__(p, name, tuple(value))

    problems = [f"{name} must be a number, got {getattr(p, name)!r}" for name in REAL_FIELDS
                if not is_real(getattr(p, name))]
    problems += [f"{name} must be a number or None, got {getattr(p, name)!r}" for name in OPTIONAL_REAL_FIELDS
                 if getattr(p, name) is not None and not is_real(getattr(p, name))]
    for name in BOOL_FIELDS:           # True/False (numpy's too) or 1/0; a string such as "no" is not
        value = getattr(p, name)
        if isinstance(value, (bool, np.bool_)) or is_int(value) and value in (0, 1):
            object.__setattr__(p, name, bool(value))
        else:
            problems.append(f"{name} must be true or false, got {value!r}")
    if not (is_sequence(p.stop_token_ids) and all(is_int(t) for t in p.stop_token_ids)):
        problems.append(f"stop_token_ids takes a list of token ids (integers), got {p.stop_token_ids!r}")
    if not (p.stop is None or isinstance(p.stop, str)
            or (is_sequence(p.stop) and all(isinstance(s, str) for s in p.stop))):
        problems.append(f"stop takes a string or a list of strings, got {p.stop!r}")
    bias = p.logit_bias.items() if isinstance(p.logit_bias, Mapping) else p.logit_bias
    if not (is_sequence(bias) and all(isinstance(item, (tuple, list)) and len(item) == 2 and is_id(item[0])
                                      and is_real(item[1]) for item in bias)):
        problems.append(f"logit_bias maps token ids (integers) to biases (numbers), e.g. {{50256: -100}}, "
                        f"got {p.logit_bias!r}")
    return problems


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling settings a request gets for what it leaves out: the model's generation_config
    (`conf/model/*.yaml`, or a `model.path=` folder's generation_config.json), else greedy with no
    filters. The CLI and the server both use these, so the same prompt gives the same text through
    either."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_model(cls, model_node: Any, generation_config: Mapping[str, Any] | None = None) -> "SamplingDefaults":
        """From a `model:` config node (its temperature / top_p / top_k; None = not set), else from
        `generation_config` (a `model.path=` checkpoint's own, whose node sets nothing)."""
        get = (lambda k: model_node.get(k)) if hasattr(model_node, "get") else (lambda k: getattr(model_node, k, None))
        checkpoint = generation_config or {}
        return cls(**{f.name: next((v for v in (get(f.name), checkpoint.get(f.name)) if v is not None), f.default)
                      for f in dataclasses.fields(cls)})

    def resolve(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                min_p: float | None = None, repetition_penalty: float | None = None) -> dict[str, Any]:
        """Keywords for `SamplingParams`: each given value wins over the default."""
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                 "repetition_penalty": repetition_penalty}
        return {k: getattr(self, k) if v is None else v for k, v in given.items()}

    def describe(self) -> str:
        if self.temperature == 0:
            return "greedy (temperature 0)"
        extra = "".join(f", {k} {getattr(self, k)}" for k, off in (("min_p", 0.0), ("repetition_penalty", 1.0))
                        if getattr(self, k) != off)
        return f"temperature {self.temperature}, top_p {self.top_p}, top_k {self.top_k or 'off'}{extra}"
