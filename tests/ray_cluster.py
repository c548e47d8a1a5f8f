"""The loopback Ray cluster of the tests: it lives in benchmarks/loopback_cluster.py, which the throughput
benchmark shares (benchmarks/ may not import tests/); re-exported here under the names the tests use."""

from benchmarks.loopback_cluster import (  # noqa: F401
    R1FLOW_VARIABLES,
    RAY,
    STOP_GRACE_S,
    VENV_BIN,
    LoopbackCluster,
    RayNode,
    netns_available,
    ray_installed,
)
