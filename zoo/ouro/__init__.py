"""Ouro-1.4B / 2.6B (and -Thinking): `zoo.ouro.OuroForCausalLM`."""
from zoo.ouro.config import OuroConfig
from zoo.ouro.model import OuroForCausalLM, exit_distribution, first_exit_step

__all__ = ["OuroConfig", "OuroForCausalLM", "exit_distribution", "first_exit_step"]
