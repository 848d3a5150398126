"""Integration-test support for gpuhook (simulated hosts, harnesses)."""
