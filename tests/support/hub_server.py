"""A real Hub-compatible HTTP server on loopback for the tests: olah, offline, serving local git repos.

olah (PyPI) answers the Hub's download API (``/{org}/{name}/resolve/{revision}/{file}``,
``/api/models/...``) from git repositories under its ``mirrors-path``, laid out as
``<mirrors>/models/<org>/<name>``. In offline mode it never contacts huggingface.co.
Its access log (uvicorn's, on stdout) lets a test count the requests a load made.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

_REQUEST = re.compile(r'"(GET|HEAD|POST|PUT|DELETE) (\S+) HTTP/[\d.]+"')
_GIT = ["git", "-c", "user.name=xpupack tests", "-c", "user.email=tests@localhost", "-c", "commit.gpgsign=false"]


class OlahHub:
    """One olah process on 127.0.0.1 and the git repos it serves."""

    def __init__(self, root: Path):
        self.root = root
        self.mirrors = root / "mirrors"
        self.log = root / "olah.out"
        self.process: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self, timeout: float = 60.0) -> str | None:
        """Starts olah and waits until it answers; returns why it could not, or None."""
        try:
            import olah  # noqa: F401
        except ImportError:
            return "olah is not installed (pip install -e '.[test]')"
        if shutil.which("git") is None:
            return "git is not installed"
        self.mirrors.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        config = self.root / "olah.toml"
        config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {port}\n"
            f'repos-path = "{self.root / "olah-cache"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            # answer every branch lookup from the git repos as they are now
            "metadata-cache-ttl = 0\n"
            "\n[accessibility]\n"
            "offline = true\n"
        )
        self.endpoint = f"http://127.0.0.1:{port}"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "olah.server", "--config", str(config), "--log-path", str(self.root / "logs")],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"olah exited with {self.process.returncode}:\n{self.log.read_text()[-2000:]}"
            if self._answers():
                return None
            time.sleep(0.2)
        self.stop()
        return f"olah did not answer on {self.endpoint} within {timeout:.0f} s:\n{self.log.read_text()[-2000:]}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def publish(
        self,
        package: Path | None,
        repo_id: str,
        *,
        branch: str = "main",
        extra: dict[str, bytes] | None = None,
        message: str = "upload",
    ) -> str:
        """Commits ``package``'s files (plus ``extra``) as the whole tree of ``branch``; returns the commit hash."""
        repo = self.mirrors / "models" / repo_id
        if not (repo / ".git").is_dir():
            repo.mkdir(parents=True)
            _git(repo, "init", "-q", "-b", "main")
        elif branch != _git(repo, "branch", "--show-current"):
            _git(repo, "checkout", "-q", "-B", branch)
        for item in repo.iterdir():
            if item.is_dir() and item.name != ".git":
                shutil.rmtree(item)
            elif item.is_file():
                item.unlink()
        if package is not None:
            shutil.copytree(package, repo, dirs_exist_ok=True)
        for name, data in (extra or {}).items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes(data)
        # staged from the files' bytes: git takes a file as unchanged when its size, inode and stat times (whole
        # seconds) match its index entry, and a package copied over one of the same shapes built within the same
        # second (copytree keeps the mtimes, the freed inode is reused) was committed with the old bytes
        (repo / ".git" / "index").unlink(missing_ok=True)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", message)
        return _git(repo, "rev-parse", "HEAD")

    def tag(self, repo_id: str, name: str, commit: str) -> None:
        _git(self.mirrors / "models" / repo_id, "tag", "-f", name, commit)

    def requests(self) -> list[str]:
        """Every request served so far, as ``"METHOD /path"``, oldest first."""
        marker = f"/__xpupack_sync__/{uuid.uuid4().hex}"
        with contextlib.suppress(urllib.error.HTTPError):  # 404 is the expected answer: it only has to reach the log
            urllib.request.urlopen(self.endpoint + marker, timeout=10)
        deadline = time.monotonic() + 10
        while marker not in self.log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise AssertionError(f"olah's access log never showed {marker}")
            time.sleep(0.05)
        seen = [f"{m.group(1)} {m.group(2)}" for m in _REQUEST.finditer(self.log.read_text(errors="replace"))]
        return [request for request in seen if "/__xpupack_sync__/" not in request]

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/api/models/xpupack-tests/absent/refs", timeout=2)
        except urllib.error.HTTPError:
            return True  # any HTTP answer means the server is up
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run([*_GIT, *args], cwd=repo, capture_output=True, text=True, check=True)
    return result.stdout.strip()
