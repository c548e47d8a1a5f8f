"""What a finished run shows: the report (report.py) with its tables, plots, model comparison and stage gains, and
the model registry (registry.py). May import flows.plan, flows.store, flows.track."""
