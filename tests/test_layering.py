"""The layering rules of the code base, checked on the source: the HAL sits below everything, models
get their Hal from whoever runs them, the runtime knows no model family, and KV modes are parsed once."""
import re
from pathlib import Path

import pytest
import torch

import zoo
from helpers import CONFIGS, ROOT


def _files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _offenders(pattern: str, files: list[Path]) -> list[str]:
    regex = re.compile(pattern, re.MULTILINE)
    return [str(p.relative_to(ROOT)) for p in files if regex.search(p.read_text())]


def test_hal_imports_neither_runtime_nor_zoo():
    assert _offenders(r"^\s*(from|import) (runtime|zoo)\b", _files("hal")) == []


def test_no_vendor_package_imports_another():
    vendors = ["cuda", "rocm", "ascend", "cpu", "kernels", "common"]
    found = []
    for vendor in vendors:
        others = [v for v in ("cpu", "cuda", "rocm", "ascend") if v != vendor and (vendor, v) != ("rocm", "cuda")]
        pattern = r"^\s*(from|import) hal\.(" + "|".join(others) + r")\b"
        found += _offenders(pattern, _files(f"hal/{vendor}"))
    assert found == []


def test_runtime_imports_no_model_family():
    assert _offenders(r"(from|import) zoo\.(ouro|huginn|nanbeige)\b", _files("runtime")) == []


def test_models_look_no_hal_up():
    assert _offenders(r"for_device|hal\.get\(|registry", _files("zoo")) == []


def test_kv_mode_strings_are_compared_only_where_the_config_is_parsed():
    files = [p for p in _files("runtime", "zoo", "hal") if p.name not in ("config.py",)]
    assert _offenders(r"kv_mode\s*(==|!=|in\b|not in\b)", files) == []


def test_no_module_outside_the_execution_package_uses_the_runners_private_members():
    files = [p for p in _files("runtime", "tools", "tests") if "execution" not in p.parts]
    assert _offenders(r"runner\._[a-z]", files) == []


def test_a_model_builds_on_the_meta_device_without_memory():
    with torch.device("meta"):
        model = zoo.from_config(CONFIGS / "ouro-1.4b.json")
    assert model.num_parameters() == 1_434_652_673
    assert next(model.parameters()).device.type == "meta"


@pytest.mark.parametrize("family", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_every_family_takes_the_same_forward_keywords(family):
    from helpers import golden_case

    model = zoo.from_pretrained(golden_case(family).path, dtype="float32")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model(ids, num_loops=2, labels=ids, exit_threshold=1.0, return_step_logits=True)
    assert out.step_logits.shape[:3] == (2, 1, 4) and torch.equal(out.step_logits[-1], out.logits)
    assert out.loss is not None
