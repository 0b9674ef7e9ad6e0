"""A real ``octavo serve`` process on 127.0.0.1 for the server tests, and /metrics reading."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The server's packages come with `make test`'s environment; a host without a package registry
# (the GPU machine) may lack them, and then the server tests are skipped there, not failed.
for _module in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

STARTUP_TIMEOUT_S = 180  # a cold machine converts the default model first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``octavo serve`` (the default model unless args name one) in a subprocess."""

    def __init__(self, *args: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # The CPU unless args say otherwise: these tests check the CPU backend's exact, batch-invariant
        # outputs (test_cuda_engine.py runs the engine on a GPU).
        device = [] if "--device" in args else ["--device", "cpu"]
        command = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", "--port", str(self.port),
                   "--uvicorn-log-level", "warning", *device, *args]
        self._log_file = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=os.environ.copy())
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"octavo serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"octavo serve did not become healthy:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics but histogram buckets, by name; finish reasons summed under the
        plain name and also kept apart as "<name>:<reason>"."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "le" in sample.labels:
                    continue
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if "finished_reason" in sample.labels:
                    values[f"{sample.name}:{sample.labels['finished_reason']}"] = sample.value
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is referenced (or the last read)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0 \
                and m["octavo:kv_cache_used_blocks"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Sends ``sig`` and waits; the exit code (uvicorn re-raises the signal after a clean
        shutdown, so that is -sig)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
        return self.process.returncode

    def stop_cleanly(self, sig: int = signal.SIGINT) -> None:
        code = self.stop(sig)
        log = self.log.read_text()
        assert code in (0, -sig), f"exit code {code}:\n{log}"
        assert "Traceback" not in log, log
