"""load_config / load_config_from_env / load_config_from_file: precedence, formats, parsing, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flextensor.configuration.config import OffloadConfig
from flextensor.configuration.config_loading import load_config, load_config_from_env, load_config_from_file


def write_config(directory: Path, fmt: str, values: dict, name: str = "flextensor") -> Path:
    """Write `values` as an INI ([flextensor]), YAML or JSON file; lists become comma lists in INI."""
    if fmt in ("ini", "conf", "cfg"):
        lines = ["[flextensor]"]
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, list):
                text = ", ".join(value)
            elif value is None:
                text = ""
            else:
                text = str(value)
            lines.append(f"{key} = {text}")
        text = "\n".join(lines) + "\n"
    elif fmt in ("yaml", "yml"):
        import yaml

        text = yaml.safe_dump(values)
    else:
        text = json.dumps(values)
    path = directory / f"{name}.{fmt}"
    path.write_text(text)
    return path


FORMATS = ["ini", "conf", "cfg", "yaml", "yml", "json"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_spec_file_example_loads(tmp_path, fmt):
    values = {"enabled": True, "gpu_device": 0, "discovery_iters": 1, "profiling_iters": 10}
    cfg = load_config_from_file(write_config(tmp_path, fmt, values))
    assert cfg == OffloadConfig()


def test_spec_ini_text_with_comments(tmp_path):
    path = tmp_path / "flextensor.conf"
    path.write_text(
        "; flextensor.conf\n[flextensor]\nenabled = false ; inline comment\ngpu_device = 2\n"
        "include_patterns = layers.*, class:*DecoderLayer,\n  embed\nprofile_storage_dir = /tmp/p%d\n"
        "[other]\nunrelated = 1\n"
    )
    cfg = load_config_from_file(path)
    assert cfg.enabled is False and cfg.gpu_device == 2
    assert cfg.include_patterns == ["layers.*", "class:*DecoderLayer", "embed"]
    assert cfg.profile_storage_dir == "/tmp/p%d"


@pytest.mark.parametrize("fmt", ["ini", "yaml", "json"])
def test_precedence_kwargs_over_env_over_file_over_defaults(tmp_path, monkeypatch, fmt):
    path = write_config(
        tmp_path,
        fmt,
        {"gpu_device": 1, "discovery_iters": 2, "profiling_iters": 3, "num_blocks": 5, "pinned_memory": False},
    )
    monkeypatch.setenv("FT_DISCOVERY_ITERS", "4")
    monkeypatch.setenv("FT_PROFILING_ITERS", "6")
    monkeypatch.setenv("FT_PINNED_MEMORY", "on")
    cfg = load_config(path, profiling_iters=7)
    assert cfg.gpu_device == 1  # file only
    assert cfg.num_blocks == 5  # file only
    assert cfg.discovery_iters == 4  # env beats file
    assert cfg.pinned_memory is True  # env beats file
    assert cfg.profiling_iters == 7  # kwargs beat env and file
    assert cfg.min_blocks == 4  # default
    assert cfg.enabled is True  # a file is given: not env-only loading

    no_env = load_config(path, use_env=False, profiling_iters=8)
    assert (no_env.discovery_iters, no_env.profiling_iters, no_env.pinned_memory) == (2, 8, False)

    file_only = load_config_from_file(path)  # never reads the environment
    assert (file_only.discovery_iters, file_only.profiling_iters, file_only.pinned_memory) == (2, 3, False)

    env_only = load_config_from_env()
    assert (env_only.gpu_device, env_only.discovery_iters, env_only.profiling_iters) == (0, 4, 6)


def test_kwargs_can_carry_load_strategy_and_override_enabled(monkeypatch):
    class Plan:
        def plan(self, plan_input):
            return None

    strategy = Plan()
    monkeypatch.setenv("FT_ENABLED", "0")
    cfg = load_config(load_strategy=strategy, enabled=True)
    assert cfg.load_strategy is strategy and cfg.enabled is True


def test_env_only_loading_defaults_enabled_false(monkeypatch, tmp_path):
    assert load_config_from_env().enabled is False
    assert load_config().enabled is False
    assert load_config(use_env=False).enabled is True  # no source at all: plain defaults
    assert load_config(write_config(tmp_path, "json", {"gpu_device": 0})).enabled is True
    monkeypatch.setenv("FT_ENABLED", "1")
    assert load_config_from_env().enabled is True
    assert load_config().enabled is True
    monkeypatch.setenv("FT_ENABLED", "off")
    assert load_config(write_config(tmp_path, "json", {"enabled": True})).enabled is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" On ", True),
     ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False)],
)
def test_bool_parsing(monkeypatch, text, expected):
    monkeypatch.setenv("FT_SKIP_DISCOVERY", text)
    assert load_config_from_env().skip_discovery is expected


def test_every_option_settable_from_env(monkeypatch, tmp_path):
    env = {
        "FT_ENABLED": "yes",
        "FT_GPU_DEVICE": "3",
        "FT_INCLUDE_PATTERNS": "layers.*,embed,head",
        "FT_EXCLUDE_PATTERNS": "class:MoELayer,*.norm",
        "FT_PINNED_MEMORY": "false",
        "FT_PINNED_MEMORY_MODE": "host_register",
        "FT_SHM_ENABLED": "0",
        "FT_SHM_NAMESPACE": "",
        "FT_SHM_WAIT_TIMEOUT": "2.5",
        "FT_SHM_DIR": str(tmp_path),
        "FT_MAX_GPU_MEM_FRACTION": "0.8",
        "FT_SKIP_DISCOVERY": "true",
        "FT_DISCOVERY_ITERS": "2",
        "FT_PROFILING_ITERS": "5",
        "FT_TRANSFER_MODE": "strategy",
        "FT_NUM_BLOCKS": "6",
        "FT_MIN_BLOCKS": "2",
        "FT_TRANSFER_BUDGET_SCALE": "1.5",
        "FT_PROFILE_MODE": "getter",
        "FT_PROFILE_STORAGE_DIR": str(tmp_path / "profiles"),
        "FT_PROFILE_READ_ONLY": "1",
        "FT_ENABLE_INSTRUMENTATION": "on",
        "FT_INSTRUMENTATION_OUTPUT_DIR": " out/inst ",
        "FT_ENABLE_DIAGNOSTICS": "yes",
        "FT_OFFLOAD_TIMING": "off",
        "FT_PIECEWISE_PREFETCH": "error",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = load_config_from_env()
    assert cfg.to_dict() == {
        "enabled": True,
        "gpu_device": 3,
        "include_patterns": ["layers.*", "embed", "head"],
        "exclude_patterns": ["class:MoELayer", "*.norm"],
        "pinned_memory": False,
        "pinned_memory_mode": "host_register",
        "shm_enabled": False,
        "shm_namespace": None,
        "shm_wait_timeout": 2.5,
        "shm_dir": str(tmp_path),
        "max_gpu_mem_fraction": 0.8,
        "skip_discovery": True,
        "discovery_iters": 2,
        "profiling_iters": 5,
        "transfer_mode": "strategy",
        "num_blocks": 6,
        "min_blocks": 2,
        "transfer_budget_scale": 1.5,
        "load_strategy": None,
        "profile_mode": "getter",
        "profile_storage_dir": str(tmp_path / "profiles"),
        "profile_read_only": True,
        "enable_instrumentation": True,
        "instrumentation_output_dir": "out/inst",
        "enable_diagnostics": True,
        "offload_timing": "off",
        "piecewise_prefetch": "error",
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [(" layers.* , , embed,class:MoELayer ,", ["layers.*", "embed", "class:MoELayer"]),
     ("name:layers.*", ["name:layers.*"]),
     ("", []),
     (" , ", [])],
)
def test_list_parsing_from_env_and_ini(monkeypatch, tmp_path, text, expected):
    monkeypatch.setenv("FT_INCLUDE_PATTERNS", text)
    assert load_config_from_env().include_patterns == expected
    path = tmp_path / "c.ini"
    path.write_text(f"[flextensor]\nexclude_patterns = {text}\n")
    assert load_config_from_file(path).exclude_patterns == expected


def test_lists_in_yaml_and_json(tmp_path):
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(
        "include_patterns:\n  - layers.*\n  - 'class:*DecoderLayer'\nexclude_patterns: 'head, *.norm'\n"
    )
    cfg = load_config_from_file(yaml_path)
    assert cfg.include_patterns == ["layers.*", "class:*DecoderLayer"]
    assert cfg.exclude_patterns == ["head", "*.norm"]
    json_path = write_config(tmp_path, "json", {"include_patterns": ["embed"], "exclude_patterns": []})
    assert load_config_from_file(json_path).include_patterns == ["embed"]


@pytest.mark.parametrize("text", ["none", "None", "NULL", "null", "", "  "])
def test_max_gpu_mem_fraction_none_spellings(monkeypatch, tmp_path, text):
    monkeypatch.setenv("FT_MAX_GPU_MEM_FRACTION", text)
    assert load_config_from_env().max_gpu_mem_fraction is None
    path = tmp_path / "c.cfg"
    path.write_text(f"[flextensor]\nmax_gpu_mem_fraction = {text}\n")
    assert load_config_from_file(path).max_gpu_mem_fraction is None


def test_max_gpu_mem_fraction_in_files(tmp_path):
    def fraction(fmt, value):
        return load_config_from_file(write_config(tmp_path, fmt, {"max_gpu_mem_fraction": value})).max_gpu_mem_fraction

    assert fraction("json", None) is None
    assert fraction("yaml", 0.5) == 0.5
    assert fraction("yaml", "null") is None
    assert fraction("json", "none") is None
    (tmp_path / "c.yaml").write_text("max_gpu_mem_fraction: 1\n")
    assert load_config_from_file(tmp_path / "c.yaml").max_gpu_mem_fraction == 1.0


def test_env_overrides_file_fraction_with_none(monkeypatch, tmp_path):
    path = write_config(tmp_path, "yaml", {"max_gpu_mem_fraction": 0.9})
    monkeypatch.setenv("FT_MAX_GPU_MEM_FRACTION", "none")
    assert load_config(path).max_gpu_mem_fraction is None


@pytest.mark.parametrize(
    ("var", "value", "fragments"),
    [
        ("FT_ENABLED", "maybe", ["FT_ENABLED", "'maybe'", "'enabled'", "true/false"]),
        ("FT_GPU_DEVICE", "1.5", ["FT_GPU_DEVICE", "'1.5'", "'gpu_device'", "integer"]),
        ("FT_GPU_DEVICE", "-1", ["FT_GPU_DEVICE", "'gpu_device'", "-1", ">= 0"]),
        ("FT_NUM_BLOCKS", "true", ["FT_NUM_BLOCKS", "'num_blocks'", "integer"]),
        ("FT_MAX_GPU_MEM_FRACTION", "1.5", ["FT_MAX_GPU_MEM_FRACTION", "'max_gpu_mem_fraction'", "(0.0, 1.0]"]),
        ("FT_MAX_GPU_MEM_FRACTION", "nan", ["FT_MAX_GPU_MEM_FRACTION", "(0.0, 1.0]"]),
        ("FT_MAX_GPU_MEM_FRACTION", "most", ["FT_MAX_GPU_MEM_FRACTION", "'most'", "none/null/empty"]),
        ("FT_SHM_WAIT_TIMEOUT", "inf", ["FT_SHM_WAIT_TIMEOUT", "'shm_wait_timeout'", "finite"]),
        ("FT_TRANSFER_BUDGET_SCALE", "0", ["FT_TRANSFER_BUDGET_SCALE", "> 0.0"]),
        ("FT_PINNED_MEMORY_MODE", "cuda", ["FT_PINNED_MEMORY_MODE", "'cuda'", "'host_register'"]),
        ("FT_TRANSFER_MODE", "raw_block", ["FT_TRANSFER_MODE", "'raw_block'", "'raw_block_transfer'"]),
        ("FT_PROFILE_MODE", "torch_function", ["FT_PROFILE_MODE", "transfer_mode='strategy'"]),
        ("FT_OFFLOAD_TIMING", "graph", ["FT_OFFLOAD_TIMING", "'graph'", "'cuda_graph'"]),
        ("FT_PIECEWISE_PREFETCH", "loud", ["FT_PIECEWISE_PREFETCH", "'warn'"]),
        ("FT_INCLUDE_PATTERNS", "layers.*,klass:Linear", ["FT_INCLUDE_PATTERNS", "'klass:Linear'", "prefix"]),
        ("FT_EXCLUDE_PATTERNS", "class:", ["FT_EXCLUDE_PATTERNS", "empty glob"]),
        ("FT_LOAD_STRATEGY", "greedy", ["FT_LOAD_STRATEGY", "in code"]),
    ],
)
def test_bad_env_values_name_option_source_value_and_allowed(monkeypatch, var, value, fragments):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as info:
        load_config_from_env()
    for fragment in fragments:
        assert fragment in str(info.value)
    with pytest.raises(ValueError):  # the combined loader reads the same variables
        load_config()


@pytest.mark.parametrize("fmt", ["ini", "yaml", "json"])
def test_bad_file_values_name_file_option_and_allowed(tmp_path, fmt):
    path = write_config(tmp_path, fmt, {"gpu_device": -2})
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    assert str(path) in str(info.value) and "'gpu_device'" in str(info.value) and ">= 0" in str(info.value)

    path = write_config(tmp_path, fmt, {"profiling_iters": "many"})
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    assert str(path) in str(info.value) and "'profiling_iters'" in str(info.value) and "'many'" in str(info.value)


def test_json_types_are_checked(tmp_path):
    path = write_config(tmp_path, "json", {"gpu_device": True})
    with pytest.raises(ValueError, match="'gpu_device'.*int"):
        load_config_from_file(path)
    path = write_config(tmp_path, "json", {"include_patterns": "layers.*, embed"})
    assert load_config_from_file(path).include_patterns == ["layers.*", "embed"]


def test_cross_option_error_names_every_source(monkeypatch, tmp_path):
    path = write_config(tmp_path, "yaml", {"num_blocks": 3})
    monkeypatch.setenv("FT_MIN_BLOCKS", "4")
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert "num_blocks" in message and "min_blocks" in message
    assert f"num_blocks from file {path}" in message
    assert "min_blocks from environment variable FT_MIN_BLOCKS" in message


def test_shm_enabled_from_env_requires_namespace(monkeypatch):
    monkeypatch.setenv("FT_SHM_ENABLED", "1")
    with pytest.raises(ValueError, match="shm_namespace.*shm_enabled=True"):
        load_config_from_env()


def test_unknown_env_var_suggests_nearest(monkeypatch):
    monkeypatch.setenv("FT_GPU_DEVIC", "1")
    with pytest.raises(ValueError, match=r"FT_GPU_DEVIC; did you mean FT_GPU_DEVICE\?"):
        load_config_from_env()
    with pytest.raises(ValueError, match="did you mean FT_GPU_DEVICE"):
        load_config()
    load_config(use_env=False)  # env ignored entirely


def test_unknown_env_var_wrong_case_and_far_names(monkeypatch):
    monkeypatch.setenv("FT_Profiling_Iters", "3")
    with pytest.raises(ValueError, match="did you mean FT_PROFILING_ITERS"):
        load_config_from_env()
    monkeypatch.delenv("FT_Profiling_Iters")
    monkeypatch.setenv("FT_ZZZZZZ", "3")
    with pytest.raises(ValueError, match=r"unknown environment variable FT_ZZZZZZ \(valid: FT_ENABLED"):
        load_config_from_env()


def test_other_parts_env_vars_are_ignored(monkeypatch):
    # conftest already sets FT_DAEMON_SOCKET for every test.
    monkeypatch.setenv("FT_DAEMON_METRICS_PORT", "9100")
    monkeypatch.setenv("FT_EXTERNAL_COMPILE", "1")
    monkeypatch.setenv("FT_GPU_DEVICE", "2")
    assert load_config_from_env().gpu_device == 2
    assert load_config().gpu_device == 2


def test_custom_prefix(monkeypatch):
    monkeypatch.setenv("MYAPP_ENABLED", "1")
    monkeypatch.setenv("MYAPP_NUM_BLOCKS", "8")
    monkeypatch.setenv("FT_NUM_BLOCKS", "not read")
    cfg = load_config_from_env(prefix="MYAPP_")
    assert cfg.enabled is True and cfg.num_blocks == 8


@pytest.mark.parametrize("fmt", ["ini", "yaml", "json"])
def test_unknown_file_key_suggests_nearest(tmp_path, fmt):
    path = write_config(tmp_path, fmt, {"profiling_iter": 3})
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    assert str(path) in str(info.value)
    assert "unknown option 'profiling_iter'; did you mean 'profiling_iters'?" in str(info.value)


@pytest.mark.parametrize("fmt", ["ini", "yaml", "json"])
def test_load_strategy_key_in_file_is_rejected(tmp_path, fmt):
    path = write_config(tmp_path, fmt, {"load_strategy": "GreedyStrategy"})
    with pytest.raises(ValueError, match="load_strategy.*in code"):
        load_config_from_file(path)


def test_ini_without_section_names_file_and_section(tmp_path):
    path = tmp_path / "flextensor.ini"
    path.write_text("[ft]\nenabled = true\n")
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    assert str(path) in str(info.value) and "[flextensor]" in str(info.value)
    path.write_text("enabled = true\n")  # no section header at all
    with pytest.raises(ValueError, match="flextensor.ini"):
        load_config_from_file(path)


@pytest.mark.parametrize(
    ("name", "text"), [("c.yaml", "- a\n- b\n"), ("c.yml", "just text\n"), ("c.json", "[1, 2]")]
)
def test_yaml_and_json_need_a_mapping(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="must be a mapping") as info:
        load_config_from_file(path)
    assert str(path) in str(info.value)


def test_malformed_files(tmp_path):
    bad_json = tmp_path / "c.json"
    bad_json.write_text("{enabled: true")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config_from_file(bad_json)
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_text("enabled: [true\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config_from_file(bad_yaml)


def test_empty_yaml_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config_from_file(path) == OffloadConfig()


def test_unknown_extension_and_missing_file(tmp_path):
    path = tmp_path / "flextensor.toml"
    path.write_text("enabled = true\n")
    with pytest.raises(ValueError, match=r"'\.toml'.*\.ini, \.conf, \.cfg, \.yaml, \.yml, \.json"):
        load_config_from_file(path)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_unknown_kwarg_suggests_nearest():
    with pytest.raises(TypeError, match="'gpu_devices'; did you mean 'gpu_device'"):
        load_config(gpu_devices=1)


def test_kwargs_are_validated():
    with pytest.raises(ValueError, match="'num_blocks'"):
        load_config(num_blocks=1, min_blocks=2)
