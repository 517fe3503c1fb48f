"""Waiting for a started OpenAI-compatible server (the serving tests and benchmark start `attnslim serve`)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request

from attnslim.errors import AttnslimError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    """Poll `url` (a /health endpoint) until it answers 200; an error if `proc` exits or `timeout` s pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AttnslimError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AttnslimError(f"the server was not ready within {timeout:.0f} s")
