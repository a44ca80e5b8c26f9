#!/usr/bin/env python3
"""Hostile-caller attacks against a chat-history binary.

Plays, against a real `BINARY serve` process on 127.0.0.1, the attacks that
SPEC.md's "Limits that protect every caller" and "Configuration" sections
say one caller (or one odd environment) must not win: metrics label
explosion, slow and idle connections, connection floods, huge transcripts,
number-heavy bodies, readers that never read, Kubernetes and non-UTF-8 environments, variables the
libraries underneath read (tokio's, libpq's), absurd caps and
passwords leaking into logs. Each attack prints a figure and checks it
against what the fixed service must do.

    python3 tests/hostile/attacks.py BINARY [--backend sqlite|postgres|both]
                                            [--only NAME ...] [--no-check] [--legacy]

--backend   where the attacks that touch the database run (default: both).
            Postgres must answer on 127.0.0.1:5432 as user `postgres` with
            trust auth; every run gets a fresh database, dropped afterwards.
--only      run only the named attacks (see ATTACKS at the bottom).
--no-check  print the figures and verdicts, but exit 0 whatever they say.
            It also lets transcript-read-rss and number-bodies-rss run without
            a setting the binary refuses, so an old binary still gets measured.
--legacy    never pass settings that only the fixed service knows
            (CHAT_HISTORY_HEADER_TIMEOUT, _MAX_CONNECTIONS,
            _MAX_IN_FLIGHT_BODY_BYTES): measures an old binary everywhere.

Standard library only. Nothing is sent anywhere but 127.0.0.1. Exit status:
1 if any check failed (unless --no-check), else 0.
"""

import argparse
import http.client
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PG_HOST, PG_PORT, PG_USER = "127.0.0.1", 5432, "postgres"
MIB = 1024 * 1024

# Settings that only the fixed service understands (an old binary exits 2).
NEW_SETTINGS = (
    "CHAT_HISTORY_HEADER_TIMEOUT",
    "CHAT_HISTORY_MAX_CONNECTIONS",
    "CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES",
)


# --------------------------------------------------------------------------
# Plumbing: processes, databases, HTTP, RSS
# --------------------------------------------------------------------------


class NotStarted(Exception):
    """The server exited (or never became ready): the attack could not run."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(text, width=150):
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:width]
    return "(no output)"


def base_env():
    """The caller's environment minus anything that would configure the service."""
    return {
        k: v
        for k, v in os.environb.items()
        if not k.startswith(b"CHAT_HISTORY_") and k not in (b"DATABASE_URL", b"RUST_LOG")
    }


def as_bytes(x):
    return x if isinstance(x, bytes) else os.fsencode(str(x))


class Process:
    """A child process of BINARY, its stdout/stderr in temporary files (no pipe
    can fill up and stall it, even at RUST_LOG=debug)."""

    live = set()  # every process not yet reaped, killed at exit whatever happens
    live_lock = threading.Lock()

    def __init__(self, binary, args, env):
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()
        full = base_env()
        full.update({as_bytes(k): as_bytes(v) for k, v in env.items()})
        self.proc = subprocess.Popen(
            [binary, *args], env=full, stdin=subprocess.DEVNULL,
            stdout=self.out, stderr=self.err,
        )
        self.pid = self.proc.pid
        with Process.live_lock:
            Process.live.add(self)

    def _read(self, f):
        f.flush()
        f.seek(0)
        return f.read().decode("utf-8", "replace")

    def stdout(self):
        return self._read(self.out)

    def stderr(self):
        return self._read(self.err)

    def exited(self):
        return self.proc.poll() is not None

    def stop(self, grace=10.0):
        """SIGTERM, then SIGKILL after `grace` seconds. Returns the exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        with Process.live_lock:
            Process.live.discard(self)
        return self.proc.returncode

    @classmethod
    def kill_all(cls):
        with cls.live_lock:
            procs = list(cls.live)
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
            cls.live.discard(p)


class Server(Process):
    """`BINARY serve` on a free loopback port."""

    def __init__(self, binary, env):
        self.port = free_port()
        env = {
            "CHAT_HISTORY_BIND": f"127.0.0.1:{self.port}",
            "CHAT_HISTORY_LOG_FORMAT": "json",
            "RUST_LOG": "warn",
            **env,
        }
        super().__init__(binary, ["serve"], env)

    def wait_ready(self, timeout=60.0):
        """Polls /readyz until 200. Raises NotStarted if the process exits or
        the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exited():
                raise NotStarted(f"did not start (exit {self.proc.returncode}): "
                                 f"{first_line(self.stderr(), 90)}")
            try:
                if http_request(self.port, "GET", "/readyz", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise NotStarted(f"not ready within {timeout:.0f} s: {first_line(self.stderr())}")

    def rss_kb(self):
        """(RssAnon, VmRSS) in KiB: the memory the process holds of its own,
        and that plus the file pages it maps (its binary; on SQLite the
        database file, which each connection maps: the OS's page cache,
        shared, counted once per mapping, and dropped under pressure)."""
        anon = total = 0
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        anon = int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        total = int(line.split()[1])
        except OSError:
            pass
        return anon, total


class RssPeak:
    """Samples the server's RSS every 20 ms in a thread. `growth_mb` is the
    peak of its own memory (RssAnon) during the `with` block minus the value
    just before it, which is what a caller could exhaust; `text` says that
    and the growth of VmRSS, which also counts mapped file pages."""

    def __init__(self, server):
        self.server = server
        self.baseline = self.peak = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _take(self):
        anon, total = self.server.rss_kb()
        self.peak = (max(self.peak[0], anon), max(self.peak[1], total))

    def _sample(self):
        while not self._stop.is_set():
            self._take()
            time.sleep(0.02)

    def __enter__(self):
        self.baseline = self.peak = self.server.rss_kb()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()

    @property
    def growth_mb(self):
        return (self.peak[0] - self.baseline[0]) / 1024

    @property
    def text(self):
        total = (self.peak[1] - self.baseline[1]) / 1024
        return f"peak RSS +{self.growth_mb:.0f} MB (VmRSS +{total:.0f})"


def http_request(port, method, path, body=None, headers=None, timeout=60.0):
    """One request on its own connection: (status, {lowercased header: value}, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        try:
            conn.request(method, path, body=body, headers=headers or {})
        except (BrokenPipeError, ConnectionResetError):
            if body is None:
                raise
            # The server may answer (413, 503) before reading the whole body:
            # its answer, if it sent one, is what counts.
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def json_headers():
    return {"Content-Type": "application/json"}


def is_problem(headers, body):
    """True if the response is an RFC 9457 problem+json with a detail."""
    if not headers.get("content-type", "").startswith("application/problem+json"):
        return False
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def psql(sql):
    r = subprocess.run(
        ["psql", "-h", PG_HOST, "-p", str(PG_PORT), "-U", PG_USER, "-d", "postgres",
         "-v", "ON_ERROR_STOP=1", "-q", "-c", sql],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PGCONNECT_TIMEOUT": "10"},
    )
    if r.returncode != 0:
        raise RuntimeError(f"psql failed: {first_line(r.stderr)}")


class Run:
    """One attack on one backend: owns its servers, databases and temporary
    directories, and releases them all in `cleanup` (also called by the
    watchdog when the attack overruns its time limit)."""

    counter = 0

    def __init__(self, opts, backend):
        self.opts, self.backend, self.binary = opts, backend, opts.binary
        self.processes, self.databases, self.tmpdirs = [], [], []
        self.notes = []  # e.g. settings left out for an old binary
        self._lock = threading.Lock()
        self._closed = False

    def database_url(self):
        """A fresh, empty database on this run's backend."""
        with self._lock:
            self._check_open()
            Run.counter += 1
            n = Run.counter
        if self.backend == "postgres":
            name = f"chat_hostile_{os.getpid()}_{n}_{random.randrange(1 << 30)}"
            psql(f"CREATE DATABASE {name}")
            self.databases.append(name)
            return f"postgres://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
        tmp = tempfile.TemporaryDirectory(prefix="chat-hostile-")
        self.tmpdirs.append(tmp)
        return f"sqlite://{tmp.name}/x.db"

    def _check_open(self):
        # A timed-out attack thread may still be running: it must not start
        # new processes once its run was cleaned up.
        if self._closed:
            raise RuntimeError("run already cleaned up")

    def spawn(self, args, env):
        self._check_open()
        p = Process(self.binary, args, env)
        self.processes.append(p)
        return p

    def server(self, env=None, new=None, fallback=False, ready=True, database=True):
        """Starts `BINARY serve` with `env` plus the `new` settings, and waits
        for /readyz. `new` settings are left out under --legacy, or (with
        `fallback` and --no-check) when the binary refuses one of them."""
        env = dict(env or {})
        new = dict(new or {})
        if self.opts.legacy and new:
            self.notes.append("legacy: without " + ", ".join(new))
            new = {}
        if database and "DATABASE_URL" not in env:
            env["DATABASE_URL"] = self.database_url()
        self._check_open()
        s = Server(self.binary, {**env, **new})
        self.processes.append(s)
        if not ready:
            return s
        try:
            s.wait_ready()
        except NotStarted:
            refused = [k for k in new if k in s.stderr()]
            if not (fallback and self.opts.no_check and refused):
                raise
            s.stop()
            self.notes.append(f"without {', '.join(new)}: refused by this binary")
            self._check_open()
            s = Server(self.binary, env)
            self.processes.append(s)
            s.wait_ready()
        return s

    def cleanup(self, grace=10.0):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for p in self.processes:
            try:
                p.stop(grace)
            except Exception:
                pass
        for name in self.databases:
            try:
                psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            except Exception as e:
                print(f"  warning: could not drop database {name}: {e}", file=sys.stderr)
        for tmp in self.tmpdirs:
            tmp.cleanup()


class Result:
    def __init__(self, figure, ok):
        self.figure, self.ok = figure, ok


# --------------------------------------------------------------------------
# The attacks. Each takes a Run and returns a Result (figure, check passed).
# --------------------------------------------------------------------------


def sample_lines(port):
    status, _, body = http_request(port, "GET", "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return [l for l in body.decode().splitlines() if l.strip() and not l.startswith("#")]


def read_response(sock):
    """Reads one HTTP/1.1 response (head and body, by Content-Length or
    chunked) and returns it raw; stops early if the server closes."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        c = sock.recv(65536)
        if not c:
            return buf
        buf += c
    head, _, rest = buf.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    chunked = re.search(rb"(?im)^transfer-encoding:.*chunked", head)

    def complete():
        return rest.endswith(b"0\r\n\r\n") if chunked else len(rest) >= (int(m.group(1)) if m else 0)

    while not complete():
        c = sock.recv(65536)
        if not c:
            break
        rest += c
    return head + b"\r\n\r\n" + rest


def raw_exchange(port, data, timeout=5.0):
    """Sends raw bytes on a new connection and returns one raw response
    (b"" if the server closed or reset without answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        try:
            return read_response(s)
        except (socket.timeout, ConnectionError):
            return b""


def attack_metrics_labels(run):
    """Invented methods and unknown paths must not mint new metric series:
    labels come from closed sets (known methods or `other`, route templates)."""
    srv = run.server()
    # Prime: one invented method, one unknown path and one /metrics scrape may
    # each add their closed-set series (`other`, the unmatched route); what
    # must not happen is a new series per distinct method or path.
    raw_exchange(srv.port, b"XPRIME /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    http_request(srv.port, "GET", "/nope/prime", timeout=10)
    sample_lines(srv.port)
    before = len(sample_lines(srv.port))
    for i in range(150):
        raw_exchange(srv.port, f"XMETHOD{i} /healthz HTTP/1.1\r\nHost: x\r\n"
                               f"Connection: close\r\n\r\n".encode())
    for _ in range(150):
        http_request(srv.port, "GET", f"/nope/{random.getrandbits(64):016x}", timeout=10)
    after = len(sample_lines(srv.port))
    return Result(f"series {before} -> {after} (+{after - before})", after - before <= 20)


def seconds_until_closed(sock, limit):
    """Reads (and discards) until the server closes; None if it never does
    within `limit` seconds."""
    start = time.monotonic()
    while True:
        left = limit - (time.monotonic() - start)
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except socket.timeout:
            return None
        except OSError:  # reset counts as closed
            return time.monotonic() - start


def fmt_closed(t, limit=70):
    return f">{limit} s (never closed)" if t is None else f"closed after {t:.1f} s"


def attack_half_head(run):
    """A head that never ends must not hold a connection (slowloris)."""
    srv = run.server(new={"CHAT_HISTORY_HEADER_TIMEOUT": "2s"})
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no final blank line
        t = seconds_until_closed(s, 70)
    return Result(fmt_closed(t), t is not None and t <= 6)


def attack_idle_keepalive(run):
    """An idle keep-alive connection must be closed, not kept forever."""
    srv = run.server(new={"CHAT_HISTORY_HEADER_TIMEOUT": "2s"})
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        response = read_response(s)
        if not response.startswith(b"HTTP/1.1 200"):
            return Result(f"first response: {first_line(response.decode('latin-1')) or 'none'}", False)
        t = seconds_until_closed(s, 70)
    return Result(fmt_closed(t), t is not None and t <= 6)


def attack_connection_cap(run):
    """Over the connection cap a caller gets a quick 503 with Retry-After,
    not an unbounded queue; the cap frees up when connections close."""
    srv = run.server(new={"CHAT_HISTORY_MAX_CONNECTIONS": "20"})
    idle = []
    try:
        # The server may not yet have seen the readiness probe's close when
        # the first of these arrive, so one of them can be refused for the
        # probe's sake: replace any that was answered until 20 are held.
        for _ in range(5):
            answered = set(select.select(idle, [], [], 0)[0])
            for s in answered:
                s.close()
            idle = [s for s in idle if s not in answered]
            while len(idle) < 20:
                idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
            time.sleep(0.5)  # let the server accept (or refuse) all of them
            if not any(select.select(idle, [], [], 0)[0]):
                break
        start = time.monotonic()
        try:
            raw = raw_exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                         b"Connection: close\r\n\r\n", timeout=10)
        except OSError as e:
            raw = b""
            err = f"{type(e).__name__}"
        else:
            err = "no response"
        elapsed = time.monotonic() - start
    finally:
        for s in idle:
            s.close()
    if not raw:
        return Result(f"21st: {err} after {elapsed:.1f} s", False)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    good_503 = (status == 503 and "retry-after" in headers and is_problem(headers, body)
                and elapsed < 2)
    # With the 20 gone, service must come back.
    after = None
    for _ in range(30):
        try:
            after = http_request(srv.port, "GET", "/healthz", timeout=5)[0]
        except OSError:
            after = None
        if after == 200:
            break
        time.sleep(0.1)
    figure = (f"21st: {status} in {elapsed:.2f} s"
              f"{' Retry-After' if 'retry-after' in headers else ''}"
              f"{' problem+json' if is_problem(headers, body) else ''}; after closing: {after}")
    return Result(figure, good_503 and after == 200)


def append_batches(port, user, batches, threads=4):
    """POSTs every body in `batches` to `user` from a few keep-alive connections."""
    todo = list(batches)
    lock = threading.Lock()
    errors = []

    def worker():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            while not errors:
                with lock:
                    if not todo:
                        return
                    body = todo.pop()
                conn.request("POST", f"/v1/users/{user}/messages", body=body, headers=json_headers())
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 201:
                    errors.append(f"append answered {resp.status}: {data[:200]!r}")
        except Exception as e:
            errors.append(f"append failed: {e!r}")
        finally:
            conn.close()

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(errors[0])


TRANSCRIPT_MESSAGES = 560_000


def attack_transcript_read_rss(run):
    """Eight readers of a 560,000-message transcript at once: each must cost
    constant memory (streamed), not a copy of the whole transcript. What is
    measured is memory, not speed: a read still streaming at the request
    timeout is cut off (as documented), and eight 19 MB reads on SQLite
    passed the default 30 s on a slow, shared host, so this server has 100 s
    (each reader reads twice, within the attack's 240 s)."""
    srv = run.server(env={"CHAT_HISTORY_MAX_BODY_BYTES": "8MiB",
                          "CHAT_HISTORY_REQUEST_TIMEOUT": "100s"})
    user = "big-transcript"
    batches = []
    for b in range(TRANSCRIPT_MESSAGES // 1000):
        msgs = ",".join(f'{{"role":"user","content":"m{b * 1000 + i}"}}' for i in range(1000))
        batches.append(f'{{"messages":[{msgs}]}}'.encode())
    t0 = time.monotonic()
    append_batches(srv.port, user, batches)
    setup = time.monotonic() - t0

    parse_lock = threading.Lock()  # parse one at a time: the client's memory is not the point
    problems, done = [], []

    def reader():
        for _ in range(2):
            try:
                status, headers, body = http_request(srv.port, "GET", f"/v1/users/{user}/transcript",
                                                     timeout=180)
                if status != 200:
                    problems.append(f"GET answered {status}: {body[:150]!r}")
                    continue
                if "etag" not in headers:
                    problems.append("no ETag")
                with parse_lock:
                    n = len(json.loads(body)["messages"])
                if n != TRANSCRIPT_MESSAGES:
                    problems.append(f"{n} messages")
                done.append(len(body))
            except Exception as e:
                problems.append(f"{type(e).__name__}: {e}")

    with RssPeak(srv) as rss:
        ts = [threading.Thread(target=reader, daemon=True) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    figure = (f"{rss.text}; {len(done)}/16 full reads"
              f" of {done[0] / MIB:.1f} MB" if done else f"{rss.text}; 0/16 reads")
    figure += f" (setup {setup:.0f} s)"
    if problems:
        figure += f"; {len(problems)} problems, e.g. {problems[0]}"
    return Result(figure, rss.growth_mb < 150 and not problems and len(done) == 16)


def attack_transcript_put_cap(run):
    """A 7 MB PUT of 560,000 tiny messages must be refused by a limit that
    names its setting, and store nothing."""
    srv = run.server()
    user = "huge-put"
    body = b'{"messages":[' + b",".join([b'{"role":"u"}'] * TRANSCRIPT_MESSAGES) + b"]}"
    with RssPeak(srv) as rss:
        try:
            status, headers, data = http_request(srv.port, "PUT", f"/v1/users/{user}/transcript",
                                                 body=body, headers=json_headers(), timeout=180)
        except OSError as e:
            status, headers, data = f"error {type(e).__name__}", {}, b""
    detail = ""
    if is_problem(headers, data):
        detail = str(json.loads(data).get("detail", ""))
    names_limit = ("CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES" in detail
                   or "max_transcript_messages" in detail)
    after, _, after_body = http_request(srv.port, "GET", f"/v1/users/{user}/transcript", timeout=180)
    stored = len(json.loads(after_body)["messages"]) if after == 200 else 0
    figure = (f"{status} ({len(body) / MIB:.1f} MB body), {rss.text}, "
              f"stored {stored}")
    if detail:
        figure += f"; detail: {detail[:100]}"
    ok = status in (413, 422) and names_limit and after == 404
    return Result(figure, ok)


NUMBERS_PER_MESSAGE = 3985  # makes a 1000-message body of about 8,000,000 bytes (< 8 MiB)


def attack_number_bodies_rss(run):
    """Bodies made of tiny numbers inflate when parsed naively; sixteen at
    once must stay within a bounded memory budget (or get 503s)."""
    srv = run.server(new={"CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES": "32MiB"}, fallback=True)
    content = b"[" + b",".join(str(1 + i % 9).encode() for i in range(NUMBERS_PER_MESSAGE)) + b"]"
    message = b'{"role":"user","content":' + content + b"}"
    body = b'{"messages":[' + b",".join([message] * 1000) + b"]}"
    assert len(body) <= 8 * MIB
    answers, stored = [], []  # stored: (user, first seq, last seq)
    lock = threading.Lock()

    def poster(i):
        user = f"numbers-{i}"
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            try:
                try:
                    conn.request("POST", f"/v1/users/{user}/messages", body=body, headers=json_headers())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server may answer before reading it all; read the answer anyway
                resp = conn.getresponse()
                data = resp.read()
                answer = (resp.status, resp.getheader("Retry-After") is not None)
                if resp.status == 201:
                    # Cheap: pull the seqs out without parsing 4 million numbers.
                    seqs = re.findall(rb'"seq":(\d+)', data)
                    with lock:
                        stored.append((user, int(seqs[0]), int(seqs[-1]), len(seqs)))
            except Exception as e:
                answer = (f"reset ({type(e).__name__})", False)
            finally:
                conn.close()
            with lock:
                answers.append(answer)

    with RssPeak(srv) as rss:
        ts = [threading.Thread(target=poster, args=(i,), daemon=True) for i in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    counts = {}
    for status, _ in answers:
        counts[status] = counts.get(status, 0) + 1
    bad_503 = sum(1 for s, ra in answers if s == 503 and not ra)
    # Every acknowledged append must be readable back, verbatim.
    unreadable = 0
    expected = json.loads(message)
    for user, first, last, n in stored:
        # 8 MB of messages is more than one page holds (CHAT_HISTORY_MAX_PAGE_BYTES,
        # 4 MiB): page on with `after` until the last, as a client would.
        ok, after = n == 1000, first - 1
        while ok and after < last:
            status, _, data = http_request(
                srv.port, "GET", f"/v1/users/{user}/messages?after={after}&limit=1000", timeout=120)
            seqs = [int(x) for x in re.findall(rb'"seq":(\d+)', data)]
            ok = status == 200 and bool(seqs) and seqs == list(range(after + 1, after + 1 + len(seqs)))
            if ok and data.count(content) != len(seqs):  # fast path failed: compare as JSON values
                ok = all(m["message"] == expected for m in json.loads(data)["messages"])
            more = data.rstrip().endswith(b'"has_more":true}')
            if ok and not more and seqs[-1] != last:
                ok = False
            after = seqs[-1] if seqs else after
        unreadable += not ok
    figure = (f"{rss.text}; "
              + ", ".join(f"{v}x {k}" for k, v in sorted(counts.items(), key=str))
              + f"; read back {len(stored) - unreadable}/{len(stored)}")
    if bad_503:
        figure += f"; {bad_503} 503 without Retry-After"
    ok = (rss.growth_mb < 300 and all(s in (201, 422, 503) for s, _ in answers)
          and not bad_503 and not unreadable)
    return Result(figure, ok)


SLOW_READERS = 300


def read_until_closed(socks, seconds):
    """Reads each of `socks` until the server closes (or resets) it, for at
    most `seconds` in all: what each received, and the set still open."""
    got = {s: b"" for s in socks}
    open_ = set(socks)
    deadline = time.monotonic() + seconds
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.5)
        for s in ready:
            try:
                chunk = s.recv(1 << 20)
            except OSError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                open_.discard(s)
    return got, open_


def attack_slow_readers_rss(run):
    """Callers that ask for a 4 MiB page and then read nothing of it must
    not pin their pages in memory: an answer over 64 KiB holds bytes of the
    in-flight body budget until it is sent (past the budget: 503), and a
    client that takes nothing of its answer for CHAT_HISTORY_REQUEST_TIMEOUT
    is disconnected, which gives its bytes back."""
    timeout = 8
    srv = run.server(env={"CHAT_HISTORY_REQUEST_TIMEOUT": f"{timeout}s"},
                     new={"CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES": "64MiB"}, fallback=True)
    message = {"role": "user", "content": "y" * (MIB - 100)}
    for user, n in (("wide", 4), ("narrow", 1)):
        for _ in range(n):
            body = json.dumps({"messages": [message if user == "wide" else {"role": "user", "content": "hi"}]})
            status = http_request(srv.port, "POST", f"/v1/users/{user}/messages", body.encode(), json_headers())[0]
            if status != 201:
                return Result(f"setup: an append answered {status}", False)
    wide = "/v1/users/wide/messages?limit=100"
    whole = len(http_request(srv.port, "GET", wide)[2])
    request = f"GET {wide} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    readers = []
    try:
        with RssPeak(srv) as rss:
            for _ in range(SLOW_READERS):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", srv.port))
                s.sendall(request)
                readers.append(s)
            time.sleep(3)  # their pages are read, and their answers stuck
            during = http_request(srv.port, "GET", "/v1/users/narrow/messages", timeout=10)[0]
        # Past the timeout every stuck reader must have been disconnected.
        time.sleep(timeout + 2)
        after_status, _, after_body = http_request(srv.port, "GET", wide, timeout=30)
        got, open_ = read_until_closed(readers, 10)
    finally:
        for s in readers:
            s.close()
    counts = {}
    for data in got.values():
        head = data.split(b"\r\n", 1)[0]
        if head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data.lower():
            kind = "503"
        elif head.startswith(b"HTTP/1.1 200"):
            kind = "200 whole" if len(data) >= whole else "200 cut off"
        else:
            kind = "other: " + head[:40].decode(errors="replace")
        counts[kind] = counts.get(kind, 0) + 1
    figure = (f"{SLOW_READERS} readers of a {whole / MIB:.0f} MiB page read nothing: {rss.text}; "
              + ", ".join(f"{v}x {k}" for k, v in sorted(counts.items()))
              + f"; still open after {timeout + 12} s: {len(open_)}; a small read meanwhile {during}"
              + f", the page after {after_status}")
    ok = (rss.growth_mb < 200 and during == 200 and after_status == 200
          and len(after_body) == whole and not open_
          and not any(k.startswith("other") for k in counts))
    return Result(figure, ok)


BIG_HEADS = 900  # under a default limit of 1,024 open files, both sides


def attack_big_heads_rss(run):
    """Callers that each send most of a large request head and then stop
    must not hold what they sent in the server's memory until the header
    timeout: past hyper's buffer (32 KiB, not its default of about 400 KiB)
    a head is answered 431 and the connection closed."""
    srv = run.server()
    head = b"GET /v1/users HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 390_000
    socks = []
    answers = {}
    try:
        with RssPeak(srv) as rss:
            for _ in range(BIG_HEADS):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                s.setblocking(False)
                try:
                    s.send(head)
                except OSError:  # closed already, or its buffer full
                    pass
                socks.append(s)
            time.sleep(3)
            during = http_request(srv.port, "GET", "/healthz", timeout=10)[0]
        got, pending = read_until_closed(socks, 5)
        for s, data in got.items():
            if s in pending:
                first = "no answer, still open"
            else:
                first = data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
            answers[first] = answers.get(first, 0) + 1
    finally:
        for s in socks:
            s.close()
    figure = (f"{BIG_HEADS} callers each sent {len(head) // 1000} KB of a head and stopped: "
              f"{rss.text}; "
              + ", ".join(f"{v}x {k}" for k, v in sorted(answers.items()))
              + f"; /healthz meanwhile {during}")
    return Result(figure, rss.growth_mb < 100 and during == 200)


def wait_start_or_exit(server, timeout):
    """'ready', or 'exit N' if the process ended first, or 'hung'."""
    try:
        server.wait_ready(timeout)
        return "ready"
    except NotStarted:
        if server.exited():
            return f"exit {server.proc.returncode}"
        return "hung"


def attack_kubernetes_env(run):
    """Kubernetes service links are ignored silently; a misspelt setting is a
    warning naming the right one, never a refusal to start."""
    srv = run.server(ready=False, env={
        "CHAT_HISTORY_SERVICE_HOST": "10.0.0.1",
        "CHAT_HISTORY_SERVICE_PORT": "8080",
        "CHAT_HISTORY_PORT": "tcp://10.0.0.1:8080",
        "CHAT_HISTORY_PORT_8080_TCP": "tcp://10.0.0.1:8080",
        "CHAT_HISTORY_PORT_8080_TCP_PROTO": "tcp",
        "CHAT_HISTORY_RETENSION": "1d",
    })
    outcome = wait_start_or_exit(srv, 15)
    srv.stop()
    err = srv.stderr()
    lines = [l for l in err.splitlines() if "CHAT_HISTORY_RETENSION" in l]
    warning = lines[0] if lines else first_line(err)
    try:  # JSON log line: show its message
        warning = json.loads(warning).get("message", warning)
    except ValueError:
        pass
    ok = (outcome == "ready" and "CHAT_HISTORY_RETENSION" in err and "CHAT_HISTORY_RETENTION" in err
          and "SERVICE_HOST" not in err and "PORT_8080" not in err)
    return Result(f"{outcome}; {warning[:140]}", ok)


def attack_non_utf8_env(run):
    """Foreign non-UTF-8 variables are none of the service's business; one of
    its own that is not UTF-8 is a clear error. Nothing panics."""
    url = run.database_url()
    parts, ok = [], True
    for label, extra in (("foreign value", {b"HOSTILE_NON_UTF8_VALUE": b"\xff\xfe\xfd"}),
                         ("foreign name", {b"HOSTILE_\xff\xfe_NAME": b"1"})):
        srv = run.server(ready=False, env={"DATABASE_URL": url, **extra})
        outcome = wait_start_or_exit(srv, 15)
        srv.stop()
        panicked = "panicked" in srv.stderr()
        parts.append(f"{label}: {outcome}{' PANIC' if panicked else ''}")
        ok &= outcome == "ready" and not panicked
    srv = run.server(ready=False, env={"DATABASE_URL": url, "CHAT_HISTORY_BIND": b"\xff\xfe"})
    try:
        code = srv.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    srv.stop()
    err = srv.stderr()
    named, panicked = "CHAT_HISTORY_BIND" in err, "panicked" in err
    parts.append(f"BIND=\\xff\\xfe: {'still running' if code is None else f'exit {code}'}"
                 f"{', names it' if named else ', does not name it'}{' PANIC' if panicked else ''}")
    ok &= code not in (None, 0) and named and not panicked
    return Result("; ".join(parts), ok)


def attack_huge_cap(run):
    """A huge number is not how to say 'unlimited' (`off` is): out of range
    stops start-up naming the setting."""
    url = run.database_url()
    huge = "18446744073709551615"
    srv = run.server(ready=False, env={"DATABASE_URL": url, "CHAT_HISTORY_MAX_MESSAGES_PER_USER": huge})
    outcome = wait_start_or_exit(srv, 10)
    if outcome == "ready":  # accepted: show what an append does with it
        try:
            st = http_request(srv.port, "POST", "/v1/users/u/messages", headers=json_headers(),
                              body=b'{"messages":[{"role":"user","content":"hi"}]}', timeout=10)[0]
        except OSError as e:
            st = type(e).__name__
        outcome = f"started (append -> {st})"
    srv.stop()
    err = srv.stderr()
    named, panicked = "CHAT_HISTORY_MAX_MESSAGES_PER_USER" in err, "panicked" in err
    off = run.server(ready=False, env={"DATABASE_URL": url, "CHAT_HISTORY_MAX_MESSAGES_PER_USER": "off"})
    off_outcome = wait_start_or_exit(off, 15)
    off.stop()
    figure = (f"{huge}: {outcome}{', names it' if named else ''}{' PANIC' if panicked else ''}; "
              f"off: {off_outcome}")
    ok = outcome.startswith("exit") and outcome != "exit 0" and named and not panicked \
        and off_outcome == "ready"
    return Result(figure, ok)


def attack_library_env(run):
    """Variables that the libraries under the service read for themselves:
    tokio panics on a TOKIO_WORKER_THREADS it cannot use (or starts that
    many threads), and sqlx refuses every connection over a client
    certificate that libpq would pass over. Neither stops start-up: each is
    a warning naming the variable."""
    url = run.database_url()
    parts, ok = [], True
    for label, extra, says in (
        ("TOKIO_WORKER_THREADS=0", {"TOKIO_WORKER_THREADS": "0"}, "TOKIO_WORKER_THREADS=0"),
        ("=abc", {"TOKIO_WORKER_THREADS": "abc"}, "TOKIO_WORKER_THREADS=abc"),
        ("=99999999", {"TOKIO_WORKER_THREADS": "99999999"}, "TOKIO_WORKER_THREADS=99999999"),
        ("PGSSLKEY alone", {"PGSSLKEY": "/nonexistent/client.key"}, "PGSSLKEY is set"),
        ("PGSSLCERT not there", {"PGSSLCERT": "/nonexistent/client.crt",
                                 "PGSSLKEY": "/nonexistent/client.key"}, "PGSSLCERT names"),
    ):
        srv = run.server(ready=False, env={"DATABASE_URL": url, **extra})
        outcome = wait_start_or_exit(srv, 15)
        srv.stop()
        err = srv.stderr()
        warned, panicked = says in err, "panicked" in err
        parts.append(f"{label}: {outcome}{'' if warned else ', no warning'}"
                     f"{' PANIC' if panicked else ''}")
        ok &= outcome == "ready" and warned and not panicked
    return Result("; ".join(parts), ok)


LEAK_URLS = [
    "postgres://app@127.0.0.1:1/chat?password=S3CRETzq1",
    "postgres://app:S3CRETzq2@127.0.0.1:1/chat",
    "postgres://app:S3CRET%7Azq3@127.0.0.1:1/chat",  # decodes to S3CRETzzq3
    "postgres://app@127.0.0.1:1/chat?pass%77ord=S3CRETzq4",  # pass%77ord is `password`
]
LEAK_NEEDLES = ["s3cret", "cretzq", "cret%7a", "cretzzq", "zzq3"]


def attack_password_leak(run):
    """A password, wherever it sits in DATABASE_URL, never reaches a log line
    or an error: migrate and serve against an unreachable database."""
    cases = [(url, cmd, fmt) for url in LEAK_URLS for cmd in ("migrate", "serve")
             for fmt in ("json", "pretty")]
    procs = []
    for url, cmd, fmt in cases:  # all at once: they mostly wait on the dead port
        procs.append(run.spawn([cmd], {
            "DATABASE_URL": url, "CHAT_HISTORY_BIND": f"127.0.0.1:{free_port()}",
            "CHAT_HISTORY_LOG_FORMAT": fmt, "RUST_LOG": "debug",
        }))
    deadline = time.monotonic() + 8
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    leaks = {}  # password -> runs that showed it
    for (url, cmd, fmt), p in zip(cases, procs):
        p.stop(grace=2)
        text = (p.stdout() + p.stderr()).lower()
        if any(n in text for n in LEAK_NEEDLES):
            leaks.setdefault("zq" + url.split("zq")[1][0], []).append(f"{cmd}/{fmt}")
    count = sum(len(v) for v in leaks.values())
    figure = f"{count}/{len(cases)} runs leak"
    if leaks:
        figure += " (" + ", ".join(f"...{k}: {len(v)}/4" for k, v in leaks.items()) + ")"
    return Result(figure, not leaks)


# name -> (function, touches the database (run on each backend), time limit s)
ATTACKS = {
    "metrics-labels": (attack_metrics_labels, False, 60),
    "half-head": (attack_half_head, False, 90),
    "idle-keepalive": (attack_idle_keepalive, False, 90),
    "connection-cap": (attack_connection_cap, False, 60),
    "transcript-read-rss": (attack_transcript_read_rss, True, 240),
    "transcript-put-cap": (attack_transcript_put_cap, True, 240),
    "number-bodies-rss": (attack_number_bodies_rss, True, 180),
    "slow-readers-rss": (attack_slow_readers_rss, True, 120),
    "big-heads-rss": (attack_big_heads_rss, False, 60),
    "kubernetes-env": (attack_kubernetes_env, False, 40),
    "non-utf8-env": (attack_non_utf8_env, False, 60),
    "huge-cap": (attack_huge_cap, False, 40),
    "library-env": (attack_library_env, True, 120),
    "password-leak": (attack_password_leak, False, 40),
}


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def run_one(opts, name, backend):
    """Runs one attack in a thread with its own time limit; whatever happens,
    its servers are stopped and its databases dropped."""
    fn, _, limit = ATTACKS[name]
    run = Run(opts, backend)
    box = {}

    def body():
        try:
            box["result"] = fn(run)
        except NotStarted as e:
            box["result"] = Result(str(e), False)
        except Exception as e:
            box["result"] = Result(f"error: {type(e).__name__}: {str(e)[:150]}", False)

    t = threading.Thread(target=body, daemon=True)
    start = time.monotonic()
    t.start()
    try:
        t.join(limit)
    except KeyboardInterrupt:
        run.cleanup(grace=0)
        raise
    if t.is_alive():
        run.cleanup(grace=0)  # kills its servers, which unblocks the thread's sockets
        t.join(5)
        result = Result(f"timed out after {limit} s", False)
    else:
        result = box["result"]
    run.cleanup()
    if run.notes:
        result.figure += " [" + "; ".join(dict.fromkeys(run.notes)) + "]"
    result.seconds = time.monotonic() - start
    return result


HEADER = ("attack", "backend", "figure", "verdict")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--only", nargs="+", choices=list(ATTACKS), metavar="NAME",
                        help="attacks to run: " + ", ".join(ATTACKS))
    parser.add_argument("--no-check", action="store_true",
                        help="only print; exit 0 whatever the verdicts")
    parser.add_argument("--legacy", action="store_true",
                        help="never pass settings an old binary refuses: " + ", ".join(NEW_SETTINGS))
    opts = parser.parse_args()
    opts.binary = os.path.abspath(opts.binary)
    if not os.access(opts.binary, os.X_OK):
        parser.error(f"{opts.binary} is not an executable")

    backends = ["sqlite", "postgres"] if opts.backend == "both" else [opts.backend]
    rows = []
    t0 = time.monotonic()
    try:
        for name in opts.only or ATTACKS:
            touches_db = ATTACKS[name][1]
            # Attacks that do not depend on the store run once, on the first backend.
            for backend in (backends if touches_db else backends[:1]):
                label = backend if touches_db else "-"
                print(f"[{name} / {label}] ...", flush=True)
                r = run_one(opts, name, backend)
                verdict = "ok" if r.ok else "FAILED"
                print(f"[{name} / {label}] {r.figure} -> {verdict} ({r.seconds:.0f} s)", flush=True)
                rows.append((name, label, r.figure, verdict))
    finally:
        Process.kill_all()

    print()
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(HEADER)]
    for row in [HEADER, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    failed = sum(1 for r in rows if r[3] != "ok")
    print(f"\n{len(rows) - failed} ok, {failed} failed, {time.monotonic() - t0:.0f} s"
          + (" (--no-check: exit 0 regardless)" if opts.no_check else ""))
    return 0 if opts.no_check or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
