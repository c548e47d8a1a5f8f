"""Input references of a single-stage run (`r1flow stage --input NAME=REF`, a stage deployment's `inputs`), resolved
to artifact fingerprints:
- a fingerprint or a unique prefix of one (`r1flow artifacts` lists them);
- `mlflow:<run id>[:<output>]`: an output of the stage run that MLflow run tracked;
- `latest:<node>[@<recipe>][:<output>]`: the newest output of that node: from MLflow's
  `r1flow/<recipe>` experiment when a recipe is named, else from the store's manifests.
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException

from flows.run.pipeline import experiment_name
from flows.store.artifacts import ArtifactStore
from flows.track.tracking import mlflow_client
from schemas.errors import ArtifactError

# No <...> placeholders: the Prefect UI renders descriptions as HTML and drops them.
REF_HELP = "fingerprint (or unique prefix), mlflow:RUN_ID[:OUTPUT], or latest:NODE[@RECIPE][:OUTPUT]"


def _pick_output(outputs: dict[str, str], wanted: str | None, input_name: str, where: str) -> str:
    if wanted:
        if wanted not in outputs:
            raise ArtifactError(f"{where}: no output {wanted!r}; it has {', '.join(sorted(outputs)) or 'none'}")
        return outputs[wanted]
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    if input_name in outputs:
        return outputs[input_name]
    raise ArtifactError(f"{where}: has outputs {', '.join(sorted(outputs)) or 'none'}; name one, e.g. "
                        f"{where}:{next(iter(sorted(outputs)), 'model')}")


def _run_outputs(client, run_id: str) -> dict[str, str]:
    tags = client.get_run(run_id).data.tags
    return {k.removeprefix("r1flow.output."): v for k, v in tags.items() if k.startswith("r1flow.output.")}


def resolve_ref(ref: str, input_name: str, store: ArtifactStore, tracking_uri: str) -> str:
    """The full fingerprint an input reference names (see the module docstring for the forms)."""
    ref = ref.strip()
    if ref.startswith("mlflow:"):
        run_id, _, out = ref.removeprefix("mlflow:").partition(":")

        try:
            outputs = _run_outputs(mlflow_client(tracking_uri), run_id)
        except MlflowException as e:
            raise ArtifactError(f"input {input_name!r}: MLflow run {run_id!r} not found at {tracking_uri}: {e}") from None
        return store.resolve_prefix(_pick_output(outputs, out or None, input_name, f"mlflow:{run_id}"))
    if ref.startswith("latest:"):
        spec, _, out = ref.removeprefix("latest:").partition(":")
        node, _, recipe = spec.partition("@")
        return _latest(node, recipe or None, out or None, input_name, store, tracking_uri)
    if not ref:
        raise ArtifactError(f"input {input_name!r}: empty reference; give a {REF_HELP}")
    return store.resolve_prefix(ref)


def _latest(node: str, recipe: str | None, out: str | None, input_name: str, store: ArtifactStore,
            tracking_uri: str) -> str:
    where = f"latest:{node}" + (f"@{recipe}" if recipe else "")
    if recipe is None:  # the store alone: the newest execution of that node, its outputs named by its cache record
        made = sorted((m for m in store.list() if m.producer.node == node), key=lambda m: m.created_at, reverse=True)
        if not made:
            raise ArtifactError(f"input {input_name!r}: {where}: no artifact in {store.uri} was produced by node {node!r}")
        for m in made:
            record = store.lookup(m.producer.cache_key)  # None if any output of that run is gone or corrupt
            if record is not None:
                return _pick_output(record.outputs, out, input_name, where)
        raise ArtifactError(f"input {input_name!r}: {where}: no complete, valid outputs of node {node!r} in {store.uri}")

    client = mlflow_client(tracking_uri)
    exp = client.get_experiment_by_name(experiment_name(recipe))
    if exp is None:
        raise ArtifactError(f"input {input_name!r}: {where}: no MLflow experiment {experiment_name(recipe)!r} "
                            f"at {tracking_uri}; has recipe {recipe!r} run there?")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`r1flow.node` = '{node}'",
                              order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        outputs = _run_outputs(client, run.info.run_id)
        if outputs:
            fp = _pick_output(outputs, out, input_name, where)
            if store.is_valid(fp):
                return fp
    raise ArtifactError(f"input {input_name!r}: {where}: no run of node {node!r} with outputs still in the store")
