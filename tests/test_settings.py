"""Settings: defaults, parse errors that name the variable, .env handling, .env.example and
docs/configuration.md in sync."""
from pathlib import Path

import pytest

from mlxstack.config.settings import REPO_ROOT, SPECS, SettingsError, load_settings, render_env_example


def test_env_example_matches_specs():
    committed = (REPO_ROOT / ".env.example").read_text()
    assert committed == render_env_example(), "stale .env.example: run python scripts/gen_env_example.py"


def test_every_spec_documented_in_env_example():
    text = render_env_example()
    for spec in SPECS:
        assert f"\n{spec.name}=" in text


def test_defaults():
    s = load_settings(env={})
    assert (s.mlx_host, s.mlx_port, s.proxy_host, s.proxy_port) == ("127.0.0.1", 8080, "127.0.0.1", 4000)
    assert s.model_path == "" and s.proxy_model_id == "" and s.litellm_master_key == ""
    assert s.default_temperature == 0.1 and s.default_max_tokens == 2048 and s.cache_enabled


@pytest.mark.parametrize("name,value", [("MLX_PORT", "eighty"), ("DEFAULT_THINKING", "maybe"),
                                        ("DEFAULT_TOP_P", "high"), ("LOG_LEVEL", "LOUD"), ("MLX_PORT", "-1")])
def test_malformed_value_names_variable(name, value):
    with pytest.raises(SettingsError) as exc:
        load_settings(env={name: value})
    assert name in str(exc.value) and value in str(exc.value)


def test_bool_and_int_parsing():
    s = load_settings(env={"DEFAULT_THINKING": "off", "CPU_FLOAT32": "YES", "PROXY_PORT": " 4001 "})
    assert s.default_thinking is False and s.cpu_float32 is True and s.proxy_port == 4001


def test_unknown_variable_in_env_file_suggests_name(tmp_path: Path):
    env_file = tmp_path / ".env"
    env_file.write_text("MLX_PROT=9000\n")
    with pytest.raises(SettingsError) as exc:
        load_settings(env={}, env_file=env_file)
    assert "MLX_PROT" in str(exc.value) and "did you mean MLX_PORT" in str(exc.value)


def test_env_overrides_file(tmp_path: Path):
    env_file = tmp_path / ".env"
    env_file.write_text("MLX_PORT=9000\nPROXY_PORT=5000\nLITELLM_MASTER_KEY=sk-file\n")
    s = load_settings(env={"MLX_PORT": "9100"}, env_file=env_file)
    assert s.mlx_port == 9100 and s.proxy_port == 5000 and s.litellm_master_key == "sk-file"


def test_env_example_loads_as_env_file(tmp_path: Path):
    env_file = tmp_path / ".env"
    env_file.write_text(render_env_example())
    assert load_settings(env={}, env_file=env_file) == load_settings(env={})


def test_as_env_round_trip():
    s = load_settings(env={"DEFAULT_THINKING": "false", "MLX_PORT": "8123"})
    assert load_settings(env=s.as_env()) == s


def _gen_env_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_env_example", REPO_ROOT / "scripts" / "gen_env_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_doc_matches_specs():
    committed = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert committed == _gen_env_example().render_config_doc(), \
        "stale docs/configuration.md: run python scripts/gen_env_example.py"


def test_configuration_doc_documents_every_variable():
    doc = (REPO_ROOT / "docs" / "configuration.md").read_text()
    missing = [s.name for s in SPECS if f"| `{s.name}` |" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_proxy_startup_wait_seconds_is_the_seeds_name_for_the_litellm_limit(tmp_path: Path):
    assert load_settings(env={}).proxy_startup_timeout_seconds == 120.0
    seed = load_settings(env={"PROXY_STARTUP_WAIT_SECONDS": " 7.5 "})
    assert (seed.proxy_startup_timeout_seconds, seed.proxy_startup_wait_seconds) == (7.5, "7.5")
    assert load_settings(env=seed.as_env()) == seed                   # children re-read the same limit
    same = load_settings(env={"PROXY_STARTUP_WAIT_SECONDS": "30", "PROXY_STARTUP_TIMEOUT_SECONDS": "30.0"})
    assert same.proxy_startup_timeout_seconds == 30.0
    env_file = tmp_path / ".env"                                       # a seed .env: a known name, no error
    env_file.write_text("PROXY_STARTUP_WAIT_SECONDS=45\n")
    assert load_settings(env={}, env_file=env_file).proxy_startup_timeout_seconds == 45.0
    with pytest.raises(SettingsError) as exc:
        load_settings(env={"PROXY_STARTUP_WAIT_SECONDS": "2.0", "PROXY_STARTUP_TIMEOUT_SECONDS": "120"})
    assert str(exc.value) == ("PROXY_STARTUP_WAIT_SECONDS=2.0 and PROXY_STARTUP_TIMEOUT_SECONDS=120 are both set and "
                              "differ: they are one limit (how long LiteLLM may take to report ready). Keep one of them.")
    for bad in ("soon", "0.5"):
        with pytest.raises(SettingsError) as exc:
            load_settings(env={"PROXY_STARTUP_WAIT_SECONDS": bad})
        assert str(exc.value).startswith(f"PROXY_STARTUP_WAIT_SECONDS={bad!r} ")


def test_seed_cache_settings_defaults():
    s = load_settings(env={})
    assert s.cache_session_partitioning is True and s.normalize_write_tool_content_for_prompt is False
    s = load_settings(env={"CACHE_SESSION_PARTITIONING": "false", "NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT": "true"})
    assert s.cache_session_partitioning is False and s.normalize_write_tool_content_for_prompt is True
