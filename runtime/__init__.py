"""loopstack's inference runtime: `from runtime import LLM, SamplingParams`."""
from runtime.sampling_params import SamplingParams
from runtime.llm import LLM
from runtime.engine.outputs import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
