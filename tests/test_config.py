"""The config tree: presets, overrides, strict keys and types, stages, recipes."""
import pytest

from orz.config import ConfigError, ExperimentConfig, StageConfig, load_config, save_config, stage_at, total_iterations


def test_overrides_parse_values_as_yaml():
    cfg = load_config(None, ["trainer.iterations=20", "actor.lr=1e-6", "algorithm.dual_clip=3",
                             "rollout.stop=['</answer>']", "data.synthetic_digits=[1, 3]", "algorithm.kl_target=null"])
    assert cfg.trainer.iterations == 20 and cfg.actor.lr == 1e-6 and cfg.algorithm.dual_clip == 3.0
    assert cfg.rollout.stop == ["</answer>"] and cfg.data.synthetic_digits == (1, 3)
    assert cfg.algorithm.kl_target is None


@pytest.mark.parametrize("override,message", [
    ("trainer.iteration=3", "unknown key 'trainer.iteration'"),
    ("trainer.iterations=many", r"config.trainer.iterations: expected int, got 'many'"),
    ("actor.lr=fast", r"config.actor.lr: expected float, got 'fast'"),
    ("nonsense", "must look like key.sub=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_dict_fields_take_a_whole_mapping_or_one_key(tmp_path):
    cfg = load_config(None, ["reward.weights={format: 0.5}", "reward.weights.length=1", "rollout.envs.echo=turn_envs:Echo",
                             "data.eval.arith=synthetic:arithmetic"])
    assert cfg.reward.weights == {"format": 0.5, "length": 1.0} and cfg.rollout.envs == {"echo": "turn_envs:Echo"}
    assert cfg.data.eval == {"arith": "synthetic:arithmetic"}
    assert load_config(None, ["reward.weights.a=1", "reward.weights={b: 2}"]).reward.weights == {"b": 2.0}  # replaced
    (tmp_path / "envs.yaml").write_text("rollout:\n  envs:\n    echo: turn_envs:Echo\nreward:\n  weights:\n    echo: 2\n")
    cfg = load_config(tmp_path / "envs.yaml")
    assert cfg.rollout.envs == {"echo": "turn_envs:Echo"} and cfg.reward.weights == {"echo": 2.0}
    for bad, key in (("reward.weights.a.b=1", "reward.weights.a"), ("reward.weights.a=heavy", "reward.weights.a"),
                     ("trainer.iterations.x=1", "trainer.iterations.x")):
        with pytest.raises(ConfigError, match=rf"\b{key}\b"):
            load_config(None, [bad])


def test_yaml_preset_round_trip_and_unknown_key(tmp_path):
    cfg = load_config("configs/tiny_grpo.yaml", ["trainer.iterations=7"])
    assert cfg.algorithm.advantage == "grpo" and cfg.trainer.iterations == 7
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg  # the saved config reproduces the run
    (tmp_path / "bad.yaml").write_text("trainer:\n  iterationz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: .*unknown key 'trainer.iterationz'"):
        load_config(tmp_path / "bad.yaml")


def test_stages_apply_their_overrides_by_iteration():
    cfg = ExperimentConfig(stages=[StageConfig(2, {"rollout.max_new_tokens": 8}),
                                   StageConfig(3, {"rollout.max_new_tokens": 16, "actor.lr": 1e-7})])
    assert total_iterations(cfg) == 5
    assert [stage_at(cfg, i)[0] for i in range(5)] == [0, 0, 1, 1, 1]
    assert stage_at(cfg, 1)[1].rollout.max_new_tokens == 8
    assert stage_at(cfg, 4)[1].rollout.max_new_tokens == 16 and stage_at(cfg, 4)[1].actor.lr == 1e-7
    with pytest.raises(ConfigError, match="unknown key"):
        stage_at(ExperimentConfig(stages=[StageConfig(1, {"rollout.max_tokens": 8})]), 0)


def test_recipes_state_orz_settings():
    from playground.orz_7b_ppo import RECIPE as PPO
    from playground.orz_32b_ppo import RECIPE as PPO_32B
    from playground.skywork_or1_grpo import RECIPE as SKYWORK

    assert (PPO.trainer.prompts_per_iteration, PPO.rollout.n_samples) == (128, 64)
    assert (PPO.algorithm.gamma, PPO.algorithm.lam, PPO.algorithm.kl_coef) == (1.0, 1.0, 0.0)
    assert (PPO.actor.lr, PPO.critic.lr, PPO.critic.steps_per_iteration) == (1e-6, 5e-6, 12)
    assert (PPO_32B.actor.tp, PPO_32B.actor.pp) == (8, 2)
    assert [stage_at(SKYWORK, i)[1].rollout.max_new_tokens for i in (0, 300, 600)] == [8192, 16384, 32768]
    assert SKYWORK.algorithm.entropy_target is not None


def test_unknown_keys_suggest_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown key 'actor.lrr' \(did you mean 'actor.lr'\?\)"):
        load_config(None, ["actor.lrr=1e-6"])
    with pytest.raises(ConfigError, match=r"unknown key 'rolout' \(did you mean 'rollout'\?\)"):
        load_config(None, ["rolout.max_new_tokens=8"])


