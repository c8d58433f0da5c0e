"""Start a multi-process JAX job on one machine and supervise it.

    python -m zeropp_jax.launch --nodes 2 --local 4 [--timeout S] [--port P] -- CMD ...

starts `nodes` copies of `CMD` on loopback. Each gets, in its environment, the coordinator
address (`127.0.0.1:<port>`; a free port unless `--port` is given), the process count, its
process id and its local device count (`ZEROPP_*` variables below), and `XLA_FLAGS` with
`--xla_force_host_platform_device_count=<local>` so that, on CPU, each process has `local`
emulated devices. A worker calls `initialize_from_env()` before touching any JAX device;
`zeropp_jax.make_mesh(num_nodes=jax.process_count())` then makes one node per process (the
processes share this machine's host name, so `make_mesh()` alone makes them one node; pass
`host_name=` to emulate hosts instead, as tests/test_topology.py does).

The launcher waits for all processes, each with its output captured to a log file. When one
fails, or the time limit passes, it SIGKILLs the others (JAX catches SIGTERM, so SIGTERM may
not stop a worker) and returns a non-zero status, printing the last lines of the failing
process's output. Every wait is bounded. Workers start a short heartbeat timeout, so when a
peer dies the survivors abort on their own within about that time (this is what a real
multi-host job relies on, where no single launcher sees every process).

`supervise` is the process-agnostic core: it runs any per-process commands and
environments (the emulated two-node cluster in `experiments/cluster` uses it to start one
worker per network namespace).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

ENV_COORDINATOR = "ZEROPP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROPP_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROPP_PROCESS_ID"
ENV_LOCAL_DEVICES = "ZEROPP_LOCAL_DEVICE_COUNT"
ENV_HEARTBEAT = "ZEROPP_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "ZEROPP_INIT_TIMEOUT"
_ENV_REQUIRED = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

DEFAULT_HEARTBEAT_S = 10
DEFAULT_INIT_TIMEOUT_S = 120
DEFAULT_SHUTDOWN_TIMEOUT_S = 30
TIMEOUT_STATUS = 124  # as coreutils `timeout`
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# ----------------------------------------------------------------------------- results


def _tail(path: str, lines: int) -> str:
    if lines <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one process ended.

    Attributes:
      process_id: its index in the job.
      returncode: exit status; negative `-n` when ended by signal `n`.
      killed: True if the launcher SIGKILLed it (after a failure elsewhere or the timeout).
      elapsed_s: seconds from start to exit.
      log_path: file holding its stdout and stderr.
    """

    process_id: int
    returncode: int
    killed: bool
    elapsed_s: float
    log_path: str

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines of its output."""
        return _tail(self.log_path, lines)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a job ended.

    Attributes:
      returncode: 0 if every process exited with 0; 124 if the time limit passed first;
        otherwise the shell-style status of the first failing process (`128 + n` for
        signal `n`).
      processes: one `ProcessResult` per process, by process id.
      failed: process id of the first process seen to fail, or None.
      timed_out: whether the time limit passed before all processes ended.
      elapsed_s: seconds from the first start to the last exit.
    """

    returncode: int
    processes: tuple[ProcessResult, ...]
    failed: int | None
    timed_out: bool
    elapsed_s: float

    def report(self, lines: int = 20) -> str:
        """A summary: each process's status, then the failing process's last lines."""
        out = []
        for p in self.processes:
            how = "killed by the launcher" if p.killed else f"exit {p.returncode}"
            out.append(f"process {p.process_id}: {how} after {p.elapsed_s:.1f}s ({p.log_path})")
        if self.timed_out:
            out.append(f"time limit passed after {self.elapsed_s:.1f}s; all processes killed.")
        if self.failed is not None:
            p = self.processes[self.failed]
            out.append(f"--- process {p.process_id} failed (exit {p.returncode}); last lines:")
            out.append(p.tail(lines))
        elif self.timed_out:
            for p in self.processes:
                out.append(f"--- process {p.process_id}; last lines:")
                out.append(p.tail(lines))
        return "\n".join(out)


def _shell_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


# ----------------------------------------------------------------------------- supervise


class _Pump(threading.Thread):
    """Copies a child's output pipe to its log file (and, if asked, to `echo`)."""

    def __init__(self, pipe, log_path: str, prefix: str, echo: TextIO | None, lock):
        super().__init__(daemon=True, name=f"zeropp-launch-{prefix}")
        self.pipe, self.log_path, self.prefix, self.echo, self.lock = (
            pipe,
            log_path,
            prefix,
            echo,
            lock,
        )

    def run(self) -> None:
        with open(self.log_path, "ab") as log:
            for line in iter(self.pipe.readline, b""):
                log.write(line)
                log.flush()
                if self.echo is not None:
                    with self.lock:
                        self.echo.write(self.prefix + line.decode("utf-8", "replace"))
                        self.echo.flush()
        self.pipe.close()


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILLs `proc` and its process group (it leads its own session)."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def supervise(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    timeout: float,
    kill_grace: float = 0.0,
    log_dir: str | None = None,
    echo: TextIO | None = None,
    poll_interval: float = 0.05,
) -> LaunchResult:
    """Runs one command per process and waits for all of them, within `timeout` seconds.

    Each process leads its own session (so SIGKILL reaches anything it starts); any
    exception in the launcher, KeyboardInterrupt included, SIGKILLs them all. Their
    stdout and stderr go to `<log_dir>/process_<i>.log`.

    Args:
      commands: argv of each process.
      envs: the full environment of each process.
      timeout: seconds after which every process still running is SIGKILLed.
      kill_grace: after the first failure, seconds to let the others end on their own (e.g.
        through the JAX heartbeat) before they are SIGKILLed; 0 kills them at once.
      log_dir: where the logs go (default: a new temporary directory, kept).
      echo: a text stream that also receives every output line, prefixed `[i] `.
      poll_interval: seconds between checks.

    Returns:
      A `LaunchResult`.

    Raises:
      ValueError: for mismatched lengths, no commands, or a non-positive timeout.
    """
    if len(commands) != len(envs) or not commands:
        raise ValueError(
            f"supervise: got {len(commands)} commands and {len(envs)} environments; expected "
            "the same positive number of each."
        )
    if not timeout > 0 or kill_grace < 0:
        raise ValueError(
            f"supervise: timeout={timeout}, kill_grace={kill_grace}; expected timeout > 0 "
            "and kill_grace >= 0."
        )
    log_dir = log_dir or tempfile.mkdtemp(prefix="zeropp_launch_")
    os.makedirs(log_dir, exist_ok=True)
    logs = [os.path.join(log_dir, f"process_{i}.log") for i in range(len(commands))]
    procs: list[subprocess.Popen] = []
    pumps: list[_Pump] = []
    started = time.monotonic()
    ended: dict[int, float] = {}
    try:
        _start(commands, envs, logs, echo, procs, pumps)
        failed, timed_out = _wait(procs, ended, started + timeout, kill_grace, poll_interval)
    finally:
        killed = _stop(procs, pumps, ended)
    return _result(procs, logs, started, ended, killed, failed, timed_out)


def _start(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    logs: list[str],
    echo: TextIO | None,
    procs: list[subprocess.Popen],
    pumps: list[_Pump],
) -> None:
    """Starts each process in its own session and a pump for its output, appending both to
    `procs` and `pumps` as it goes (so that a failure part-way still stops those started)."""
    lock = threading.Lock()
    for i, (cmd, env) in enumerate(zip(commands, envs, strict=True)):
        open(logs[i], "wb").close()
        proc = subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        pump = _Pump(proc.stdout, logs[i], f"[{i}] ", echo, lock)
        pump.start()
        pumps.append(pump)


def _wait(
    procs: list[subprocess.Popen],
    ended: dict[int, float],
    deadline: float,
    kill_grace: float,
    poll_interval: float,
) -> tuple[int | None, bool]:
    """Polls until every process has ended, the deadline passes, or `kill_grace` seconds
    after the first failure; records exit times in `ended`. Returns `(failed, timed_out)`."""
    failed: int | None = None
    failed_at = None
    while len(ended) < len(procs):
        now = time.monotonic()
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = now
                if proc.returncode != 0 and failed is None:
                    failed, failed_at = i, now
        if len(ended) == len(procs):
            break
        if now >= deadline:
            return failed, failed is None
        if failed is not None and now - failed_at >= kill_grace:
            break
        time.sleep(poll_interval)
    return failed, False


def _stop(procs: list[subprocess.Popen], pumps: list[_Pump], ended: dict[int, float]) -> set[int]:
    """SIGKILLs the processes still running and waits for all (bounded); returns the killed."""
    killed: set[int] = set()
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            _kill(proc)
            killed.add(i)
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state); report and move on
            pass
        ended.setdefault(i, time.monotonic())
    for pump in pumps:
        pump.join(timeout=5)
    return killed


def _result(
    procs: list[subprocess.Popen],
    logs: list[str],
    started: float,
    ended: dict[int, float],
    killed: set[int],
    failed: int | None,
    timed_out: bool,
) -> LaunchResult:
    """The `LaunchResult` of the ended processes."""
    results = tuple(
        ProcessResult(
            process_id=i,
            returncode=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
            killed=i in killed,
            elapsed_s=ended[i] - started,
            log_path=logs[i],
        )
        for i, proc in enumerate(procs)
    )
    if timed_out:
        code = TIMEOUT_STATUS
    elif failed is not None:
        code = _shell_status(results[failed].returncode)
    else:
        code = 0
    return LaunchResult(
        returncode=code,
        processes=results,
        failed=failed,
        timed_out=timed_out,
        elapsed_s=max(ended.values()) - started,
    )


# ----------------------------------------------------------------------------- launch


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` with `--xla_force_host_platform_device_count` set to `count`."""
    rest = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", xla_flags).split()
    return " ".join([*rest, f"{_DEVICE_COUNT_FLAG}={count}"])


def worker_env(
    *,
    process_id: int,
    num_processes: int,
    coordinator: str,
    local_devices: int,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_S,
    init_timeout: int = DEFAULT_INIT_TIMEOUT_S,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one worker: `base` (default `os.environ`) plus the job's variables.

    Also sets `PYTHONUNBUFFERED=1`, so a worker that dies abruptly leaves its last lines
    in the log.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            ENV_LOCAL_DEVICES: str(local_devices),
            ENV_HEARTBEAT: str(heartbeat_timeout),
            ENV_INIT_TIMEOUT: str(init_timeout),
            "XLA_FLAGS": with_device_count(env.get("XLA_FLAGS", ""), local_devices),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _check_count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"launch: {name}={value!r}; expected an int >= {minimum}.")


def launch(
    command: Sequence[str],
    *,
    nodes: int,
    local: int,
    timeout: float = 600.0,
    port: int | None = None,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_S,
    init_timeout: int = DEFAULT_INIT_TIMEOUT_S,
    kill_grace: float = 0.0,
    log_dir: str | None = None,
    echo: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchResult:
    """Runs `command` as a `nodes`-process JAX job on loopback, `local` CPU devices each.

    Args:
      command: argv of every worker (the same for all; they tell themselves apart by
        `ZEROPP_PROCESS_ID`, or just call `initialize_from_env()`).
      nodes: number of processes (each one node of the mesh).
      local: devices per process (`--xla_force_host_platform_device_count` on CPU).
      timeout: seconds before every process still running is SIGKILLed.
      port: coordinator port on 127.0.0.1 (default: a free one).
      heartbeat_timeout: seconds without heartbeats after which JAX declares a peer dead
        and the survivors abort.
      init_timeout: seconds `jax.distributed.initialize` waits for all processes.
      kill_grace: see `supervise`.
      log_dir: see `supervise`.
      echo: see `supervise`.
      env: base environment (default `os.environ`).

    Returns:
      A `LaunchResult` (`.report()` prints statuses and the failing process's last lines).
    """
    if isinstance(command, str) or not command:
        raise ValueError(f"launch: command={command!r}; expected a non-empty list of strings.")
    _check_count("nodes", nodes)
    _check_count("local", local)
    _check_count("heartbeat_timeout", heartbeat_timeout)
    _check_count("init_timeout", init_timeout)
    coordinator = f"127.0.0.1:{free_port() if port is None else port}"
    envs = [
        worker_env(
            process_id=i,
            num_processes=nodes,
            coordinator=coordinator,
            local_devices=local,
            heartbeat_timeout=heartbeat_timeout,
            init_timeout=init_timeout,
            base=env,
        )
        for i in range(nodes)
    ]
    return supervise(
        [list(command)] * nodes,
        envs,
        timeout=timeout,
        kill_grace=kill_grace,
        log_dir=log_dir,
        echo=echo,
    )


# ----------------------------------------------------------------------------- worker side


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Starts `jax.distributed` from the variables the launcher sets.

    Call it first thing in a worker, before any JAX computation. With none of the
    variables set (the script was started directly) it does nothing and returns False, so
    the same script runs single-process.

    The heartbeat timeout (`ZEROPP_HEARTBEAT_TIMEOUT`, default 10 s) bounds how long a
    survivor runs on after a peer dies: JAX's coordination service then aborts every
    process (exit status 134). `ZEROPP_INIT_TIMEOUT` bounds the wait for all processes to
    join.

    Returns:
      True if `jax.distributed.initialize` was called.

    Raises:
      ValueError: when only some of the variables are set, or one is malformed.
      RuntimeError: when the process ends up with a different device count than
        `ZEROPP_LOCAL_DEVICE_COUNT` asks for (e.g. JAX had already started, or XLA_FLAGS was
        overridden).
    """
    environ = os.environ if environ is None else environ
    present = [k for k in _ENV_REQUIRED if k in environ]
    if not present:
        return False
    if len(present) != len(_ENV_REQUIRED):
        missing = sorted(set(_ENV_REQUIRED) - set(present))
        raise ValueError(
            f"initialize_from_env: {present} are set but {missing} are not; set all of "
            f"{list(_ENV_REQUIRED)} (zeropp_jax.launch does) or none."
        )

    def integer(name: str, default: int | None = None) -> int:
        text = environ.get(name)
        if text is None and default is not None:
            return default
        try:
            return int(text)
        except (TypeError, ValueError):
            raise ValueError(
                f"initialize_from_env: {name}={text!r}; expected an integer."
            ) from None

    import jax

    jax.distributed.initialize(
        coordinator_address=environ[ENV_COORDINATOR],
        num_processes=integer(ENV_NUM_PROCESSES),
        process_id=integer(ENV_PROCESS_ID),
        initialization_timeout=integer(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S),
        heartbeat_timeout_seconds=integer(ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S),
        shutdown_timeout_seconds=DEFAULT_SHUTDOWN_TIMEOUT_S,
    )
    if ENV_LOCAL_DEVICES in environ and jax.default_backend() == "cpu":
        want = integer(ENV_LOCAL_DEVICES)
        if jax.local_device_count() != want:
            raise RuntimeError(
                f"initialize_from_env: this process has {jax.local_device_count()} CPU "
                f"devices but {ENV_LOCAL_DEVICES}={want}; keep "
                f"{_DEVICE_COUNT_FLAG}={want} in XLA_FLAGS and call initialize_from_env() "
                "before any other JAX call."
            )
    return True


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zeropp_jax.launch",
        description="Run a command as a multi-process JAX job on loopback.",
        epilog="The worker calls zeropp_jax.launch.initialize_from_env() before using JAX.",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of processes")
    p.add_argument("--local", type=int, required=True, help="CPU devices per process")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument(
        "--heartbeat",
        type=int,
        default=DEFAULT_HEARTBEAT_S,
        help=f"JAX heartbeat timeout in seconds (default {DEFAULT_HEARTBEAT_S})",
    )
    p.add_argument(
        "--kill-grace",
        type=float,
        default=0.0,
        help="seconds the others may run on after a failure before SIGKILL (default 0)",
    )
    p.add_argument("--log-dir", default=None, help="directory for process_<i>.log")
    p.add_argument("--quiet", action="store_true", help="do not echo the workers' output")
    p.add_argument("--tail", type=int, default=30, help="lines of a failing process to print")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and its arguments")
    return p


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `supervise` kills the workers
    signal.signal(signal.SIGINT, signal.default_int_handler)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _parser().error("give the command after --")
    try:
        result = launch(
            command,
            nodes=args.nodes,
            local=args.local,
            timeout=args.timeout,
            port=args.port,
            heartbeat_timeout=args.heartbeat,
            kill_grace=args.kill_grace,
            log_dir=args.log_dir,
            echo=None if args.quiet else sys.stdout,
        )
    except ValueError as e:
        _parser().error(str(e))
    except KeyboardInterrupt as e:
        print(f"launch: interrupted ({e}); all processes killed.", file=sys.stderr)
        return 130
    stream = sys.stdout if result.returncode == 0 else sys.stderr
    print(result.report(args.tail) if result.returncode else result.report(0), file=stream)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
