"""A Ray driver for tests/test_ray_training.py: run one stage through `launch.run_stage` and write what it logged.

    python tests/ray_training_driver.py REQUEST.json RESULT.json

REQUEST: {"module": "stages.sft", "config": {...}, "inputs": {name: launch._input_spec(...)}, "root": DIR,
"seed": 0, "task": optional Ray options}. The stage runs with a LocalContext rooted at DIR (its checkpoints, outputs
and the multi-node work directory go there); with "task" it runs inside a Ray task with those options (e.g.
{"num_cpus": 1, "resources": {"head": 1}}), as a stage of `r1flow run --cluster` does, else in this process. RESULT: {"metrics": [[step, {...}], ...], "params": {...}, "outputs": {name: path}}
or, when the stage raised, {"error": type, "message": str}. Started inside the cluster's network namespace
with RAY_ADDRESS set (tests/ray_cluster.py), so `run_stage` connects to the cluster itself.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.base import LocalContext  # noqa: E402
from stages.training import launch  # noqa: E402


def run_request(request: dict) -> dict:
    """Run the request's stage here; what it logged and where its outputs are."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(request["module"])
    cfg = module.CONFIG.model_validate(request["config"])
    inputs = {name: launch._input_from(spec) for name, spec in request["inputs"].items()}
    ctx = LocalContext(Path(request["root"]), seed=request.get("seed", 0))
    outputs = launch.run_stage(module, cfg, inputs, ctx)
    return json.loads(json.dumps({"metrics": ctx.metrics, "params": ctx.params,
                                  "outputs": {name: str(o.path) for name, o in outputs.items()}}, default=str))


def run_as_task(request: dict) -> dict:
    """`run_request` inside a Ray task placed by request["task"] (the job's workers get the driver's MKL mode)."""
    import ray

    from stages.runtime.threads import REPRODUCIBLE_VAR, reproducible_products

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING,
             runtime_env={"env_vars": {REPRODUCIBLE_VAR: reproducible_products(dict(os.environ))}})
    try:
        return ray.get(ray.remote(max_retries=0, **request["task"])(run_request).remote(request))
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
    finally:
        ray.shutdown()


def main(request_path: str, result_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = json.loads(Path(request_path).read_text())
    try:
        result = run_as_task(request) if request.get("task") else run_request(request)
    except Exception as e:
        Path(result_path).write_text(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
