"""Prometheus metrics of gpuhook: every start, the GPUs and who holds them (issue 18).

The names below are the endpoint's contract (the Grafana dashboard in packaging/grafana/ is
checked against them).
"""

from __future__ import annotations

from typing import Final

#: Every metric family the endpoint serves (histograms add _bucket, _sum and _count series).
METRICS: Final = (
    "gpuhook_container_starts_total",
    "gpuhook_refusals_total",
    "gpuhook_start_duration_seconds",
    "gpuhook_inventory_cache_total",
    "gpuhook_gpu_info",
    "gpuhook_gpu_holders",
    "gpuhook_container_gpu_info",
    "gpuhook_mig_instances",
    "gpuhook_mps_daemon_up",
    "gpuhook_container_gpu_memory_used_bytes",
)
