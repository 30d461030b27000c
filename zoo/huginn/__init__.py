"""Huginn-0125 (tomg-group-umd): `zoo.huginn.HuginnForCausalLM`."""
from zoo.huginn.config import HuginnConfig
from zoo.huginn.model import HuginnForCausalLM, split_num_loops

__all__ = ["HuginnConfig", "HuginnForCausalLM", "split_num_loops"]
