"""Requests per second and latency of one `stepcredit serve` process under load.

Starts the server in a subprocess (`start_server_process`) on loopback and runs
`--clients` concurrent clients for `--seconds` each round. Each client holds one
keep-alive connection and plays episodes on the embedded simulator: `POST
/create`, `POST /reset` on a random task, up to `--steps` `POST /step`s with a
random admissible action (fewer if the episode ends), `POST /close`. Latency is
one request's, from its first byte sent to its answer's last byte read; the
first `--warmup-s` seconds of a round are not counted.

The load generator is one asyncio process speaking HTTP/1.1 on raw streams (a
request is one write, an answer is read by its Content-Length): it costs a
fraction of what the server spends per request, so the server is the
bottleneck. The report shows both processes' CPU use over each round to check
this (the client's should stay well under one core).

With `--baseline-rev REV`, a temporary `git worktree` of REV serves in
alternating rounds with this checkout (baseline, current, baseline, ...), so
that the ratio is measured under the same machine load; the section written
to `--out` gives each round and the medians.

Usage: python benchmarks/server_load.py [--baseline-rev 800e03b] [--clients 100]
  [--seconds 15] [--rounds 2] [--env alfworld] [--out benchmarks/SERVER_LOAD.md]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.sections import write_section  # noqa: E402
from stepcredit.envs.http_server import start_server_process  # noqa: E402

PATHS = ("/create", "/reset", "/step", "/close")
BEGIN, END = "<!-- server_load:begin -->", "<!-- server_load:end -->"


class _Connection:
    """One keep-alive HTTP/1.1 connection that sends JSON and reads JSON answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self._reader, self._writer, self._host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> "_Connection":
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: dict) -> tuple[object, float]:
        """Sends `body` to `path`; returns the decoded answer and the latency (s)."""
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        self._writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (
                               path.encode(), self._host.encode(), len(payload), payload))
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        answer = await self._reader.readexactly(length)
        latency = time.perf_counter() - start
        if status != b"200":
            raise RuntimeError(f"POST {path}: HTTP {status.decode()}: {answer[:200]!r}")
        return json.loads(answer), latency

    def close(self) -> None:
        self._writer.close()


async def _client(host: str, port: int, seed: int, steps: int, warmup_until: float,
                  stop_at: float, latencies: dict[str, list[float]]) -> None:
    """Plays episodes until `stop_at`, appending the latency of each request that
    ends between `warmup_until` and `stop_at` to `latencies[path]`."""
    rng = random.Random(seed)
    conn = await _Connection.open(host, port)

    async def call(path: str, body: dict) -> dict:
        answer, latency = await conn.post(path, body)
        if warmup_until <= time.perf_counter() < stop_at:
            latencies[path].append(latency)
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"POST {path} {body}: {answer['error']}")
        return answer

    try:
        while time.perf_counter() < stop_at:
            idx = (await call("/create", {}))["id"]
            obs = await call("/reset", {"id": idx, "data_idx": rng.randrange(100)})
            for _ in range(steps):
                obs = await call("/step", {"id": idx,
                                           "action": rng.choice(obs["available_actions"])})
                if obs["done"] or time.perf_counter() >= stop_at:
                    break
            await call("/close", {"id": idx})
    finally:
        conn.close()


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds that process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, clients: int, seconds: float, warmup_s: float,
                steps: int) -> dict[str, list[float]]:
    start = time.perf_counter()
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    await asyncio.gather(*(
        _client("127.0.0.1", port, seed, steps, start + warmup_s, start + warmup_s + seconds,
                latencies) for seed in range(clients)))
    return latencies


def _round(label: str, cwd: str, args: argparse.Namespace) -> dict:
    """Serves from `cwd`, runs one round of load and returns its figures."""
    with start_server_process(args.env, cwd=cwd,
                              options=("--max-envs", str(4 * args.clients))) as server:
        port = int(server.url.rsplit(":", 1)[1])
        server_cpu, client_cpu = _cpu_seconds(server.process.pid), time.process_time()
        latencies = asyncio.run(_load(port, args.clients, args.seconds, args.warmup_s,
                                      args.steps))
        server_cpu = _cpu_seconds(server.process.pid) - server_cpu
        client_cpu = time.process_time() - client_cpu
    wall = args.seconds + args.warmup_s
    quantiles = statistics.quantiles([t for ts in latencies.values() for t in ts], n=100)
    figures = {"label": label, "rps": sum(map(len, latencies.values())) / args.seconds,
               "p50_ms": 1e3 * quantiles[49], "p99_ms": 1e3 * quantiles[98],
               "p99_by_path": {path: 1e3 * statistics.quantiles(latencies[path], n=100)[98]
                               for path in PATHS},
               "server_cpu": server_cpu / wall, "client_cpu": client_cpu / wall}
    print(f"{label:9s} {figures['rps']:8,.0f} requests/s  p50 {figures['p50_ms']:7.1f} ms  "
          f"p99 {figures['p99_ms']:7.1f} ms  CPU: server {figures['server_cpu']:.0%}, "
          f"client {figures['client_cpu']:.0%}", flush=True)
    return figures


@contextlib.contextmanager
def _worktree(rev: str):
    """A temporary detached `git worktree` of `rev`; removed on exit."""
    path = tempfile.mkdtemp(prefix="server_load_")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=True)


def _commit(cwd: str) -> str:
    """The checkout's short commit, marked when the served code has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", cwd, *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "stepcredit/envs", "stepcredit/serve.py")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")


def _section(args: argparse.Namespace, command: str, runs: list[dict]) -> str:
    labels = list(dict.fromkeys(run["label"] for run in runs))
    median = {label: {key: statistics.median(run[key] for run in runs if run["label"] == label)
                      for key in ("rps", "p50_ms", "p99_ms")} for label in labels}
    lines = ["| server | round | requests/s | p50 (ms) | p99 (ms) | p99 create / reset / step / "
             "close (ms) | server CPU | client CPU |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    seen: dict[str, int] = {}
    for run in runs:
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        by_path = " / ".join(f"{v:.0f}" for v in run["p99_by_path"].values())
        lines.append(f"| {run['label']} | {seen[run['label']]} | {run['rps']:,.0f} | "
                     f"{run['p50_ms']:.1f} | {run['p99_ms']:.1f} | {by_path} | "
                     f"{run['server_cpu']:.0%} | {run['client_cpu']:.0%} |")
    lines += ["", "| server | median requests/s | median p50 (ms) | median p99 (ms) |",
              "|---|---:|---:|---:|"]
    lines += [f"| {label} | {m['rps']:,.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} |"
              for label, m in median.items()]
    if len(labels) == 2:
        before, after = (median[label] for label in labels)
        lines += ["", f"Ratio (current / baseline): {after['rps'] / before['rps']:.2f}x the "
                      f"requests per second; p99 {before['p99_ms'] / after['p99_ms']:.2f}x lower."]
    load = os.getloadavg()
    return "\n".join([
        BEGIN, "## One `stepcredit serve` process under load", "",
        f"`{command}` on {platform.machine()}, {os.cpu_count()} cores (load average "
        f"{load[0]:.1f} at the end, shared with other work), Python {platform.python_version()}. "
        f"{args.clients} concurrent clients on loopback, each on one keep-alive connection "
        f"playing `{args.env}` episodes in the `id` dialect (create, reset, up to {args.steps} "
        f"steps with a random admissible action, close); {args.seconds:g} s counted per round "
        f"after {args.warmup_s:g} s of warm-up; rounds alternate between the servers. CPU is "
        "each process's CPU time over the round's wall time (100% = one core); the load "
        "generator is one asyncio process on raw HTTP/1.1 streams.", "", *lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", help="also serve this git revision, in alternate rounds")
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=15.0, help="counted seconds per round")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="uncounted seconds per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server")
    parser.add_argument("--steps", type=int, default=8, help="most steps per episode")
    parser.add_argument("--env", default="alfworld", help="the environment to serve")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "SERVER_LOAD.md"))
    args = parser.parse_args(argv)
    command = "python benchmarks/server_load.py " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])

    with contextlib.ExitStack() as stack:
        servers = [(f"current ({_commit(ROOT)})", ROOT)]
        if args.baseline_rev:
            baseline = stack.enter_context(_worktree(args.baseline_rev))
            servers.insert(0, (f"baseline ({_commit(baseline)})", baseline))
        runs = [_round(label, cwd, args) for _ in range(args.rounds) for label, cwd in servers]

    section = _section(args, command.strip(), runs)
    write_section(args.out, section, BEGIN, END, "Server load")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
