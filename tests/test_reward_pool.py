"""KillablePool: hard per-item timeouts, crash retry, use from threads, clean shutdown."""
import ctypes
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from orz.reward.pool import KillablePool


def _behave(item):
    """Test function run in the workers: the item says what to do."""
    kind, arg = item
    if kind == "double":
        return arg * 2
    if kind == "hang":
        time.sleep(3600)
    if kind == "spin":  # busy in C code, no Python signal handler could interrupt it
        return 2 ** (2**40) % 7
    if kind == "exit":
        os._exit(3)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "raise":
        raise ValueError(arg)
    if kind == "crash_once":  # arg: a marker path that exists after the first attempt
        if not os.path.exists(arg):
            open(arg, "w").close()
            os._exit(4)
        return "second try"
    if kind == "pid":
        return os.getpid()
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def pool():
    with KillablePool(_behave, num_workers=2, item_timeout_s=1.0, chunk_size=4) as pool:
        yield pool


def test_results_in_order(pool):
    results = pool.map([("double", i) for i in range(100)])
    assert [r.value for r in results] == [2 * i for i in range(100)]
    assert {r.status for r in results} == {"ok"}


def test_hung_items_time_out_and_the_pool_keeps_serving(pool):
    restarts = pool.restarts
    start = time.monotonic()
    results = pool.map([("double", 1), ("hang", None), ("spin", None), ("double", 2)])
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["ok", "timeout", "timeout", "ok"]
    assert [results[0].value, results[3].value] == [2, 4]
    assert elapsed < 4.0  # two 1 s timeouts on two workers, plus restarts
    assert pool.restarts == restarts + 2
    assert [r.value for r in pool.map([("double", 5)] * 3)] == [10] * 3


@pytest.mark.parametrize("kind", ["exit", "segfault"])
def test_a_crashing_item_is_retried_once_then_reported(pool, kind):
    restarts = pool.restarts
    results = pool.map([("double", 1), (kind, None), ("double", 3)])
    assert [r.status for r in results] == ["ok", "crash", "ok"]
    assert pool.restarts == restarts + 2  # the first crash and the retry's


def test_mixed_batch_of_crashes_and_hangs_loses_nothing():
    """Crashes and hangs scattered through chunks that are queued ahead: every item comes back,
    with the status its kind deserves."""
    rng = random.Random(0)
    kinds = rng.choices(["double", "exit", "segfault", "hang"], weights=[90, 5, 3, 2], k=200)
    items = [(kind, i) for i, kind in enumerate(kinds)]
    expected = {"double": "ok", "exit": "crash", "segfault": "crash", "hang": "timeout"}
    with KillablePool(_behave, num_workers=2, item_timeout_s=0.5, chunk_size=8) as pool:
        results = pool.map(items)
    assert [r.status for r in results] == [expected[k] for k in kinds]
    assert [r.value for r, k in zip(results, kinds) if k == "double"] == [2 * i for i, k in enumerate(kinds) if k == "double"]


def test_a_crash_that_does_not_repeat_succeeds_on_retry(pool, tmp_path):
    results = pool.map([("crash_once", str(tmp_path / "marker"))])
    assert (results[0].status, results[0].value) == ("ok", "second try")


def test_exceptions_are_results_not_failures(pool):
    (result,) = pool.map([("raise", "bad input")])
    assert result.status == "error" and "ValueError: bad input" in result.value


def test_map_from_several_threads_at_once(pool):
    outputs = {}

    def run(offset):
        outputs[offset] = [r.value for r in pool.map([("double", offset + i) for i in range(50)])]

    threads = [threading.Thread(target=run, args=(k * 1000,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outputs == {k * 1000: [2 * (k * 1000 + i) for i in range(50)] for k in range(3)}


def test_close_stops_the_workers():
    pool = KillablePool(_behave, num_workers=2, item_timeout_s=1.0)
    pids = {r.value for r in pool.map([("pid", None)] * 20)}
    pool.close()
    for pid in pids:
        assert not _alive(pid)
    with pytest.raises(RuntimeError, match="closed"):
        pool.map([("double", 1)])


def test_workers_die_with_their_owner_even_mid_item(tmp_path):
    """The owner is SIGKILLed while a worker spins in C code: nothing must survive it. Its main
    script prints a line when imported: workers must not import it again (multiprocessing's
    spawn and forkserver would, with everything a trainer script imports)."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time, threading\n"
        "print('main script imported', flush=True)\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_reward_pool import _behave\n"
        "from orz.reward.pool import KillablePool\n"
        "if __name__ == '__main__':\n"
        "    pool = KillablePool(_behave, num_workers=2, item_timeout_s=60)\n"
        "    print(pool.map([('pid', None)])[0].value, flush=True)\n"
        "    threading.Thread(target=pool.map, args=([('spin', None)],), daemon=True).start()\n"
        "    time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert owner.stdout.readline() == "main script imported\n"
    worker_pid = int(owner.stdout.readline())
    time.sleep(0.3)
    owner.kill()
    owner.wait()
    assert owner.stdout.read() == ""
    deadline = time.monotonic() + 5
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)


def test_the_pool_survives_its_zygote_being_killed():
    with KillablePool(_behave, num_workers=2, item_timeout_s=5.0) as pool:
        pool._zygote.process.kill()
        time.sleep(0.2)  # its workers die with it, while idle
        assert [r.value for r in pool.map([("double", i) for i in range(10)])] == [2 * i for i in range(10)]


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="item_timeout_s"):
        KillablePool(_behave, num_workers=1, item_timeout_s=0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
