"""This process's memory as Linux counts it, with an accelerator's mapped memory told apart
from host RAM (what `stellax check` reports, and what its threads release memory by)."""

from __future__ import annotations

#: Mappings that are an accelerator's memory or registers seen through the PCI
#: bus, not host RAM: on a TPU v5e the runtime maps two 4 GiB windows of the
#: chip (``anon_inode:[vfio-device]``), and Linux counts them in RSS.
DEVICE_MAPPINGS = ("anon_inode:[vfio-device]", "/dev/")


def device_mapped_bytes(smaps: str = "/proc/self/smaps") -> int | None:
    """Resident bytes of this process's device mappings (`DEVICE_MAPPINGS`), from /proc/self/smaps."""
    try:
        total, device = 0, False
        with open(smaps) as f:
            for line in f:
                head = line.split(None, 6)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    device = len(head) > 5 and head[5].strip().startswith(DEVICE_MAPPINGS)
                elif device and head and head[0] == "Rss:":
                    total += int(head[1]) * 1024
        return total
    except (OSError, ValueError, IndexError):
        return None


def _proc_status() -> dict[str, str]:
    """``/proc/self/status`` as ``{field: value text}`` (raises OSError off Linux)."""
    with open("/proc/self/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def host_memory() -> dict:
    """This process's memory in bytes: ``peak_rss`` (the most it held) and ``rss``
    now, as Linux counts them; ``device_mapped``, the part of ``rss`` that is an
    accelerator's memory mapped into the process (`DEVICE_MAPPINGS`); and
    ``peak_host``, the peak less those mappings (which are mapped at start-up and
    stay): the host RAM the run needed. Where the kernel reports them, ``rss``
    split into ``anonymous`` / ``file`` / ``shared`` too. Linux only; empty elsewhere."""
    out: dict = {}
    try:
        import resource

        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        fields = _proc_status()
        for key, name in (("VmRSS", "rss"), ("RssAnon", "anonymous"), ("RssFile", "file"), ("RssShmem", "shared")):
            if key in fields:
                out[name] = int(fields[key].split()[0]) * 1024
    except (OSError, ImportError, ValueError):
        return out
    device = device_mapped_bytes()
    if device is not None:
        out["device_mapped"] = device
        out["peak_host"] = max(0, out["peak_rss"] - device)
    return out


def rss_now() -> int | None:
    """This process's resident bytes now (``VmRSS``; Linux only, else None)."""
    try:
        return int(_proc_status()["VmRSS"].split()[0]) * 1024
    except (OSError, ValueError, KeyError):
        return None


def host_bytes_now() -> int | None:
    """This process's host memory now (bytes): its RSS less the accelerator's memory mapped
    into it (`host_memory`); None where Linux's figures cannot be read."""
    memory = host_memory()
    if "rss" not in memory:
        return None
    return memory["rss"] - memory.get("device_mapped", 0)
