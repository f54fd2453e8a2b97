"""How much RAM this process can still take: the CPU engine's KV cache takes a share of it (llm_engine).

psutil's ``available`` where installed, else Linux's MemAvailable (free plus reclaimable page cache); bounded by the
least room under a cgroup v2 ``memory.max`` of this process's cgroup and its parents (a container's, a Slurm job's),
whose reclaimable page cache counts as room as MemAvailable counts it. cgroup v1 limits are not read.
"""

from __future__ import annotations

from pathlib import Path


def available_ram() -> int | None:
    """Bytes of RAM a process can still take: psutil's ``available`` where installed, else Linux's MemAvailable (free
    plus reclaimable page cache), bounded by a cgroup v2 limit (a container's); None when unknown."""
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        avail = _meminfo_available()
    room = _cgroup_room()
    return avail if room is None else room if avail is None else min(avail, room)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """The least room under a cgroup v2 ``memory.max`` of this process's cgroup and of its parents (a container's, a
    Slurm job's), None without a limit: MemAvailable is the whole machine's. A limit may sit on a parent only (a Slurm
    job's, over the step's own cgroup of "max"): the leaf alone read none, and the host's MemAvailable was taken."""
    mount = Path("/sys/fs/cgroup")
    try:
        rel = next(line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    level, rooms = mount / rel.lstrip("/"), []
    while True:
        room = _cgroup_level_room(level)
        if room is not None:
            rooms.append(room)
        if level == mount or mount not in level.parents:
            return min(rooms, default=None)
        level = level.parent


def _cgroup_level_room(level: Path) -> int | None:
    """``memory.max`` less what the cgroup holds and cannot give back, None without a limit (the root has no file).
    Its ``memory.current`` counts the page cache its reads and writes left, which the kernel reclaims and which fills
    up to the limit over a long job (a Slurm job's earlier stages, a container's model downloads): taken as used, it
    left a CPU engine "no memory left for the KV cache" that the flat 1 GiB of before had (MemAvailable counts it free)."""
    try:
        limit = (level / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((level / "memory.current").read_text())
        limit = int(limit)
    except (OSError, ValueError):
        return None
    return max(limit - max(used - _cgroup_page_cache(level), 0), 0)


def _cgroup_page_cache(level: Path) -> int:
    """Bytes of page cache on the cgroup's reclaim lists: ``memory.stat``'s active_file + inactive_file (tmpfs pages
    sit on the anon lists: not counted); 0 where unread."""
    try:
        stat = dict(line.split() for line in (level / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        return int(stat.get("active_file", 0)) + int(stat.get("inactive_file", 0))
    except (OSError, ValueError):
        return 0
