import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.engine import KNOBS
from server.config import REPO_ROOT, ConfigError, Settings, load_settings, parse_args

pytestmark = pytest.mark.unit


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


def test_knob_defaults_are_held_to_the_knobs_own_range():
    with pytest.raises(ConfigError, match=r"session.motion_scale=5.0 must be in \[0, 2\]"):
        load_settings(None, {"session.motion_scale": "5"})
    with pytest.raises(ConfigError, match=r"session.dynamic_scale=-0.5 must be in \[0, 2\]"):
        load_settings(None, {"session.dynamic_scale": -0.5})


def test_every_engine_knob_has_a_session_default_from_its_definition():
    assert Settings().session.knob_defaults() == {k.name: k.default for k in KNOBS}


def test_effective_settings_show_overrides_and_withhold_secrets():
    settings = load_settings(None, {"session.pipeline_delay_ms": "160", "ice.username": "bot",
                                    "ice.credential": "hunter2"})
    effective = settings.effective()
    assert effective["session"]["pipeline_delay_ms"] == 160.0
    assert effective["ice"]["username"] == "bot"
    assert effective["ice"]["credential"] == "(withheld)"
    assert "hunter2" not in json.dumps(effective)
    assert load_settings().effective()["ice"]["credential"] == ""  # unset is not a secret


def test_help_lists_every_setting_with_its_default_in_plain_text(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = capsys.readouterr().out
    for section, values in Settings().effective().items():
        for key in values:
            assert f"  {section}.{key} = " in shown
    assert "session.motion_scale = 1.0  (in [0, 2])" in shown
    assert "``" not in shown and ":mod:" not in shown


def test_the_session_counts_left_at_their_defaults_follow_the_cores_the_server_may_run_on():
    cores = len(os.sched_getaffinity(0))
    shipped = load_settings(REPO_ROOT / "configs" / "default.toml")
    assert shipped.session.max_sessions == load_settings().session.max_sessions == 12 * cores
    assert shipped.session.max_motion_sessions == \
        load_settings().session.max_motion_sessions == 24 * cores
    logged = shipped.effective()["session"]  # logged resolved
    assert (logged["max_sessions"], logged["max_motion_sessions"]) == (12 * cores, 24 * cores)
    assert load_settings(None, {"session.max_sessions": 5}).session.max_sessions == 5
    assert load_settings(None, {"session.max_motion_sessions": 0}
                         ).session.max_motion_sessions == 0  # none
    pinned = subprocess.run(
        [sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
         "from server.config import load_settings; s = load_settings().session;"
         "print(s.max_sessions, s.max_motion_sessions)"],
        capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert pinned.stdout.split() == ["12", "24"]  # one core
