"""Which machine and software produced a measurement, recorded beside every figure we write."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    """Platform, core count, Python/torch/CUDA versions, GPU name, and the current git commit.

    The commit is that of the working directory's repository ("unknown" outside one), so a
    figure can be traced to the code that made it; ``LIGHTNING_TBP_COMMIT`` overrides it (a copy
    of the working tree on a lent GPU carries a stale git folder).
    """
    try:
        commit = (
            os.environ.get("LIGHTNING_TBP_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": commit,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
