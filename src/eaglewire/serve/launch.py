"""`eaglewire serve` as a child process on a free loopback port, returned once /health answers.

Benchmarks and tests that talk to a real server start it here, so the port choice, the wait and
what happens when the server dies before it answers live in one place.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import EaglewireError

# The console script installed beside this interpreter (the venv's); PATH may point at another installation or none.
EAGLEWIRE = str(Path(sys.executable).with_name("eaglewire"))


class ServerStartError(EaglewireError):
    """The server exited or did not answer /health in time."""


@dataclass
class LocalServer:
    process: subprocess.Popen
    url: str

    def stop(self, timeout_s: float = 60) -> str:
        """SIGTERM (a graceful drain) and wait; returns what the server printed when it was piped."""
        self.process.terminate()
        output = self.process.communicate(timeout=timeout_s)[0]
        return output or ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(options: Sequence[str], *, threads: int | None = None, keep_output: bool = False,
           timeout_s: float = 180) -> LocalServer:
    """Start ``eaglewire serve --port P *options``.

    ``threads`` sets the server's OMP_NUM_THREADS. ``keep_output`` pipes its output for ``stop()`` to
    return (keep logging sparse then: an unread pipe that fills blocks the server).
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads is not None else None
    output = subprocess.PIPE if keep_output else subprocess.DEVNULL
    process = subprocess.Popen([EAGLEWIRE, "serve", "--port", str(port), *options], stdout=output,
                               stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            printed = process.stdout.read() if keep_output else "(output not kept)"
            raise ServerStartError(f"eaglewire serve {' '.join(options)} exited with {process.returncode}:\n{printed}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return LocalServer(process, url)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.3)
    process.kill()
    process.communicate()
    raise ServerStartError(f"eaglewire serve {' '.join(options)} did not answer /health within {timeout_s:.0f} s")
