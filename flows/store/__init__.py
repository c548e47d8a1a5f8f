"""The content-addressed artifact store (artifacts.py), cache keys and records (cache.py), leases across machines
(lease.py), an artifact's ancestor datasets (lineage.py). May import flows.servers."""
