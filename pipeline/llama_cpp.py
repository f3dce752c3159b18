"""llama.cpp, the engine our CPU and laptop users deploy: its source, its server, started and stopped.

`make setup-server` unpacks the llama.cpp that llama-cpp-python vendors (one pinned release) into
`<venv>/llama.cpp/` and builds its C++ `llama-server` into `<venv>/bin/` (once per machine: the
build is cached under ~/.cache/specdraft/). Export's gguf/ runs that source's own converter; the
server backend's tests and `make bench-generate` serve the embedded target with that server.
SPECDRAFT_LLAMA_CPP and SPECDRAFT_LLAMA_SERVER name another source folder or binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from pipeline.errors import PipelineError
from pipeline.files import remove, temp_file

SOURCE_ENV = "SPECDRAFT_LLAMA_CPP"
SERVER_ENV = "SPECDRAFT_LLAMA_SERVER"
CONVERTER = "convert_hf_to_gguf.py"


def source() -> Optional[Path]:
    """The llama.cpp source folder whose converter we run, or None where it is not installed."""
    configured = os.environ.get(SOURCE_ENV)
    folder = Path(configured).expanduser() if configured else Path(sys.prefix) / "llama.cpp"
    return folder if (folder / CONVERTER).is_file() else None


def server_binary() -> Optional[Path]:
    """The llama-server to start: $SPECDRAFT_LLAMA_SERVER, the venv's, or one on PATH."""
    configured = os.environ.get(SERVER_ENV)
    if configured:
        path = Path(configured).expanduser()
        return path if path.is_file() else None
    ours = Path(sys.prefix) / "bin" / "llama-server"
    if ours.is_file():
        return ours
    found = shutil.which("llama-server")
    return Path(found) if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


class Server:
    """llama-server on 127.0.0.1, started on entering and always stopped on leaving:

        with Server(model_gguf, ["-c", "4096"]) as server:
            httpx.post(f"{server.url}/completions", ...)

    A server that does not start, or dies, raises with its log's last line; a port in use too."""

    def __init__(self, model: Path, args: Sequence[str] = (), port: Optional[int] = None,
                 startup_s: float = 180.0, binary: Optional[Path] = None) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise PipelineError(f"llama.cpp's llama-server is not installed: `make setup-server` builds it "
                                f"(or set {SERVER_ENV}=<a llama-server binary>)")
        if not Path(model).is_file():
            raise PipelineError(f"GGUF file {model} does not exist")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.cmd = [str(self.binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.startup_s = startup_s
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = temp_file(Path(tempfile.gettempdir()), "llama-server-", ".log")
        self.log = open(self.log_path, "w")

    def __enter__(self) -> "Server":
        import httpx

        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                raise PipelineError(f"port {self.port} on 127.0.0.1 is in use: llama-server cannot listen there")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise PipelineError(f"llama-server exited with code {self.proc.returncode} before it served: "
                                        f"{last_line(self.read_log())}")
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise PipelineError(f"llama-server did not answer within {self.startup_s:.0f}s: "
                                        f"{last_line(self.read_log())}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        remove(self.log_path)
