"""Where things live and the servers a home runs: settings read from the environment (settings.py), the local
Prefect and MLflow servers (servers.py, prefect_server.py), processes and ports on this machine (processes.py).
Imports nothing else of flows/ and neither Prefect nor MLflow at import time."""
