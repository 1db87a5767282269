"""`EngineConfig`: one config built from the settings, so that a benchmark, a test and the served path cannot differ
in a default."""

import dataclasses

import pytest

from s2tts import settings
from s2tts.engine import Engine, EngineConfig
from s2tts.engine.runner import ModelRunner


def test_every_setting_field_defaults_to_its_setting_and_names_one_that_the_engine_models_take():
    config = EngineConfig()
    fields = [f for f in dataclasses.fields(EngineConfig) if "setting" in f.metadata]
    assert len(fields) >= 15
    for f in fields:
        key = f.metadata["setting"]
        assert key == f.name and key in settings.SCHEMA
        assert getattr(config, f.name) == settings.SCHEMA[key].default
        assert {"slow_ar", "s2pro"} <= set(settings.SCHEMA[key].models)  # both models that hold an engine


def test_from_values_takes_a_models_settings_and_the_kv_pool_follows_one_rule():
    values = settings.model_values({"parameters": {"checkpoint": {"string_value": "/ck"},
                                                   "max_batch": {"string_value": "6"},
                                                   "codec_batch_steps": {"string_value": "4"}}}, "slow_ar")
    config = EngineConfig.from_values(values)
    assert (config.max_batch, config.codec_batch_steps, config.max_seq_len) == (6, 4, settings.SCHEMA["max_seq_len"].default)
    # the pool when nothing sizes it: as rendering resolves it for the served path
    resolved = settings.resolve({"checkpoint": "/ck", "max_batch": "6"})
    assert config.kv_tokens == resolved["kv_cache_tokens"] == settings.default_kv_tokens(resolved)
    assert EngineConfig.from_values(resolved).kv_tokens == config.kv_tokens
    assert EngineConfig(kv_cache_memory_gb=2.0).kv_tokens is None  # GiB size it then
    assert EngineConfig.from_values(values, max_batch=2).max_batch == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 3


def test_an_engine_built_with_defaults_sizes_its_pool_as_the_served_path_does(model):
    eng = Engine(model, 32, EngineConfig(max_batch=3, max_seq_len=256, prefix_cache_mb=0))
    block = eng.blocks.block_size
    assert eng.kv_capacity_tokens == -(-settings.default_kv_tokens({"max_batch": 3, "max_seq_len": 256}) // block) * block
    assert eng.scheduler.max_batch == eng.runner.max_batch == eng.config.max_batch == 3
    assert isinstance(eng.runner, ModelRunner)
