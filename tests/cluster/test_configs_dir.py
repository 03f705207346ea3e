"""Every file under configs/ loads through the code that reads it for real.

The directory is walked, so a new file is checked without touching this test; each top-level folder
is a kind with its own check, and a file of a kind this test does not know fails.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from cluster.serve.args import parse_app_models
from engine.config import EngineConfig
from engine.models.arch_config import ArchConfig
from engine.models.model_files import read_arch_config, resolve_model_source, valid_tensor_parallel_sizes
from parallel.pipeline import partition_layers

REPO_ROOT = Path(__file__).parents[2]
CONFIGS = REPO_ROOT / "configs"
SERVE_IMPORT_PATH = "cluster.serve_app:build_app"


@functools.cache
def packaged_model_arch() -> ArchConfig:
    return read_arch_config(resolve_model_source(None))


def check_parallel_layout(config: EngineConfig) -> None:
    """The layout must split the packaged model (heads over TP ranks, layers over stages): a valid
    EngineConfig can still name a layout the model cannot run, which would fail only at start."""
    if config.model.model is not None:
        return  # another model's files are not here to read
    arch = packaged_model_arch()
    parallel = config.parallel
    assert parallel.tensor_parallel_size in valid_tensor_parallel_sizes(arch), (
        f"SmolLM2 cannot be split over tensor_parallel_size={parallel.tensor_parallel_size}"
    )
    partition_layers(arch.num_layers, parallel.pipeline_parallel_size, parallel.pipeline_partition)


def check_engine_file(path: Path) -> None:
    check_parallel_layout(EngineConfig.from_yaml(path))


def check_serve_file(path: Path) -> None:
    """Ray's own model of a Serve config file, then each application's args through the app's parser."""
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert config.applications, f"{path} deploys no application"
    for app in config.applications:
        assert app.import_path == SERVE_IMPORT_PATH
        # Serve files name engine files relative to the repository root, where `serve run` is started.
        args = with_rooted_engine_file(app.args)
        if "models" in args:
            args["models"] = [with_rooted_engine_file(model) for model in args["models"]]
        for model in parse_app_models(args):
            check_parallel_layout(model.engine_config)


def with_rooted_engine_file(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with its engine file (if any) named from the repository root."""
    args = dict(args)
    if "config" in args:
        args["config"] = str(REPO_ROOT / args["config"])
    return args


@functools.cache
def ray_cluster_schema() -> dict[str, Any]:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def check_ray_launcher_file(path: Path) -> None:
    """Ray's JSON schema for cluster YAML, then what `ray up` does before launching anything: fill
    in the provider's defaults and check the rules across fields (head_node_type among the node
    types, min_workers within max_workers)."""
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, ray_cluster_schema())
    validate_config(prepare_config(copy.deepcopy(config)))


CHECKS: dict[str, Callable[[Path], None]] = {
    "engine": check_engine_file,
    "serve": check_serve_file,
    "ray": check_ray_launcher_file,
}


def check_config_file(path: Path, root: Path = CONFIGS) -> None:
    """Check `path` by its kind: the first folder below `root`."""
    kind = path.relative_to(root).parts[0]
    if kind not in CHECKS or path.suffix != ".yaml":
        raise ValueError(f"{path}: not a known kind of config (.yaml files under {', '.join(CHECKS)}/)")
    CHECKS[kind](path)


def config_files(root: Path = CONFIGS) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize("path", config_files(), ids=lambda path: str(path.relative_to(CONFIGS)))
def test_config_file_is_valid(path: Path) -> None:
    check_config_file(path)


def test_every_kind_has_files() -> None:
    kinds = {path.relative_to(CONFIGS).parts[0] for path in config_files()}
    assert kinds == set(CHECKS)


def test_the_layouts_cover_tp_pp_and_both() -> None:
    layouts = {
        (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size)
        for config in map(EngineConfig.from_yaml, (CONFIGS / "engine").glob("*.yaml"))
    }
    assert {(1, 1), (3, 1), (1, 2), (3, 2)} <= layouts
    assert (
        EngineConfig.from_yaml(CONFIGS / "engine" / "smollm2-tp3-pp2.yaml").parallel.executor_backend == "ray"
    )


# ---- the checks have teeth -----------------------------------------------------------------------


def write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_unknown_kind_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a known kind"):
        check_config_file(write(tmp_path / "kubernetes" / "x.yaml", {}), root=tmp_path)
    with pytest.raises(ValueError, match="not a known kind"):
        check_config_file(write(tmp_path / "engine" / "notes.txt", {}), root=tmp_path)


def test_a_bad_engine_file_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'max_num_seq'"):
        check_engine_file(write(tmp_path / "a.yaml", {"max_num_seq": 4}))
    with pytest.raises(AssertionError, match="tensor_parallel_size=2"):
        check_engine_file(write(tmp_path / "b.yaml", {"tensor_parallel_size": 2}))


def test_a_bad_serve_file_fails(tmp_path: Path) -> None:
    app = {"name": "raypage", "import_path": SERVE_IMPORT_PATH, "args": {"max_num_seqs": 0}}
    with pytest.raises(ValueError, match="max_num_seqs"):
        check_serve_file(write(tmp_path / "s.yaml", {"applications": [app]}))


def test_a_bad_ray_launcher_file_fails(tmp_path: Path) -> None:
    config = yaml.safe_load((CONFIGS / "ray" / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["resources"] = {"CPU": "eight"}
    with pytest.raises(jsonschema.ValidationError):
        check_ray_launcher_file(write(tmp_path / "r1.yaml", config))
    config = yaml.safe_load((CONFIGS / "ray" / "cluster.yaml").read_text())
    config["head_node_type"] = "missing"
    with pytest.raises(ValueError, match="head_node_type"):
        check_ray_launcher_file(write(tmp_path / "r2.yaml", config))
