"""Nanbeige4.2-3B (Nanbeige LLM Lab): `zoo.nanbeige.NanbeigeForCausalLM`."""
from zoo.nanbeige.config import NanbeigeConfig, check_supported
from zoo.nanbeige.model import NanbeigeForCausalLM

__all__ = ["NanbeigeConfig", "NanbeigeForCausalLM", "check_supported"]
