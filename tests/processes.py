"""Test code run in a process of its own, as the only rank of a gloo process group: FSDP2 needs
an initialised group, and one made inside the test process would outlive the test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: Launch variables a parent run (Lightning's, torchrun's) may have set, which would make the
#: child join that group instead of its own.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")


def run_in_a_gloo_group_of_one(body: str, port: int) -> None:
    """Run ``body`` (Python source; ``torch``, ``dist`` and ``nn`` imported) as rank 0 of a
    one-process gloo group on ``port``; fail with its stderr if it fails."""
    code = "\n".join(
        [
            "import os, torch, torch.distributed as dist",
            "from torch import nn",
            f'os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")',
            'dist.init_process_group("gloo", rank=0, world_size=1)',
            textwrap.dedent(body),
            "dist.destroy_process_group()",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]


def run_script(script: str, *args: str, timeout: int = 600) -> None:
    """Run ``tests/scripts/<script>`` with ``args`` in a process of its own (which may start
    its own process group); fail with its stderr if it fails."""
    path = os.path.join(os.path.dirname(__file__), "scripts", script)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    completed = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
