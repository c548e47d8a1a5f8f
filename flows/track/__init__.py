"""MLflow tracking with explicit run ids (tracking.py) and the runs behind a run's stage results (mlflow_runs.py).
May import flows.plan, flows.servers, flows.store."""
