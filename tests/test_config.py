from pathlib import Path

import pytest

from server.config import REPO_ROOT, ConfigError, load_settings, parse_args


def test_shipped_config_loads_with_no_public_stun():
    settings = load_settings(REPO_ROOT / "configs" / "default.toml")
    assert settings.ice.servers == []
    assert settings.http.host == "127.0.0.1"
    assert settings.manifest_path.exists()


def test_command_line_overrides_the_file():
    settings = parse_args(["--port", "9123", "--host", "0.0.0.0", "--ice-host", "127.0.0.1",
                           "--set", "scheduler.max_batch=3",
                           "--set", "ice.servers=stun:a:1,stun:b:2"])
    assert settings.http.port == 9123
    assert settings.http.host == "0.0.0.0"
    assert settings.ice.host_addresses == ["127.0.0.1"]
    assert settings.scheduler.max_batch == 3
    assert settings.ice.servers == ["stun:a:1", "stun:b:2"]


@pytest.mark.parametrize(("overrides", "named"), [
    ({"scheduler.max_batch": -1}, "scheduler.max_batch=-1"),
    ({"video.size": 300}, "video.size=300"),
    ({"http.port": 70000}, "http.port=70000"),
    ({"nosuch.key": 1}, "[nosuch]"),
    ({"http.nosuch": 1}, "http.nosuch"),
    ({"http.port": "eighty"}, "http.port"),
    ({"engine.runtime": "cuda"}, "engine.runtime='cuda'"),
])
def test_bad_settings_are_refused_naming_the_value(overrides, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_settings(None, overrides)


def test_unreadable_config_file_is_a_config_error(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[http\nport = 1")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_settings(bad)
