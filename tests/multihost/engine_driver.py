"""Run on the head host of a multi-host cluster: a TP=2 x PP=2 engine whose workers are Ray actors on
the other hosts generates greedily, then reports, as one JSON line on stdout, its tokens, where each
rank ran, and every TCP socket each worker process holds (read inside the worker, in its host's
network namespace), as JSON in REPORT (stdout carries the workers' logs).

    python -m tests.multihost.engine_driver MODEL RAY_ADDRESS PROMPTS_JSON REPORT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import ray

from engine import LLM, SamplingParams

WORKER_BUNDLE = {"CPU": 1.0, "multihost_worker": 1.0}


def tcp_sockets(_actor: object) -> list[dict[str, object]]:
    """This process's TCP sockets: local and remote (ip, port), and state."""
    return [
        {"local": list(conn.laddr), "remote": list(conn.raddr) if conn.raddr else None, "status": conn.status}
        for conn in psutil.Process().net_connections(kind="tcp")
    ]


def main(model: str, address: str, prompts: list[str], report_path: Path) -> None:
    llm = LLM(
        model,
        multiprocess_mode=False,  # the core in this process, so that its executor is at hand
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address=address,
        placement_bundle=WORKER_BUNDLE,
        dtype="float32",
        num_kv_blocks=64,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
        executor = llm.llm_engine.engine_core.engine_core.executor
        # __ray_call__ runs a function inside the actor's own process, on its own host.
        sockets = ray.get([worker.__ray_call__.remote(tcp_sockets) for worker in executor._workers])
        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        report = {
            "tokens": tokens,
            "worker_ips": [ips[node] for node in executor.worker_nodes],
            "worker_sockets": sockets,
            "ray_ports": sorted(ray_service_ports()),
        }
    finally:
        llm.llm_engine.shutdown()
    report_path.write_text(json.dumps(report))


def ray_service_ports() -> set[int]:
    """The ports of Ray's own services on every node (GCS, raylet, object manager, agents)."""
    ports = {int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])}
    for node in ray.nodes():
        ports.update(
            node[key]
            for key in (
                "NodeManagerPort",
                "ObjectManagerPort",
                "MetricsExportPort",
                "MetricsAgentPort",
                "DashboardAgentListenPort",
                "RuntimeEnvAgentPort",
            )
            if node.get(key)
        )
    return ports


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]))
