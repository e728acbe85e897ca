"""Accelerator jobs as the rules see them: the cgroup of each process on an accelerator (the
runqlat and netio probes label their series with the same cgroup v2 path)."""

from __future__ import annotations


def parse_cgroup_v2(text: str) -> str:
    """/proc/PID/cgroup text -> the cgroup v2 path ("0::/a/b" -> "/a/b"; "" when there is none)."""
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            return path.strip()
    return ""


def job_cgroups(processes: dict[int, set[str]], procfs: str) -> dict[tuple[str, str], list[int]]:
    """(device, cgroup) -> the pids of that cgroup on that device (processes that ended are left out)."""
    out: dict[tuple[str, str], list[int]] = {}
    for pid, devices in processes.items():
        try:
            with open(f"{procfs}/{pid}/cgroup") as f:
                cgroup = parse_cgroup_v2(f.read())
        except OSError:
            continue
        if not cgroup:
            continue
        for device in devices:
            out.setdefault((device, cgroup), []).append(pid)
    return out
