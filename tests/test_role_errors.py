"""What a user sees when a role raises: the traceback on the terminal, where it was raised, and
one `orz:` line naming the iteration, the phase and the last checkpoint (a file of its own so that
the suite's two workers share the end-to-end files evenly)."""
import subprocess
import sys
import time

import pytest

from run_history import history, joined

pytestmark = pytest.mark.slow


def test_an_exception_inside_a_role_reaches_the_terminal_with_its_traceback(ray_cluster, tiny_run, tmp_path):
    """trainer.fault raises inside the actor's worker, the vLLM engine and the reward router in
    iteration 2 of `python -m orz.train` on the quiet console (three runs side by side on the
    suite's Ray cluster, each started once the previous one has joined it): the terminal (not the
    logs) shows the traceback, where it was raised, and one `orz:` line naming the iteration, the
    phase and the last checkpoint; each run exits 1 without a restart (only a lost worker restarts
    the run)."""
    origins = {  # role: (its phase, where the traceback says it was raised, where the orz: line says)
        "actor": ("update", "repr=actor-0", "(raised in actor-0, MegatronWorker.train_actor)"),  # Ray's line over
        "engine": ("rollout", "repr=engine-0", "(raised in engine-0, VLLMEngine.serve)"),  # the actor's traceback
        "reward": ("rollout", 'orz/reward/router.py", line', "the reward router's"),  # the trainer's own process
    }
    runs = {}
    for role in origins:
        out = tmp_path / role
        out.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "orz.train", *tiny_run(out, "grpo", iterations=2), "data.eval={}",
                                 f"trainer.fault={role}@2", joined(ray_cluster)], stdout=(out / "stdout.txt").open("w"),
                                stderr=(out / "stderr.txt").open("w"))
        runs[role] = out, proc
        deadline = time.time() + 300  # one run joining at a time
        while "orz: starting roles" not in (out / "stdout.txt").read_text() and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.2)
    for role, (phase, origin, named) in origins.items():
        out, proc = runs[role]
        code = proc.wait(timeout=600)
        stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
        assert code == 1, stdout + stderr
        assert "Traceback (most recent call last)" in stderr and origin in stderr, stderr
        assert f"InjectedFault: trainer.fault={role}@2: injected into" in stderr, stderr
        (failed,) = [line for line in stdout.splitlines() if line.startswith("orz: iteration")]
        assert failed.startswith(f"orz: iteration 2 failed in its {phase} phase: InjectedFault: ") and named in failed
        assert failed.endswith(f"The last checkpoint: {out / 'checkpoints/iter_000001'}"), failed
        assert "died" not in stdout and "restart" not in stdout
        assert [row["step"] for row in history(out)] == [0, 1]  # iteration 2 left no trace
