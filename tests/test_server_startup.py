"""The server while its engine starts: the port answers at once, /health says 503 "starting" until the engine
is ready, then 200; an engine that cannot start ends the process with one line and exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), OMP_NUM_THREADS="1")


def _request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_says_starting_until_the_engine_is_ready(tmp_path):
    gate = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "slow_start_server.py"), str(gate)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), (line, proc.poll())
        url = f"http://127.0.0.1:{line.split()[1]}"
        deadline = time.monotonic() + 60
        while True:  # listening comes a moment after the bind: the engine is held at the gate meanwhile
            try:
                status, body = _request(url + "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert (status, body) == (503, {"status": "starting"})
        status, body = _request(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 503 and "starting" in body["error"]["message"]
        gate.touch()  # the engine may start now
        deadline = time.monotonic() + 180
        while (status := _request(url + "/health")[0]) != 200:
            assert status == 503 and time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        status, body = _request(url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minidsa", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=ENV)


def test_a_model_that_does_not_exist_fails_in_one_line_before_listening(tmp_path):
    r = _serve("--model", str(tmp_path / "no-such-checkpoint"))
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "no-such-checkpoint" in lines[0], r.stderr


def test_an_engine_that_fails_while_listening_exits_2_with_its_error_last(tmp_path):
    r = _serve("--device", "cpu", "--max-total-tokens", "4096", "--max-model-len", "100000")
    assert r.returncode == 2, r.stderr
    assert "listening on" in r.stderr  # it failed after the port was up
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("minidsa serve: error:") and "max_model_len" in last, r.stderr
    assert "Traceback" not in r.stderr
