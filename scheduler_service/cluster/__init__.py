"""The cluster: one engine per worker (its step loop and pipeline), the worker client, membership, placement
and moves, the watchdog. Imports the core, never the front ends or the process."""
