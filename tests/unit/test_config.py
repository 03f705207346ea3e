"""Engine config parsing: the packaged YAML, unknown keys, memory sizes."""

import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from engine.config import EngineConfig, ResolvedEngineConfig, parse_memory_size
from engine.config_resolve import resolve_engine_config

SMOLLM2_CONFIG = Path(__file__).parents[2] / "configs" / "engine" / "smollm2.yaml"


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_packaged_config_sets_every_key() -> None:
    # The packaged file documents the whole surface, so it names every flat key.
    assert set(yaml.safe_load(SMOLLM2_CONFIG.read_text())) == set(EngineConfig.flat_fields())
    config = EngineConfig.from_yaml(SMOLLM2_CONFIG)
    assert config.model.model is None
    assert config.model.dtype == "auto"
    assert config.model.max_model_len == 2048
    assert config.cache.kv_cache_memory == 2**30


def test_overrides_win_over_the_file() -> None:
    config = EngineConfig.from_yaml(SMOLLM2_CONFIG, dtype="float32", max_num_seqs=8)
    assert config.model.dtype == "float32"
    assert config.scheduler.max_num_seqs == 8
    assert config.scheduler.max_num_batched_tokens == 2048  # from the file


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "engine.yaml", {"dtype": "float32", "max_num_seq": 4})
    with pytest.raises(ValueError, match="'max_num_seq'"):
        EngineConfig.from_yaml(path)


def test_invalid_value_is_named(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "engine.yaml", {"block_size": 0})
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_yaml(path)


def test_non_mapping_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("- dtype\n- float32\n")
    with pytest.raises(ValueError, match="mapping"):
        EngineConfig.from_yaml(path)


def test_kv_cache_memory_accepts_size_strings(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "engine.yaml", {"kv_cache_memory": "1GiB"})
    assert EngineConfig.from_yaml(path).cache.kv_cache_memory == 2**30
    assert EngineConfig.from_flat(kv_cache_memory="512 MB").cache.kv_cache_memory == 512 * 10**6
    assert EngineConfig.from_flat(kv_cache_memory=4096).cache.kv_cache_memory == 4096


@pytest.mark.parametrize("value", ["4XB", "lots", "0GiB"])
def test_bad_kv_cache_memory_is_named(value: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_flat(kv_cache_memory=value)


def test_parse_memory_size_units() -> None:
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("1.5 kib") == 1536
    assert parse_memory_size("1e9") == 10**9


def test_resolved_config_is_frozen_travels_and_resolves_once() -> None:
    config = resolve_engine_config(EngineConfig.from_flat(max_model_len=512))
    assert config.model.model.endswith(".gguf") and config.model.model_format == "gguf"
    assert config.model.device == "cpu" and config.model.dtype == "bfloat16"
    assert config.model.max_model_len == 512
    assert config.model.hf_config.architecture == "LlamaForCausalLM"
    # The transports to the core process (JSON) and to the workers (pickle) keep every field.
    assert ResolvedEngineConfig.model_validate_json(config.model_dump_json()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert resolve_engine_config(config) is config
    with pytest.raises(ValidationError, match="frozen"):
        config.model.max_model_len = 1024
    with pytest.raises(ValidationError, match="frozen"):
        config.cache.block_size = 32
    # Its flat form is what EngineConfig reads back (the resolved-only fields stay out).
    assert EngineConfig.from_flat(**config.to_flat()).model.max_model_len == 512
