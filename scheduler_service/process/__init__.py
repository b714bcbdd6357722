"""The scheduler process: flags, wiring (main), Prometheus metrics and the stats line, which read the cluster's
snapshots. Nothing below imports it."""
