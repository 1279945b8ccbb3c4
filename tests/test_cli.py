"""The `orz` command dispatches to each module's own main."""
import subprocess
import sys

from orz import cli


def test_orz_lists_its_commands_and_refuses_an_unknown_one(capsys):
    assert cli.main([]) == 2
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in cli.COMMANDS)
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_orz_train_is_python_m_orz_train(capsys):
    assert cli.main(["train", "trainer.iterations=3"]) == 2  # no model.path: the trainer's own refusal
    assert "model.path is not set" in capsys.readouterr().err
    assert cli.main(["train", "actor.lrr=1"]) == 2
    assert "did you mean 'actor.lr'" in capsys.readouterr().err


def test_the_console_script_runs_plan():
    out = subprocess.run([sys.executable, "-m", "orz.cli", "plan", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--cluster CLUSTER" in out.stdout


def test_a_ctrl_c_lost_in_a_del_is_raised_again():
    """Python runs a signal's handler at whatever bytecode the main thread reaches next; one that
    lands in a `__del__` (Ray's ObjectRefGenerator has one, dropped in the trainer's thread by
    every engine stream that ends) is printed as ignored and lost: once a run went on to its end
    and exited 0. The run's handler raises it again until the run has caught it."""
    import gc
    import signal
    import time

    import pytest

    from orz.stopping import StopSignals, Stopped

    lost = []

    class DroppedInTheMainThread:
        def __del__(self):
            try:
                signal.raise_signal(signal.SIGINT)  # the handler runs here, inside __del__
            except BaseException as err:  # what CPython does with it: printed and dropped
                lost.append(err)

    before = signal.getsignal(signal.SIGINT)  # the suite's own (Ray may have set it)
    signals = StopSignals()
    signals.install()
    try:
        with pytest.raises(Stopped) as stopped:
            DroppedInTheMainThread()
            gc.collect()
            assert lost and isinstance(lost[0], Stopped)  # the first raise was lost...
            time.sleep(10)  # ...and the run would have carried on
        assert stopped.value.signum == signal.SIGINT
        signals.caught()
        signal.raise_signal(signal.SIGINT)  # shutting down: ignored
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_malformed_fault_is_refused_before_anything_starts(capsys):
    from orz import train

    assert train.main(["model.path=/nonexistent", "trainer.fault=critic@2"]) == 2
    assert "trainer.fault='critic@2' must be ROLE@ITERATION" in capsys.readouterr().err


def test_a_malformed_yaml_override_is_one_error_line_naming_it():
    """A YAML flow value the shell cut ('rollout.envs={x:' without quotes around a space) ends in
    one `error:` line naming the argument and what YAML expected, and exit status 2."""
    out = subprocess.run([sys.executable, "-m", "orz.train", "rollout.envs={x:"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: override 'rollout.envs={x:': its value is not valid YAML (expected the node content, "
                     "but found '<stream end>', while parsing a flow node); quote the whole key=value for the "
                     "shell, e.g. 'rollout.envs={x: y}'"], out.stderr
