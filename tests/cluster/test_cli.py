"""The `raypage` command: generate, chat and bench run as real subprocesses; flag parsing in-process."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench.throughput import make_workload
from cluster.cli import build_parser, main
from cluster.engine_args import engine_settings_from_args
from engine import LLM, EngineConfig, SamplingParams

REPO_ROOT = Path(__file__).parents[2]
SMOLLM2_CONFIG = REPO_ROOT / "configs" / "engine" / "smollm2.yaml"
# Small and exact, so that the CLI's engine and the in-process one are the same engine.
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64"]
PROMPT = "The capital of France is"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`raypage ARGS...` in a fresh interpreter, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=64)


def test_generate_prints_the_completion(llm: LLM) -> None:
    result = run_cli("generate", PROMPT, *ENGINE_FLAGS, "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert expected[0].outputs[0].text
    assert result.stdout == expected[0].outputs[0].text + "\n"


def test_chat_prints_a_reply() -> None:
    result = run_cli(
        "chat", "What is two plus two?", "--system", "Be brief.", *ENGINE_FLAGS, "--max-tokens", "8"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_bench_throughput_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "throughput.json"
    result = run_cli(
        "bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
        *ENGINE_FLAGS, "--output-json", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "output tokens/s" in result.stdout
    record = json.loads(path.read_text())
    for field in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s"):
        assert record[field] > 0
    assert 0 < record["kv_cache_utilization_mean"] <= record["kv_cache_utilization_peak"] <= 1
    assert record["workload"]["num_prompts"] == 4
    assert record["workload"]["total_input_tokens"] == 4 * 16
    assert record["workload"]["total_output_tokens"] == 4 * 8
    assert record["engine"]["num_kv_blocks"] == 64
    assert record["engine"]["dtype"] == "float32"
    assert record["matmul_gflops_per_s"] > 0 and 0 < record["compute_floor_share"] < 1
    assert "of it" in result.stdout.split("Compute floor:")[1]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["generate", "hi", "--no-such-flag"], "--no-such-flag"),
        (["generate", "hi", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["generate", "hi", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["generate", "hi", "--dtype", "float8"], "--dtype"),
        (["chat", "hi", "--top-p", "2"], "top_p"),
        (["bench", "throughput", "--range-ratio", "2"], "--range-ratio"),
    ],
)
def test_bad_arguments_exit_with_a_message_naming_them(
    argv: list[str], named: str, capsys: pytest.CaptureFixture
) -> None:
    # Checked before any weights load, so in-process is quick; the exit is argparse's status 2.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert named in error
    assert "Traceback" not in error


def test_config_file_key_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("max_num_seq: 4\n")
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--config", str(path)])
    error = capsys.readouterr().err
    assert str(path) in error
    assert "'max_num_seq'" in error


def test_bench_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "matplotlib" else find_spec(name, *args),
    )
    with pytest.raises(SystemExit) as exit_info:  # before any request is sent
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1", "2"])
    assert exit_info.value.code == 2
    assert "pip install 'raypage[bench]'" in capsys.readouterr().err


def test_only_given_flags_are_forwarded() -> None:
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_settings_from_args(args) == {}
    args = build_parser().parse_args(
        ["generate", "hi", "--no-enable-prefix-caching", "--kv-cache-memory", "4GiB", "--max-num-seqs", "8"]
    )
    settings = engine_settings_from_args(args)
    assert settings == {"enable_prefix_caching": False, "kv_cache_memory": "4GiB", "max_num_seqs": "8"}
    config = EngineConfig.from_flat(**settings)
    assert config.cache.kv_cache_memory == 4 * 2**30
    assert config.scheduler.max_num_seqs == 8


def test_flags_override_the_config_file() -> None:
    args = build_parser().parse_args(["chat", "hi", "--config", str(SMOLLM2_CONFIG), "--dtype", "float32"])
    settings = engine_settings_from_args(args)
    assert settings["dtype"] == "float32"
    assert settings["max_model_len"] == 2048  # from the file


def test_every_engine_setting_has_a_flag() -> None:
    help_text = build_parser().parse_known_args(["generate", "hi"])[0].command_parser.format_help()
    for key in EngineConfig.flat_fields():
        assert "--" + key.replace("_", "-") in help_text


def test_workload_is_seeded_and_within_the_range() -> None:
    workload = make_workload(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert workload == make_workload(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert all(50 <= len(prompt) <= 150 and 10 <= output_len <= 30 for prompt, output_len in workload)
    assert all(100 <= token < 40000 for prompt, _ in workload for token in prompt)
    fixed = make_workload(num_prompts=3, input_len=16, output_len=8, range_ratio=0.0, seed=0)
    assert [(len(prompt), output_len) for prompt, output_len in fixed] == [(16, 8)] * 3


def test_llm_from_packaged_config() -> None:
    # The packaged config with small-cache overrides: the file's own 1 GiB would be wasted here.
    llm = LLM.from_config(SMOLLM2_CONFIG, dtype="float32", num_kv_blocks=16)
    assert llm.llm_engine.config.model.max_model_len == 2048
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 2
