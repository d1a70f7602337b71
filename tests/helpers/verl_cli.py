"""verl's command lines run in this process, their expected Megatron output, and a fake Hugging Face Hub
(test_verl_*.py, test_watch.py)."""

from __future__ import annotations

import base64
import http.server
import json
import threading
from pathlib import Path

import pytest

from distmerge.front.cli import main as distmerge_main
from tests.conftest import load_reference, reference_dir


def run(*args: object) -> int:
    return distmerge_main([str(a) for a in args])


def expected_megatron(ckpt: Path):
    ref = load_reference(ckpt)
    config = json.loads((reference_dir(ckpt) / "huggingface" / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        ref.pop("lm_head.weight", None)
    return ref


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers what HfApi.create_repo and upload_folder ask (every file 'regular': sent inline in the commit)
    and records the requests."""

    requests: list[tuple[str, str, bytes]] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(("POST", self.path, body))
        host = self.headers["Host"]
        if self.path == "/api/repos/create":
            asked = json.loads(body)
            answer = {"url": f"http://{host}/{asked.get('organization')}/{asked['name']}"}
        elif "/preupload/" in self.path:
            answer = {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                for f in json.loads(body)["files"]]}
        elif "/commit/" in self.path:
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            answer = {"commitUrl": f"http://{host}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40}
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.requests.append(("GET", self.path, b""))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch, tmp_path):
    FakeHub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    yield FakeHub.requests
    server.shutdown()
    server.server_close()


def committed_files(requests) -> dict[str, bytes]:
    (body,) = [b for method, path, b in requests if "/commit/" in path]
    lines = [json.loads(line) for line in body.decode().splitlines()]
    return {v["value"]["path"]: base64.b64decode(v["value"]["content"]) for v in lines if v["key"] == "file"}
