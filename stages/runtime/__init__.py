"""Process runtime: the lifetime guards of a run (run token, sentinel, signal handling), host-memory
tuning, and the distributed helpers (process groups, gathers, sharding checks).

May import: `schemas`, torch and the standard library; nothing else under `stages`.
"""
