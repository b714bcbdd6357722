"""The CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota.

`os.cpu_count()` counts the machine's CPUs, which a container need not have: `docker run --cpuset-cpus`
narrows the affinity mask, and `docker run --cpus` or a Kubernetes CPU limit sets a cgroup quota (CPU time
per period). A worker that runs more OpenMP threads than it gets CPUs spins at every barrier waiting for a
thread the kernel is not running, and its steps slow down many times over: two workers' teams on one
machine of 2 cores took ~2.2 s for a ~10 ms step (docs/benchmarks.md, "Sampling parameters and tool calls").
"""

import math
import os
import pathlib

ROOT = pathlib.Path("/")


def usable_cpus(root: pathlib.Path = ROOT) -> int:
    """The CPUs in this process's affinity mask, capped by its cgroup's CPU quota rounded down; at least 1.

    `root`: where /proc and /sys are found (a test's fake tree)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


def cgroup_cpu_quota(root: pathlib.Path = ROOT) -> float | None:
    """The CPUs' worth of time per period that this process's cgroup, or an ancestor of it, may use (the
    smallest such quota); None where none is set or no cgroup file system can be read. cgroup v2 (`cpu.max`)
    and v1 (`cpu.cfs_quota_us` over `cpu.cfs_period_us`)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: the unified hierarchy
            quotas += _quotas(root / "sys/fs/cgroup", path, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / "sys/fs/cgroup" / mount).is_dir():
                    quotas += _quotas(root / "sys/fs/cgroup" / mount, path, _v1_quota)
                    break
    return min(quotas, default=None)


def _quotas(mount: pathlib.Path, path: str, read) -> list[float]:
    """The quotas set on the cgroup at `path` under `mount` and on its ancestors. In a container without a
    cgroup namespace /proc/self/cgroup names the host's path, which the container's mount does not have:
    then the mount's own directory is the container's cgroup."""
    directory = mount / path.lstrip("/")
    if not directory.is_dir():
        directory = mount
    found = []
    while True:
        quota = read(directory)
        if quota is not None:
            found.append(quota)
        if directory == mount or mount not in directory.parents:
            return found
        directory = directory.parent


def _v2_quota(directory: pathlib.Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: pathlib.Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
