"""Back-pressure and drain under Ray Serve: the deployments take no more requests at once than the
engine admits, and their graceful shutdown is the drain timeout. SIGTERM to `raypage serve`, which
lets the streams in flight finish and leaves no process behind, is test_clean_stop.py's."""

from __future__ import annotations

import pytest

from cluster.serve.args import parse_app_args
from cluster.serve_app import (
    DRAIN_POLL_S,
    UNBOUNDED_MAX_ONGOING_REQUESTS,
    ingress_options,
    llm_server_options,
)
from engine.config import DEFAULT_WAITING_BATCHES


def test_serve_takes_no_more_requests_than_the_engine_admits() -> None:
    settings = parse_app_args({"max_num_seqs": 8, "max_waiting_requests": 5, "drain_timeout_s": 12})
    options = llm_server_options(settings)
    assert options["max_ongoing_requests"] == 8 + 5
    assert options["graceful_shutdown_timeout_s"] == 12
    assert options["graceful_shutdown_wait_loop_s"] == DRAIN_POLL_S

    # The default waiting queue, several replicas behind a separate ingress, an explicit override.
    settings = parse_app_args({"max_num_seqs": 8, "ingress": "separate", "num_replicas": 2})
    assert llm_server_options(settings)["max_ongoing_requests"] == 8 * (1 + DEFAULT_WAITING_BATCHES)
    assert ingress_options([settings])["max_ongoing_requests"] == 2 * 8 * (1 + DEFAULT_WAITING_BATCHES)
    assert llm_server_options(parse_app_args({"max_ongoing_requests": 7}))["max_ongoing_requests"] == 7
    unbounded = llm_server_options(parse_app_args({"max_waiting_requests": -1}))
    assert unbounded["max_ongoing_requests"] == UNBOUNDED_MAX_ONGOING_REQUESTS
    assert parse_app_args({"request_timeout_s": 2.5}).server.request_timeout_s == 2.5
    with pytest.raises(ValueError, match="drain_timeout_s"):
        parse_app_args({"drain_timeout_s": -1})
    with pytest.raises(ValueError, match="max_waiting_requests"):
        parse_app_args({"max_waiting_requests": -2})
