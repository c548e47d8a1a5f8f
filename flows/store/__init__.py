"""The content-addressed artifact store (artifacts.py), cache keys and records (cache.py), leases across machines
(lease.py). May import flows.servers."""
