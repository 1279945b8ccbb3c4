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
