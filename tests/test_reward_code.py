"""CodeReward and its sandbox: correct judging, and every escape scores 0 and leaves nothing behind.

The hostile solutions run as one parallel batch (a module fixture), so their timeouts overlap;
each test then checks one of them.
"""
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from orz.data.datasets import CodeTests
from orz.reward.code import CodeReward, CodeRewardConfig, extract_code, outputs_match
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


@pytest.fixture(scope="module")
def reward():
    with CodeReward(CodeRewardConfig(max_parallel=4, limits=GENEROUS)) as reward:
        yield reward


@pytest.fixture(scope="module")
def strict_reward():
    with CodeReward(CodeRewardConfig(max_parallel=8, limits=LIMITS)) as reward:
        yield reward


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """Places a solution must not be able to write to, and a host service it must not reach."""
    other_dir = tmp_path_factory.mktemp("not-yours")
    os.chmod(other_dir, 0o700)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    tag = uuid.uuid4().hex
    yield {
        "other": str(other_dir / f"pwned-{tag}"),
        "tmp": f"/tmp/pwned-{tag}",
        "shm": f"/dev/shm/pwned-{tag}",
        "repo": os.path.abspath(f"pwned-{tag}"),
        "port": listener.getsockname()[1],
        "listener": listener,
    }
    listener.close()


# Connects to 127.0.0.1:{port} through libc, past the harness's audit hook; works on the host
# (test_raw_connect_works_outside_the_sandbox), so only the network namespace can stop it.
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
    scores, metrics = strict_reward.score(responses, [ONE_TEST] * len(responses))
    elapsed = time.monotonic() - start
    return dict(zip(names + ["correct"], scores)), metrics, elapsed


ESCAPES = [n for n in HOSTILE if n != "leaves_a_daemon"]


@pytest.mark.parametrize("name", ESCAPES)
def test_escape_scores_zero(hostile_results, name):
    scores, _, _ = hostile_results
    assert scores[name] == 0.0


def test_hostile_neighbours_do_not_disturb_a_correct_solution(hostile_results):
    scores, metrics, elapsed = hostile_results
    assert scores["correct"] == 1.0
    assert metrics["code/timeouts"] >= 2  # the loop/sleep/fork bombs hit the wall clock
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


def test_raw_connect_works_outside_the_sandbox():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        code = textwrap.dedent(RAW_CONNECT.format(port=listener.getsockname()[1]))
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert result.stdout == "3\n"


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
    scores, metrics = reward.score(responses, [ADD] * 4, ["stop", "stop", "stop", "length"])
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert metrics["code/extraction_failure_rate"] == pytest.approx(1 / 4)


def test_pass_fraction_scoring():
    with CodeReward(CodeRewardConfig(scoring="pass_fraction", limits=GENEROUS)) as reward:
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
        CodeReward(CodeRewardConfig(limits=GENEROUS))
    with CodeReward(CodeRewardConfig(limits=GENEROUS, allow_weak_sandbox=True)) as weak:
        assert weak.sandbox.weak and weak.run_tests(ADD_SOURCE, ADD).score == 1.0
