"""CodeReward and its sandbox: correct judging, and every escape scores 0 and leaves nothing behind.

The hostile solutions run as one parallel batch (a module fixture), so their timeouts overlap;
each test then checks one of them.
"""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from orz.data.datasets import CodeTests
from orz.config import CodeScoringConfig, load_config
from orz.reward.code import CodeReward, extract_code, outputs_match
from orz.reward.router import RouterConfig
from orz.reward.sandbox import Sandbox, SandboxLimits, _pids_of

# Tight limits for the hostile batch (their timeouts overlap); generous ones where a busy machine
# must not fail a correct solution.
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=512, processes=16)
GENEROUS = SandboxLimits(wall_s=30.0, cpu_s=10, memory_mb=512, processes=16)
UIDS = (3_800_000, 3_804_096)  # Sandbox's default range
ADD = CodeTests(inputs=["1 2\n", "30 4\n"], outputs=["3\n", "34"])
ADD_SOURCE = "a, b = map(int, input().split())\nprint(a + b)\n"
ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parent.parent


def fenced(source: str) -> str:
    return f"Here it is:\n```python\n{textwrap.dedent(source)}```\n"


def test_the_runs_code_keys_reach_the_sandbox_and_the_judges():
    """reward.code.wall_s, cpu_s and memory_mb become the sandbox's limits, max_parallel the
    solutions judged at once (the tests above give their limits directly)."""
    reward = load_config(None, ["reward.code.wall_s=3", "reward.code.cpu_s=2", "reward.code.memory_mb=300",
                                "reward.code.max_parallel=3"]).reward
    with CodeReward(RouterConfig.from_config(reward).code) as code:
        limits = code.sandbox.limits
        assert (limits.wall_s, limits.cpu_s, limits.memory_mb) == (3.0, 2, 300)
        assert code._threads._max_workers == 3


@pytest.fixture(scope="module")
def reward():
    with CodeReward(CodeScoringConfig(max_parallel=4), limits=GENEROUS) as reward:
        yield reward


@pytest.fixture(scope="module")
def strict_reward():
    with CodeReward(CodeScoringConfig(max_parallel=8), limits=LIMITS) as reward:
        yield reward


def places(other_dir: Path, listener: socket.socket) -> dict:
    """Where the escapes write, under a fresh tag, and the port of a host service they call."""
    tag = uuid.uuid4().hex
    return {"other": str(other_dir / f"pwned-{tag}"), "tmp": f"/tmp/pwned-{tag}", "shm": f"/dev/shm/pwned-{tag}",
            "repo": os.path.abspath(f"pwned-{tag}"), "port": listener.getsockname()[1], "listener": listener}


def listening() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    return listener


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """Places a solution must not be able to write to, and a host service it must not reach."""
    other_dir = tmp_path_factory.mktemp("not-yours")
    os.chmod(other_dir, 0o700)
    with listening() as listener:
        yield places(other_dir, listener)


@pytest.fixture
def control(tmp_path_factory):
    """The same kind of places for a control run outside the sandbox, removed afterwards."""
    other_dir = tmp_path_factory.mktemp("not-yours-control")
    os.chmod(other_dir, 0o700)
    with listening() as listener:
        where = places(other_dir, listener)
        yield where
    for key in ("other", "tmp", "shm", "repo"):
        Path(where[key]).unlink(missing_ok=True)


# Connects to 127.0.0.1:{port} through libc, past the harness's audit hook; works on the host
# (test_the_escape_succeeds_outside_the_sandbox), so only the network namespace can stop it.
RAW_CONNECT = """
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
    address = struct.pack("=H", 2) + struct.pack("!H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
    if libc.connect(fd, address, len(address)) == 0:
        print(3)
"""
HOSTILE = {
    "python_fork_bomb": """
        import os
        print(3)
        while True:
            os.fork()
    """,
    "ctypes_fork_bomb": """
        import ctypes
        libc = ctypes.CDLL(None)
        print(3, flush=True)
        while True:
            libc.fork()
    """,
    "infinite_loop": """
        while True:
            pass
    """,
    "sleeps_forever": """
        import time
        time.sleep(3600)
    """,
    "allocates_50_gb": """
        block = bytearray(50 * 2**30)
        print(3)
    """,
    "output_flood": """
        while True:
            print("3" * 100_000)
    """,
    "opens_socket": """
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=1)
        print(3)
    """,
    "raw_socket_via_ctypes": RAW_CONNECT,
    "writes_other_dir": """
        open({other!r}, "w").write("x")
        print(3)
    """,
    "writes_tmp": """
        open({tmp!r}, "w").write("x")
        print(3)
    """,
    "writes_shm": """
        open({shm!r}, "w").write("x")
        print(3)
    """,
    "writes_repo": """
        open({repo!r}, "w").write("x")
        print(3)
    """,
    "leaves_a_daemon": """
        import ctypes, time
        libc = ctypes.CDLL(None)
        if libc.fork() == 0:
            libc.setsid()
            time.sleep(3600)
        print(3)
    """,
}
CORRECT = ADD_SOURCE
ONE_TEST = CodeTests(inputs=["1 2\n"], outputs=["3"])


@pytest.fixture(scope="module")
def hostile_results(strict_reward, outside):
    names = list(HOSTILE)
    responses = [fenced(HOSTILE[n].format(**outside)) for n in names] + [fenced(CORRECT)]
    start = time.monotonic()
    judgements = strict_reward.judge(responses, [ONE_TEST] * len(responses))
    elapsed = time.monotonic() - start
    return dict(zip(names + ["correct"], [j.score for j in judgements])), judgements, elapsed


ESCAPES = [n for n in HOSTILE if n != "leaves_a_daemon"]


@pytest.mark.parametrize("name", ESCAPES)
def test_escape_scores_zero(hostile_results, name):
    scores, _, _ = hostile_results
    assert scores[name] == 0.0


def test_hostile_neighbours_do_not_disturb_a_correct_solution(hostile_results):
    scores, judgements, elapsed = hostile_results
    assert scores["correct"] == 1.0
    assert sum(j.timeouts for j in judgements) >= 2  # the loop/sleep/fork bombs hit the wall clock
    assert elapsed < 4 * LIMITS.wall_s + 10  # 14 solutions, 8 at a time; none hangs the batch


def test_nothing_is_left_behind(hostile_results, outside, reward):
    for key in ("other", "tmp", "shm", "repo"):
        assert not os.path.exists(outside[key]), key
    with pytest.raises(BlockingIOError):  # nobody ever reached the host's loopback
        outside["listener"].accept()
    if ROOT:
        deadline = time.monotonic() + 3
        while (left := [pid for uid in _uids_in_use() for pid in _pids_of(uid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == []
        assert os.listdir(reward.sandbox.workdir_root) == ["uid-locks"]


# Controls: each escape whose harm can be seen, run as a plain Python process outside the sandbox,
# does its harm (the file is written, the service answers, the daemon outlives its parent), so
# that the sandbox, not a missing file or a dead port, is what stops it in the battery.
def test_the_escape_succeeds_outside_the_sandbox(control):
    harms = {"writes_other_dir": "other", "writes_tmp": "tmp", "writes_shm": "shm", "writes_repo": "repo"}
    for name, key in harms.items():
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(HOSTILE[name].format(**control))],
                                capture_output=True, text=True, timeout=30)
        assert result.stdout == "3\n" and Path(control[key]).read_text() == "x", (name, result.stderr)
    for name in ("opens_socket", "raw_socket_via_ctypes"):
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(HOSTILE[name].format(**control))],
                                capture_output=True, text=True, timeout=30)
        assert result.stdout == "3\n", (name, result.stderr)
        connection, _ = control["listener"].accept()  # the host's service was reached
        connection.close()


def test_the_daemon_outlives_its_parent_outside_the_sandbox(tmp_path):
    tag = f"orz-daemon-control-{uuid.uuid4().hex}"
    with open(tmp_path / "stdout", "w") as stdout:  # a file: the daemon keeps a pipe open
        subprocess.run([sys.executable, "-c", textwrap.dedent(HOSTILE["leaves_a_daemon"]), tag], stdout=stdout,
                       stderr=subprocess.DEVNULL, timeout=30, check=True)
    assert (tmp_path / "stdout").read_text() == "3\n"
    daemons = [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
    for daemon in daemons:
        daemon.kill()
    assert len(daemons) == 1  # the parent has exited; its forked child sleeps on


# The escapes that any sandbox with a time, memory, output or process limit stops, each with
# the limit that must have stopped it here: (limits for the run, what its result must show).
# The other seven (sockets, writes outside, a daemon) need the uid and namespaces; their
# controls above show that they succeed outside.
LIMIT_FOR_THE_LOOP = SandboxLimits(wall_s=60.0, cpu_s=1, memory_mb=512, processes=16)  # the CPU second first
STOPPED_BY = {
    "python_fork_bomb": (LIMITS, lambda r: r.returncode == 1 and not r.timed_out
                         and "BlockingIOError: [Errno 11] Resource temporarily unavailable" in r.stderr),  # NPROC
    "ctypes_fork_bomb": (LIMITS, lambda r: r.timed_out and r.returncode is None),  # fork fails silently: wall clock
    "infinite_loop": (LIMIT_FOR_THE_LOOP, lambda r: r.returncode == -signal.SIGXCPU and not r.timed_out),  # CPU
    "sleeps_forever": (LIMITS, lambda r: r.timed_out and r.returncode is None),  # wall clock
    "allocates_50_gb": (LIMITS, lambda r: r.returncode == 1 and r.stderr.rstrip().endswith("MemoryError")),  # AS
    "output_flood": (LIMITS, lambda r: r.returncode == 1 and "OSError: [Errno 27] File too large" in r.stderr
                     and len(r.stdout) == LIMITS.file_size_mb * 2**20),  # FSIZE: stdout is a capped file
}


@pytest.fixture(scope="module")
def limited_results(strict_reward):
    """SandboxResults of the limit-bound escapes run directly in the sandbox, all at once."""
    box = strict_reward.sandbox

    def run(name):
        limits, _ = STOPPED_BY[name]
        return box.run([box.python, "-I", "solution.py"], {"solution.py": textwrap.dedent(HOSTILE[name])}, "", limits)

    with ThreadPoolExecutor(len(STOPPED_BY)) as pool:
        return dict(zip(STOPPED_BY, pool.map(run, STOPPED_BY)))


@pytest.mark.parametrize("name", STOPPED_BY)
def test_a_limit_bound_escape_is_stopped_by_its_limit(limited_results, name):
    result = limited_results[name]
    _, stopped = STOPPED_BY[name]
    assert stopped(result), (result.returncode, result.timed_out, result.stderr[-500:])


def _uids_in_use():
    """Sandbox uids that own a process right now."""
    uids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                uid = os.stat(f"/proc/{name}").st_uid
            except FileNotFoundError:
                continue
            if UIDS[0] <= uid < UIDS[1]:
                uids.add(uid)
    return uids


def test_correct_and_wrong_solutions(reward):
    responses = [fenced(ADD_SOURCE), fenced("print(3)\n"), "no code block", fenced(ADD_SOURCE)]
    judgements = reward.judge(responses, [ADD] * 4, ["stop", "stop", "stop", "length"])
    assert [j.score for j in judgements] == [1.0, 0.0, 0.0, 0.0]
    assert [j.code is None for j in judgements] == [False, False, True, False]  # the truncated one's code is read, not run
    assert judgements[3].tests_run == 0


def test_pass_fraction_scoring():
    with CodeReward(CodeScoringConfig(scoring="pass_fraction"), limits=GENEROUS) as reward:
        assert reward.run_tests("print(3)\n", ADD).score == 0.5


def test_call_based_function_and_solution_class(reward):
    tests = CodeTests(inputs=[[[3, 1, 2]], [[5, 4]]], outputs=[[1, 2, 3], [4, 5]], fn_name="sort_list")
    function = "def sort_list(xs):\n    print('debug output is ignored')\n    return sorted(xs)\n"
    method = "class Solution:\n    def sort_list(self, xs):\n        return tuple(sorted(xs))\n"
    wrong = "def sort_list(xs):\n    return xs\n"
    assert [reward.run_tests(s, tests).score for s in (function, method, wrong)] == [1.0, 1.0, 0.0]


def test_environment_is_scrubbed(reward, monkeypatch):
    monkeypatch.setenv("ORZ_SECRET_TOKEN", "hunter2")
    tests = CodeTests(inputs=[""], outputs=["False"])
    assert reward.run_tests("import os\nprint('ORZ_SECRET_TOKEN' in os.environ)\n", tests).score == 1.0


def test_a_solution_may_write_in_its_own_directory(reward):
    source = "open('scratch.txt', 'w').write('3')\nprint(open('scratch.txt').read())\n"
    assert reward.run_tests(source, ONE_TEST).score == 1.0


def test_isolation_is_recorded():
    isolation = Sandbox(GENEROUS).isolation
    assert set(isolation) == {"limits", "user", "namespaces", "python"}
    if ROOT:
        assert not isolation["user"].startswith("off")
        assert not isolation["namespaces"].startswith("off")


def test_output_comparison():
    assert outputs_match("3\n4  \n\n", "3\n4")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("3 4", "3 5")
    assert not outputs_match("123456790", "123456789")  # integers exactly, not within 1e-6 relative
    assert outputs_match("-7", "-07") and outputs_match("1e9", "1000000000.0")
    assert extract_code("```py\nx = 1\n```\ntext\n```python\ny = 2\n```") == "y = 2\n"


def test_without_uid_or_namespaces_code_scoring_refuses_unless_allowed(monkeypatch):
    """Where neither a dedicated uid nor namespaces hold, a solution could write wherever the user
    can: refused, saying why, unless reward.code.allow_weak_sandbox (the probe is made to fail
    here; the user-namespace path itself runs in test_sandbox_unprivileged.py)."""
    def no_namespaces(sandbox):
        sandbox._isolation.namespaces = False
        sandbox._isolation.reasons["namespaces"] = "unshare: Operation not permitted"

    monkeypatch.setattr(Sandbox, "_probe_namespaces", no_namespaces)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"code scoring refused: .*not root.*Operation not permitted.*"
                                           r"allow_weak_sandbox=true"):
        CodeReward(CodeScoringConfig(), limits=GENEROUS)
    with CodeReward(CodeScoringConfig(allow_weak_sandbox=True), limits=GENEROUS) as weak:
        assert weak.sandbox.weak and weak.run_tests(ADD_SOURCE, ADD).score == 1.0
