"""Batch inference as a Ray job: line parsing, the job in-process, and `ray job submit` to a real head.

The head is a `ray start --head --block` of this module's own (own temporary directory, free ports,
own process group), stopped by its process id: other people's clusters on this machine are never
touched, and no process of this one may outlive the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.jobs.batch import main
from cluster.jobs.batch_lines import parse_batch_line
from cluster.jobs.batch_results import ResultsFile
from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.model.tiny_models import write_tiny_model

REPO_ROOT = Path(__file__).parents[2]
RAY = Path(sys.executable).parent / "ray"
# float32 and a fixed cache, so that the job's engine and the reference one compute the same tokens.
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
CHAT = [{"role": "user", "content": "Name three colors."}]
# Line 3 is not JSON; the others run greedily (temperature 0) for comparison with the reference.
INPUT_LINES = [
    json.dumps({"id": "capital", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}),
    json.dumps({"messages": CHAT, "max_tokens": 6, "temperature": 0}),
    '{"prompt": "unterminated',
    json.dumps({"id": 7, "prompt": "def fibonacci(n):", "max_tokens": 5, "temperature": 0}),
]
VALID_LINES = [1, 2, 4]


# ---- parsing, without an engine ----------------------------------------------------------------


def test_a_prompt_line_keeps_its_id_and_sampling_fields() -> None:
    line = parse_batch_line(
        5,
        '{"id": "x", "prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "stop": "\\n", "logit_bias": {"7": 2}}',
    )
    assert (line.number, line.id, line.prompt, line.messages) == (5, "x", "Hi", None)
    params = line.sampling_params
    assert (params.max_tokens, params.temperature, params.stop, params.logit_bias) == (
        3,
        0.5,
        ["\n"],
        {7: 2.0},
    )


def test_a_line_may_hold_a_structured_output() -> None:
    line = parse_batch_line(1, '{"prompt": "Hi", "structured_outputs": {"json": {"type": "object"}}}')
    assert line.sampling_params.structured_outputs == StructuredOutputsParams(json={"type": "object"})


def test_a_chat_line_without_id_is_named_by_its_line_number() -> None:
    line = parse_batch_line(9, json.dumps({"messages": CHAT}))
    assert (line.id, line.prompt, line.messages) == (9, None, CHAT)
    assert line.sampling_params == SamplingParams()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"id": 1}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": "a", "messages": []}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3}', "'prompt' must be a non-empty string"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        (
            '{"messages": [{"role": "user"}]}',
            "messages[0] must be an object with string 'role' and 'content'",
        ),
        ('{"prompt": "a", "id": 1.5}', "'id' must be a string or an integer, got 1.5"),
        ('{"prompt": "a", "id": true}', "'id' must be a string or an integer, got true"),
        ('{"prompt": "a", "max_token": 3}', "unknown field 'max_token'"),
        ('{"prompt": "a", "n": 2}', "field 'n' is not supported"),
        ('{"prompt": "a", "logprobs": 2}', "field 'logprobs' is not supported"),
        ('{"prompt": "a", "temperature": -1}', "temperature must be non-negative"),
        ('{"prompt": "a", "max_tokens": "ten"}', "max_tokens"),
        ('{"prompt": "a", "stop": [""]}', "stop cannot contain an empty string"),
        (
            '{"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["a"]}}',
            "only use one kind of constraint",
        ),
    ],
)
def test_a_bad_line_says_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_batch_line(1, text)
    assert reason in str(info.value)


# ---- the job in this process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    """What the valid lines should give: the same engine settings through the LLM API."""
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    outputs = [
        llm.generate("The capital of France is", greedy, use_tqdm=False)[0],
        llm.chat(CHAT, greedy, use_tqdm=False)[0],
        llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0],
    ]
    llm.llm_engine.shutdown()
    return [
        {
            "id": line_id,
            "text": output.outputs[0].text,
            "finish_reason": output.outputs[0].finish_reason,
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(output.outputs[0].token_ids),
        }
        for line_id, output in zip(["capital", 2, 7], outputs, strict=True)
    ]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(row) for row in path.read_text(encoding="utf-8").splitlines()]


def test_the_job_writes_one_result_per_runnable_line_in_order(
    tmp_path: Path, reference: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    too_long = json.dumps({"prompt": "word " * 300})  # over max_model_len: the engine refuses it
    bad_bias = json.dumps({"prompt": "a", "logit_bias": {"999999": 1}})  # outside the vocabulary
    source = write_lines(tmp_path / "in.jsonl", [*INPUT_LINES, too_long, "", bad_bias])
    output = tmp_path / "out" / "results.jsonl"
    caplog.set_level(logging.INFO, logger="cluster.jobs.batch")

    status = main(
        ["--input", str(source), "--output", str(output), "--progress-interval", "0", *ENGINE_FLAGS]
    )

    assert status == 0
    assert read_results(output) == reference
    messages = [record.getMessage() for record in caplog.records if record.name == "cluster.jobs.batch"]
    assert any(m.startswith("line 3 skipped: not valid JSON") for m in messages)
    assert any(m.startswith("line 5 skipped: The decoder prompt (length") for m in messages)
    assert any(m.startswith("line 6 skipped: not valid JSON") for m in messages)
    assert any(
        m.startswith("line 7 skipped: logit_bias: token id 999999 is out of vocabulary") for m in messages
    )
    assert "3 lines done, 4 skipped: lines 3, 5, 6, 7" in messages
    assert "progress: 3/3 lines done" in messages  # logged after every step at interval 0


def test_the_job_fails_when_no_line_can_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = write_lines(tmp_path / "in.jsonl", ["{}", "[]"])
    assert main(["--input", str(source), "--output", str(tmp_path / "out.jsonl")]) == 1
    assert f"no line of {source} could run" in caplog.text
    missing = tmp_path / "missing.jsonl"
    assert main(["--input", str(missing), "--output", str(tmp_path / "out.jsonl")]) == 1
    assert f"cannot read the input file {missing}" in caplog.text
    assert not (tmp_path / "out.jsonl").exists()


def test_a_results_file_cuts_a_torn_last_line_and_refuses_a_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": 2, "text": "y"}\n{"id": "c", "te', encoding="utf-8")
    results = ResultsFile(path)
    assert (results.num_done_before, results.is_done("a"), results.is_done(2)) == (2, True, True)
    assert not results.is_done("c") and not results.is_done("2")  # the id's type counts
    assert path.read_text(encoding="utf-8").endswith('"y"}\n')  # the torn line is gone
    results.append({"id": "c", "text": "z"})
    results.close_in_order(["c", 2, "a"])
    assert [record["id"] for record in read_results(path)] == ["c", 2, "a"]
    path.write_text('{"id": "a"}\nnot a result\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not a batch result"):
        ResultsFile(path)


@pytest.mark.slow
def test_a_killed_job_resumes_with_every_line_exactly_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job killed with SIGKILL at a random point (after a random number of results), with a torn
    line at the end of its output as a kill mid-write leaves, then run again: every input line is in
    the output exactly once, in input order, and the rerun ran only the lines not done before."""
    model = write_tiny_model(tmp_path / "model")
    lines = [
        json.dumps({**({"id": f"p{i}"} if i % 3 else {}), "prompt": f"Item {i}:", "max_tokens": 8 + i % 9})
        for i in range(40)
    ]
    ids = [f"p{i}" if i % 3 else i + 1 for i in range(40)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    flags = ["--input", str(source), "--output", str(output), "--model", str(model), "--max-num-seqs", "2"]
    flags += ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
    kill_after = random.Random(secrets.randbits(32)).randint(1, 20)
    job = subprocess.Popen(
        [sys.executable, "-m", "cluster.jobs.batch", *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            if output.exists() and output.read_bytes().count(b"\n") >= kill_after:
                break
            time.sleep(0.002)
    finally:
        job.kill()  # SIGKILL: nothing of the job gets to clean up
        job.wait()
    assert job.returncode == -signal.SIGKILL, f"the job ended by itself before {kill_after} results"
    done_before = len(read_results(output))
    assert kill_after <= done_before < len(lines)
    with output.open("a", encoding="utf-8") as file:
        file.write('{"id": "p1", "text": "torn')  # what a kill in the middle of a write leaves

    caplog.set_level(logging.INFO, logger="cluster.jobs.batch")
    assert main(flags) == 0

    assert [record["id"] for record in read_results(output)] == ids
    messages = [record.getMessage() for record in caplog.records if record.name == "cluster.jobs.batch"]
    assert f"running {len(lines) - done_before} lines (0 skipped)" in messages
    assert f"40 lines done ({done_before} of them before this run), 0 skipped" in messages


# ---- `ray job submit` against a real head ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RayHead:
    """A head node started by this module: its `ray start --block` process and where it lives."""

    process: subprocess.Popen
    temp_dir: Path
    dashboard_url: str
    # Token authentication (Ray's default) with this cluster's own token, for `ray` commands to use.
    auth_env: dict[str, str]

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: its process group, or anything naming its temp dir."""
        found = []
        for process in psutil.process_iter(["cmdline"]):
            try:
                if os.getpgid(process.pid) == self.process.pid or str(self.temp_dir) in " ".join(
                    process.info["cmdline"] or ()
                ):
                    found.append(process)
            except (ProcessLookupError, psutil.Error):
                continue  # gone meanwhile
        return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ray_head(temp_dir: Path) -> RayHead:
    """`ray start --head --block` with the dashboard on loopback, waiting until the dashboard listens.

    Every fixed-by-default port gets a free one, so that clusters of other tests can run beside it.
    """
    dashboard_port = free_port()
    command = [
        str(RAY), "start", "--head", "--block", "--disable-usage-stats",
        "--port", str(free_port()),
        "--ray-client-server-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
        "--num-cpus", "2", "--object-store-memory", str(100 * 1024 * 1024),
        "--temp-dir", str(temp_dir),
    ]  # fmt: skip
    token_path = temp_dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    # The job's `python` is whatever the head's PATH finds first: this virtualenv's.
    env = {**os.environ, **auth_env, "PATH": f"{RAY.parent}{os.pathsep}{os.environ['PATH']}"}
    with (temp_dir / "ray-start.log").open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    head = RayHead(process, temp_dir, f"http://127.0.0.1:{dashboard_port}", auth_env)
    deadline = time.monotonic() + 120
    while not _listening(dashboard_port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_ray_head(head)
            pytest.fail(f"ray start failed:\n{(temp_dir / 'ray-start.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return head


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_ray_head(head: RayHead) -> None:
    """SIGTERM to `ray start --block` stops its node; kill only what of it outlives a grace period."""
    head.process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.process.wait(timeout=45)
    # Some of the node's processes (the dashboard's) finish exiting a few seconds after it.
    _, alive = psutil.wait_procs(head.processes(), timeout=15)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    # Short: Ray's Unix socket paths under it must stay within 107 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    head = start_ray_head(temp_dir)
    yield head
    stop_ray_head(head)
    assert not head.processes(), "processes of the test cluster outlived it"
    shutil.rmtree(temp_dir, ignore_errors=True)


def submit_batch_job(head: RayHead, *batch_args: str) -> subprocess.CompletedProcess:
    """`ray job submit` of the batch job, waiting for it to end; its logs come back on stdout."""
    runtime_env = {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    command = [
        str(RAY), "job", "submit", "--address", head.dashboard_url, "--working-dir", str(REPO_ROOT),
        "--runtime-env-json", json.dumps(runtime_env),
        "--", "python", "-m", "cluster.jobs.batch", *batch_args,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, **head.auth_env}
    )


@pytest.mark.slow
def test_ray_job_submit_runs_the_batch(
    ray_head: RayHead, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    source = write_lines(tmp_path / "prompts.jsonl", INPUT_LINES)
    output = tmp_path / "results.jsonl"
    config = "configs/engine/smollm2.yaml"  # relative: the job runs in its copy of the working dir

    result = submit_batch_job(
        ray_head, "--config", config, "--input", str(source), "--output", str(output), *ENGINE_FLAGS
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "succeeded" in result.stdout
    results = read_results(output)
    assert [record["id"] for record in results] == ["capital", 2, 7]
    assert results == reference
    for record in results:
        assert record["text"].strip()
        assert 0 < record["completion_tokens"] <= 6 and record["prompt_tokens"] > 0
    assert "line 3 skipped: not valid JSON" in result.stdout
    assert "3 lines done, 1 skipped: lines 3" in result.stdout
    # The working dir went up without what .gitignore names (the virtualenv above all).
    unpacked = ray_head.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
    uploads = [path for path in unpacked.iterdir() if path.is_dir()]
    assert uploads and all((upload / "cluster/jobs/batch.py").is_file() for upload in uploads)
    assert not any((upload / ".venv").exists() for upload in uploads)


@pytest.mark.slow
def test_a_job_with_an_unreadable_input_fails(ray_head: RayHead, tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = submit_batch_job(ray_head, "--input", str(missing), "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode != 0
    assert f"cannot read the input file {missing}" in result.stdout
