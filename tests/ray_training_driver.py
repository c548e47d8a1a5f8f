"""A Ray driver for tests/test_ray_training.py: run one stage through `launch.run_stage` and write what it logged.

    python tests/ray_training_driver.py REQUEST.json RESULT.json

REQUEST: {"module": "stages.sft", "config": {...}, "inputs": {name: launch._input_spec(...)}, "root": DIR,
"seed": 0}. The stage runs with a LocalContext rooted at DIR (its checkpoints, outputs and the multi-node
work directory go there). RESULT: {"metrics": [[step, {...}], ...], "params": {...}, "outputs": {name: path}}
or, when the stage raised, {"error": type, "message": str}. Started inside the cluster's network namespace
with RAY_ADDRESS set (tests/ray_cluster.py), so `run_stage` connects to the cluster itself.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.base import LocalContext  # noqa: E402
from stages.training import launch  # noqa: E402


def main(request_path: str, result_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = json.loads(Path(request_path).read_text())
    module = importlib.import_module(request["module"])
    cfg = module.CONFIG.model_validate(request["config"])
    inputs = {name: launch._input_from(spec) for name, spec in request["inputs"].items()}
    ctx = LocalContext(Path(request["root"]), seed=request.get("seed", 0))
    try:
        outputs = launch.run_stage(module, cfg, inputs, ctx)
    except Exception as e:
        Path(result_path).write_text(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise
    Path(result_path).write_text(json.dumps({
        "metrics": ctx.metrics, "params": ctx.params, "outputs": {name: str(o.path) for name, o in outputs.items()},
    }, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:3])
