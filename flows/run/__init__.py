"""Running plans: the Prefect flow and stage tasks (pipeline.py), the context a stage gets (context.py), where
stages run (placement.py, reach.py), cleanup of killed runs (reclaim.py), servers watched during a run
(watchdog.py), deployments, single-stage runs and workers (deploy.py, refs.py, worker.py). May import every
package of flows/ but flows.cli."""
