"""The Ray executor with its workers on hosts of their own (network namespaces joined by a bridge).

The head host runs the driver (the engine core) and no worker; each of the two worker hosts offers
two `multihost_worker` slots, which every worker bundle asks for, so a TP=2 x PP=2 engine puts one
pipeline stage on each worker host. Unlike ray.cluster_utils' nodes, which share one loopback, these
hosts reach each other only through their own addresses: a rendezvous or a gloo connection bound
to loopback cannot work here.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.model.tiny_models import write_tiny_model
from tests.multihost.netns_cluster import Host, NetnsCluster

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3, 4,"]
HOSTS = [
    Host("head", 1, num_cpus=1),
    Host("w1", 2, num_cpus=2, resources={"multihost_worker": 2}),
    Host("w2", 3, num_cpus=2, resources={"multihost_worker": 2}),
]
SUBNET = ipaddress.ip_network("198.18.0.0/24")
DRIVER_TIMEOUT_S = 240.0  # a cap for a broken cluster; nothing here is timed


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    with NetnsCluster(HOSTS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads and 2 KV heads split over two TP ranks; 2 layers, one per pipeline stage.
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tp2_pp2_on_two_hosts_matches_the_single_process_engine(cluster, tiny_model, tmp_path):
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, distributed_executor_backend="uni")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    argv = [sys.executable, "-m", "tests.multihost.engine_driver", str(tiny_model), cluster.address]
    report_path = tmp_path / "report.json"
    done = cluster.run("head", [*argv, json.dumps(PROMPTS), str(report_path)], timeout=DRIVER_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-6000:]
    report = json.loads(report_path.read_text())

    assert report["tokens"] == expected
    # Ranks 0-1 are stage 0, ranks 2-3 stage 1: each stage on one worker host, the stages on two.
    ips = report["worker_ips"]
    assert ips[0] == ips[1] != ips[2] == ips[3]
    assert set(ips) == {"198.18.0.2", "198.18.0.3"}
    ray_ports = set(report["ray_ports"])
    for rank, sockets in enumerate(report["worker_sockets"]):
        # The worker's own connections (the rendezvous store, gloo's pairs), not Ray's to its services.
        own = [
            (local, remote)
            for local, remote in ((sock["local"], sock["remote"]) for sock in sockets if sock["remote"])
            if local[1] not in ray_ports and remote[1] not in ray_ports
        ]
        print(rank, own)
        assert own, f"rank {rank} holds no connection of its own: {sockets}"
        for local, remote in own:
            for address in (ipv4(local[0]), ipv4(remote[0])):
                assert ipaddress.ip_address(address) in SUBNET, f"rank {rank}: {local} -> {remote}"
        # Gloo's pairs reach the other stage's host (the TP peer is on its own host's address).
        peers = {ipv4(remote[0]) for _, remote in own}
        assert set(ips) <= peers, f"rank {rank} has no connection to {set(ips) - peers}"


def ipv4(address: str) -> str:
    """`address` as IPv4 (a dual-stack socket shows 198.18.0.2 as ::ffff:198.18.0.2)."""
    parsed = ipaddress.ip_address(address)
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)
