"""The CPUs a process may use (specdec.cpus): its affinity mask, capped by its cgroup's CPU quota, which sizes a
worker's threads in `specdec serve` and `specdec worker`."""

import os
import subprocess
import sys

import pytest

from specdec.cpus import cgroup_cpu_quota, usable_cpus


def fake_root(tmp_path, cgroup: str, files: dict[str, str]):
    """A /proc/self/cgroup of `cgroup` and the cgroup files `files` (path under /sys/fs/cgroup: text)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / "sys/fs/cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys/fs/cgroup" / path).write_text(text)
    return tmp_path


def test_a_v2_quota_caps_the_affinity_rounded_down(tmp_path):
    root = fake_root(tmp_path, "0::/pod/worker\n", {"pod/worker/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(root) == 1.5
    assert usable_cpus(root) == 1  # a 1.5-CPU share runs one thread without waits on a descheduled one


def test_an_ancestors_quota_counts_and_the_smallest_wins(tmp_path):
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod/worker\n",
        {"kubepods/pod/cpu.max": "200000 100000\n", "kubepods/pod/worker/cpu.max": "max 100000\n"},
    )
    assert cgroup_cpu_quota(root) == 2.0


def test_no_quota_leaves_the_affinity(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None
    assert usable_cpus(root) == len(os.sched_getaffinity(0))


def test_a_v1_quota_and_a_host_path_the_container_does_not_have(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names the host's path, the mount is the container's
    own cgroup."""
    root = fake_root(
        tmp_path,
        "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_quota(root) == 3.0
    root_unlimited = fake_root(
        tmp_path / "unlimited",
        "1:cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_quota(root_unlimited) is None


def test_a_share_below_one_cpu_still_gets_a_thread(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert usable_cpus(root) == 1


def test_no_cgroup_file_system_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity masks")
def test_serve_gives_each_worker_the_cpus_of_its_affinity_not_the_machines():
    """`specdec serve` under `taskset -c 0` (or docker's --cpuset-cpus) gives its worker 1 thread, however many
    CPUs the machine has (os.cpu_count() counts them all)."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from specdec.cli import build_parser; from specdec.cli.serve import worker_num_threads; "
        "print(worker_num_threads(build_parser().parse_args(['serve'])), os.cpu_count())"
    )
    threads, machine_cpus = map(int, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert threads == 1, f"one CPU in the mask, {machine_cpus} on the machine"
