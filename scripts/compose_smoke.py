#!/usr/bin/env python3
"""Smoke test of the compose stack's settings, without a Docker engine.

Reads the chat-history service's environment from `docker-compose config`
(docker-compose.yml itself, interpolated: not a copy of it), points its
DATABASE_URL at the local Postgres instead of the `postgres` service, starts
the given binary with it, and runs append, read, stats and clear
through it. Then SIGTERM must stop it with exit code 0.

usage: scripts/compose_smoke.py target/debug/chat-history
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compose_config():
    config = subprocess.run(
        ["docker-compose", "-f", os.path.join(ROOT, "docker-compose.yml"), "config"],
        check=True,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("CHAT_HISTORY_")},
    ).stdout
    return yaml.safe_load(config)["services"]["chat-history"]


def seconds(duration):
    """`40s`, `1m30s` or a number of seconds, as compose writes them."""
    if isinstance(duration, (int, float)):
        return float(duration)
    total, number = 0.0, ""
    for char in str(duration):
        if char.isdigit() or char == ".":
            number += char
        else:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[char]
            number = ""
    return total + (float(number) if number else 0.0)


def local_database(url):
    """The compose URL with its host swapped for the local server, and the
    role and database it names created there afresh."""
    parts = urllib.parse.urlsplit(url)
    user, password, database = parts.username, parts.password, parts.path.lstrip("/")
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c"]
    subprocess.run(psql + [f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'], check=True)
    subprocess.run(
        psql
        + [
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{user}') "
            f"THEN CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'; END IF; END $$"
        ],
        check=True,
    )
    subprocess.run(psql + [f'CREATE DATABASE "{database}" OWNER "{user}"'], check=True)
    netloc = f"{user}:{password}@127.0.0.1:{parts.port or 5432}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"content-type": "application/json"} if body is not None else {}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, (json.loads(data) if data else None)


def expect(condition, what):
    if not condition:
        raise SystemExit(f"compose smoke test FAILED: {what}")
    print(f"  ok: {what}")


def main():
    binary = sys.argv[1]
    service_config = compose_config()
    environment = {name: str(value) for name, value in service_config["environment"].items()}
    grace = seconds(service_config.get("stop_grace_period", "10s"))
    timeout = seconds(environment.get("CHAT_HISTORY_REQUEST_TIMEOUT", "30s"))
    expect(grace > timeout,
           f"stop_grace_period ({grace:.0f} s) is longer than the request timeout ({timeout:.0f} s)")
    print("environment from docker-compose.yml:", ", ".join(sorted(environment)))
    environment["DATABASE_URL"] = local_database(environment["DATABASE_URL"])
    port = free_port()
    environment["CHAT_HISTORY_BIND"] = f"127.0.0.1:{port}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_HISTORY_")}
    service = subprocess.Popen([binary, "serve"], env={**base, **environment}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if call(port, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or service.poll() is not None:
                raise SystemExit("compose smoke test FAILED: the service did not become ready")
            time.sleep(0.2)
        user = "/v1/users/whatsapp%3A%2B447700900123"
        status, body = call(port, "POST", f"{user}/messages", {"messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "18°C and clear."},
        ]})
        expect(status == 201 and [m["seq"] for m in body["messages"]] == [1, 2], "append two messages")
        status, body = call(port, "GET", f"{user}/messages?limit=10&max_age=3600")
        expect(status == 200 and [m["message"]["content"] for m in body["messages"]]
               == ["What is the weather in Paris?", "18°C and clear."], "read the window back")
        status, body = call(port, "GET", user)
        expect(status == 200 and body["message_count"] == 2 and body["version"] == 1, "stats")
        status, body = call(port, "DELETE", user)
        expect(status == 200 and body == {"deleted": 2}, "clear")
        status, _ = call(port, "GET", user)
        expect(status == 404, "no history after the clear")
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            code = service.wait(timeout=15)
        except subprocess.TimeoutExpired:
            service.kill()
            raise SystemExit("compose smoke test FAILED: no exit within 15 s of SIGTERM")
    logs = service.stderr.read()
    expect(code == 0, "SIGTERM stops the service with exit code 0")
    expect('"route":"/v1/users/{user_id}/messages"' in logs, "JSON request logs name the route template")
    expect("What is the weather" not in logs and "whatsapp" not in logs,
           "no message content or user id in the logs")
    print("compose smoke test passed")


if __name__ == "__main__":
    main()
