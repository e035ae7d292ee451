"""Loading what to serve (``load_settings``, the environment of a plain hypercorn launch)
and the command's own startup behaviour (``docs/serve.md``)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from inference_lab.errors import ConfigError
from inference_lab.serve import cli as serve_cli
from inference_lab.serve import load_settings, server, settings_from_env
from tests.conftest import CONFIGS, GPT, LLAMA, ROOT, make_settings


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory with copies of two shipped configs (profiles found through the
    environment)."""
    monkeypatch.setenv("INFERENCE_LAB_HARDWARE_PROFILES", str(ROOT / "hardware_profiles"))
    for name in ("gpt-oss-20b.toml", "Llama-3.1-8B-Instruct.toml"):
        shutil.copy(CONFIGS / name, tmp_path / name)
    return tmp_path


def test_directory_mode_loads_sorted_configs() -> None:
    settings = load_settings(config=CONFIGS)
    names = [d.model.name for d in settings.deployments]
    files = [d.config_path.name for d in settings.deployments]
    assert files == sorted(files)
    assert GPT in names and LLAMA in names and len(names) == 6
    assert all(d.hardware_name == "b200" for d in settings.deployments)


def test_files_without_the_hardware_entry_are_skipped_with_a_line() -> None:
    skipped: list[str] = []
    settings = load_settings(config=CONFIGS, hardware="a100", on_skip=skipped.append)
    names = {d.model.name for d in settings.deployments}
    assert GPT not in names and LLAMA in names
    assert any("gpt-oss-20b.toml" in line and "hardware.a100" in line for line in skipped)


def test_a_single_file_without_the_entry_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"gpt-oss-20b.toml: hardware.a100: no such entry"):
        load_settings(config=CONFIGS / "gpt-oss-20b.toml", hardware="a100")


def test_no_model_left_is_an_error(config_dir: Path) -> None:
    (config_dir / "Llama-3.1-8B-Instruct.toml").unlink()
    skipped: list[str] = []
    with pytest.raises(ConfigError, match="no model config has a \\[hardware.a100\\] entry"):
        load_settings(config=config_dir, hardware="a100", on_skip=skipped.append)
    assert len(skipped) == 1


def test_duplicate_model_names_are_an_error(config_dir: Path) -> None:
    shutil.copy(config_dir / "gpt-oss-20b.toml", config_dir / "zz-copy.toml")
    with pytest.raises(ConfigError, match="model.name: 'gpt-oss-20b' is already served by"):
        load_settings(config=config_dir)


def test_an_invalid_config_is_an_error_naming_file_and_key(config_dir: Path) -> None:
    path = config_dir / "gpt-oss-20b.toml"
    path.write_text(path.read_text().replace("max_num_seqs = 256", "max_num_seqs = 0"))
    with pytest.raises(ConfigError, match="gpt-oss-20b.toml: scheduler.max_num_seqs"):
        load_settings(config=config_dir)


def test_missing_path_and_empty_directory_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or directory"):
        load_settings(config=tmp_path / "nope")
    with pytest.raises(ConfigError, match="no model configs"):
        load_settings(config=tmp_path)


def test_overrides_apply_to_every_model() -> None:
    settings = load_settings(config=CONFIGS, max_waiting=5, max_num_seqs=3)
    assert {(d.scheduler.max_waiting, d.scheduler.max_num_seqs) for d in settings.deployments} == {
        (5, 3)
    }


def test_workload_and_seed_are_loaded() -> None:
    settings = load_settings(
        config=CONFIGS / "gpt-oss-20b.toml",
        workload=CONFIGS / "workloads" / "quick.toml",
        seed=9,
        default_max_tokens=17,
    )
    assert settings.workload is not None and settings.seed == 9
    assert settings.default_max_tokens == 17


def test_environment_configures_a_plain_hypercorn_launch() -> None:
    env = {
        "INFERENCE_LAB_CONFIG": str(CONFIGS / "gpt-oss-20b.toml"),
        "INFERENCE_LAB_HARDWARE": "h200",
        "INFERENCE_LAB_MAX_WAITING": "7",
        "INFERENCE_LAB_MAX_NUM_SEQS": "9",
        "INFERENCE_LAB_DEFAULT_MAX_TOKENS": "11",
        "INFERENCE_LAB_SEED": "3",
    }
    settings = settings_from_env(env)
    (dep,) = settings.deployments
    assert (dep.hardware_name, dep.scheduler.max_waiting, dep.scheduler.max_num_seqs) == (
        "h200",
        7,
        9,
    )
    assert (settings.default_max_tokens, settings.seed) == (11, 3)


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("INFERENCE_LAB_MAX_WAITING", "-1", "INFERENCE_LAB_MAX_WAITING: must be an integer >= 0"),
        ("INFERENCE_LAB_MAX_NUM_SEQS", "x", "INFERENCE_LAB_MAX_NUM_SEQS: must be an integer >= 1"),
        ("INFERENCE_LAB_ENABLE_TEST_HARNESS", "maybe", "INFERENCE_LAB_ENABLE_TEST_HARNESS"),
        ("INFERENCE_LAB_API_KEY", "a b", "^INFERENCE_LAB_API_KEY: must be 1-4096"),
        ("INFERENCE_LAB_ALLOWED_ORIGINS", "x", "^INFERENCE_LAB_ALLOWED_ORIGINS: 'x' is not"),
        ("INFERENCE_LAB_WORKLOAD", "quik", "^INFERENCE_LAB_WORKLOAD quik: no such file"),
    ],
)
def test_bad_environment_is_a_config_error(name: str, value: str, fragment: str) -> None:
    env = {"INFERENCE_LAB_CONFIG": str(CONFIGS / "gpt-oss-20b.toml"), name: value}
    with pytest.raises(ConfigError, match=fragment):
        settings_from_env(env)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_parse_with_the_spec_defaults() -> None:
    args = _args()
    assert (args.config, args.hardware, args.host, args.port) == (None, None, "127.0.0.1", 8080)
    assert args.default_max_tokens == 256 and not args.enable_test_harness


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--workload", "nope.toml"], "nope.toml: no such file"),
        # a setting's error names the flag it was given with, not the setting
        (["--api-key", "a b"], "error: --api-key: must be 1-4096 printable ASCII"),
        (["--control-token", "a b"], "error: --control-token: must be 1-4096 printable"),
        (["--allowed-origins", "ftp:/x"], "error: --allowed-origins: 'ftp:/x' is not an origin"),
        (["--workload", "quik"], "error: --workload quik: no such file, and no shipped workload"),
    ],
)
def test_startup_errors_print_one_line_and_return_1(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_cli.run(_args("--config", str(CONFIGS / "gpt-oss-20b.toml"), *argv)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and err[0].startswith("inference-lab serve: error:")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("INFERENCE_LAB_API_KEY", "a b"),
        ("INFERENCE_LAB_CONTROL_TOKEN", "a b"),
        ("INFERENCE_LAB_ALLOWED_ORIGINS", "ftp:/x"),
    ],
)
def test_a_secret_taken_from_the_environment_is_named_by_its_variable(
    variable: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve`` without the flag reads the variable; its error names the variable."""
    monkeypatch.setenv(variable, value)
    assert serve_cli.run(_args("--config", str(CONFIGS / "gpt-oss-20b.toml"))) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"inference-lab serve: error: {variable}: "), line


@pytest.mark.parametrize("flag", ["--api-key", "--control-token"])
def test_an_empty_secret_flag_is_a_one_line_startup_error(
    flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--api-key ""`` (a launcher's unset variable) never means "no key": it is one line
    naming the flag, and the server does not start."""
    monkeypatch.delenv("INFERENCE_LAB_API_KEY", raising=False)
    monkeypatch.delenv("INFERENCE_LAB_CONTROL_TOKEN", raising=False)
    assert serve_cli.run(_args("--config", str(CONFIGS / "gpt-oss-20b.toml"), flag, "")) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"inference-lab serve: error: {flag}: is empty"), line


@pytest.mark.parametrize("variable", ["INFERENCE_LAB_API_KEY", "INFERENCE_LAB_CONTROL_TOKEN"])
def test_an_empty_secret_variable_is_a_startup_error(
    variable: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret's variable set to "" is an error naming it, for ``serve`` and for a plain
    hypercorn launch (``settings_from_env``); unset, it means no secret."""
    monkeypatch.setenv(variable, "")
    assert serve_cli.run(_args("--config", str(CONFIGS / "gpt-oss-20b.toml"))) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"inference-lab serve: error: {variable}: is empty"), line
    env = {"INFERENCE_LAB_CONFIG": str(CONFIGS / "gpt-oss-20b.toml")}
    with pytest.raises(ConfigError, match=f"^{variable}: is empty"):
        settings_from_env({**env, variable: ""})
    settings = settings_from_env(env)
    assert settings.api_key is None and settings.control_token is None


def test_shipped_config_and_workload_are_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config gpt-oss-20b`` and ``--workload quick`` (and their variables) find the
    shipped files from a directory that has no ``configs/``; an unknown name is one line
    naming the variable and listing the shipped names."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERENCE_LAB_HARDWARE_PROFILES", raising=False)
    settings = load_settings(config="gpt-oss-20b", workload="quick")
    (dep,) = settings.deployments
    assert dep.config_path == CONFIGS / "gpt-oss-20b.toml" and settings.workload is not None
    env = {"INFERENCE_LAB_CONFIG": "gpt-oss-20b", "INFERENCE_LAB_WORKLOAD": "chat-closed-64"}
    settings = settings_from_env(env)
    assert settings.workload is not None and settings.workload.num_concurrent_users == 64
    with pytest.raises(ConfigError) as info:
        settings_from_env({"INFERENCE_LAB_CONFIG": "gpt-oss-2b"})
    message = str(info.value)
    assert message.startswith("INFERENCE_LAB_CONFIG gpt-oss-2b: no such file")
    assert "gpt-oss-20b" in message and "Llama-3-70B" in message


def test_without_config_the_shipped_models_are_served_not_the_working_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """settings Rule 4: with no ``--config`` (and no ``INFERENCE_LAB_CONFIG``), an unrelated
    ``./configs/`` folder is ignored and the shipped configs are served on b200; naming
    the folder serves it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text("not a model config = [")
    shipped = sorted(p for p in CONFIGS.glob("*.toml"))
    for settings in (load_settings(), settings_from_env({})):
        assert [d.config_path for d in settings.deployments] == shipped
        assert {d.hardware_name for d in settings.deployments} == {"b200"}
    with pytest.raises(ConfigError, match="mine.toml"):
        load_settings(config="configs")


def test_hardware_defaults_to_the_only_entry_else_b200(tmp_path: Path) -> None:
    """resources Rule 5 in serve: a config with one entry is served on it; one with several
    on b200; several without b200 is one line asking for the flag (or its variable)."""
    text = (CONFIGS / "gpt-oss-20b.toml").read_text()
    head = text[: text.index("[hardware.")]
    only = tmp_path / "only.toml"
    only.write_text(head + '[hardware.h100]\nprofile = "h100"\n')
    (dep,) = load_settings(config=only).deployments
    assert dep.hardware_name == "h100"
    (dep,) = load_settings(config="gpt-oss-20b").deployments
    assert dep.hardware_name == "b200"
    two = tmp_path / "two.toml"
    two.write_text(head + '[hardware.h100]\nprofile = "h100"\n[hardware.h200]\nprofile = "h200"\n')
    with pytest.raises(ConfigError) as info:
        settings_from_env({"INFERENCE_LAB_CONFIG": str(two)})
    assert str(info.value) == (
        f"{two}: hardware.b200: no such entry (available: h100, h200; choose one with "
        "INFERENCE_LAB_HARDWARE)"
    )
    banner = serve_cli._banner(load_settings(config=only), "http://127.0.0.1:8080").splitlines()[0]
    assert banner == "inference-lab serve: 1 model(s) on h100"


def test_a_port_in_use_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    sock = server.bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        args = _args("--config", str(CONFIGS / "gpt-oss-20b.toml"), "--port", str(port))
        assert serve_cli.run(args) == 1
    finally:
        sock.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


def test_banner_names_models_hardware_bounds_and_address() -> None:
    settings = make_settings(GPT, LLAMA, max_waiting=64)
    banner = serve_cli._banner(settings, "http://127.0.0.1:8080")
    lines = banner.splitlines()
    assert lines[0] == "inference-lab serve: 2 model(s) on b200"
    assert GPT in lines[1] and "max_num_seqs 256" in lines[1] and "max_waiting 64" in lines[1]
    assert LLAMA in lines[2]
    assert lines[-1].startswith("listening on http://127.0.0.1:8080")
    assert "frontend latency" not in banner
    delayed = make_settings(GPT, frontend_latency=0.002)
    line = serve_cli._banner(delayed, "http://127.0.0.1:8080").splitlines()[1]
    assert "frontend latency 2 ms" in line


def test_banner_shows_expert_parallelism_and_dp_attention() -> None:
    from inference_lab.core.config import load_deployment
    from inference_lab.serve import ServeSettings

    dep = load_deployment(CONFIGS / "frontier" / "DeepSeek-V3.toml", "h200")
    settings = ServeSettings(deployments=(dep,), workload=None, seed=None)
    line = serve_cli._banner(settings, "http://127.0.0.1:8080").splitlines()[1]
    assert "tp 8 (ep 8, dp attention 8)" in line
    plain = serve_cli._banner(make_settings(GPT), "http://127.0.0.1:8080")
    assert "dp attention" not in plain


def test_listening_socket_sets_tcp_user_timeout() -> None:
    import socket

    sock = server.bind_socket("127.0.0.1", 0)
    try:
        timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    finally:
        sock.close()
    assert timeout == server.TCP_USER_TIMEOUT_MS


async def test_the_banner_is_printed_once_the_server_answers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "listening on" means ready: it is printed after the app's start-up (here made to
    take 0.3 s), so a client that waits for it is not kept in the accept queue; the first
    signal then drains and stops the server (the signal receiver is still installed)."""
    import os
    import signal
    import time

    import trio

    from inference_lab.serve import create_app

    app = create_app(make_settings(GPT))
    started: list[float] = []

    @app.before_serving
    async def slow_start_up() -> None:
        await trio.sleep(0.3)
        started.append(time.monotonic())

    banner = "listening on test"
    printed: list[float] = []
    shown = trio.Event()

    def recording_print(*values: object, **options: object) -> None:
        if values == (banner,):
            printed.append(time.monotonic())
            shown.set()

    monkeypatch.setattr(server, "print", recording_print, raising=False)

    async def stop_after_banner() -> None:
        await shown.wait()
        os.kill(os.getpid(), signal.SIGINT)

    sock = server.bind_socket("127.0.0.1", 0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_after_banner)
            await server.serve_until_signalled(
                app, sock, grace=1.0, backlog=16, banner=banner, prog="inference-lab serve"
            )
    assert started and printed and printed[0] >= started[0]
