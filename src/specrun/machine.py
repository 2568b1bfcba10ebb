"""What this machine and build are, for `specrun info` and the records `specrun bench` writes."""

from __future__ import annotations

import os
import platform
from typing import Any

from specrun import __version__
from specrun.llama.backend import cpu_name, llama_cpp_version, physical_cores, system_info
from specrun.models.memory import host_memory


def machine_info() -> dict[str, Any]:
    """The CPU, cores, memory, platform, versions and llama.cpp's own system line."""
    mem = host_memory()
    return {
        "cpu": cpu_name(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "default_threads": physical_cores(),
        "ram_total": mem.total,
        "ram_available": mem.available,
        "swap_free": mem.swap_free,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "specrun": __version__,
        "llama_cpp_python": llama_cpp_version(),
        "llama_cpp_system_info": system_info(),
    }
