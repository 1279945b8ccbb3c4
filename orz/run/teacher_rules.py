"""What a run's teachers and distill settings must satisfy (docs/distillation.md), checked before
any worker starts: each teacher's model exists and writes the student's token ids, the routes name
defined teachers and every teacher serves some rows, and no distill setting is set where it cannot act.

    teacher_archs(cfg)              # {"teachers.big": ModelArch}: what run_rules sizes each teacher's role against
    teacher_problems(cfg, arch)     # one line per problem, naming the key or the file
"""
from __future__ import annotations

from pathlib import Path

from orz.config import ANY_SOURCE, DistillConfig, ExperimentConfig
from orz.models.arch import ModelArch, ModelConfigError, read_arch
from orz.models.presets import MODELS
from orz.run.placement import teacher_roles


def teacher_archs(cfg: ExperimentConfig) -> dict[str, ModelArch]:
    """Each teacher role's architecture: its HF directory's config.json, or a preset of that name
    (the planner's recipes); a teacher whose path is neither is left out (teacher_problems names it)."""
    archs = {}
    for role, name in teacher_roles(cfg).items():
        path = cfg.teachers[name].path
        try:
            archs[role] = MODELS[path] if path in MODELS else read_arch(path)
        except ModelConfigError:
            continue
    return archs


def teacher_problems(cfg: ExperimentConfig, arch: ModelArch | None) -> list[str]:
    """Every problem of the run's teachers against the student (arch: its architecture, or None)."""
    if not cfg.teachers:
        unused = [f"distill.{key}" for key, value in vars(cfg.distill).items() if value != getattr(DistillConfig(), key)]
        return [f"{', '.join(unused)} set, and the run has no teachers: define one (teachers.NAME.path=/hf/teacher), "
                "or unset them"] if unused else []
    problems = _route_problems(cfg) + _setting_problems(cfg.distill)
    for name, teacher in cfg.teachers.items():
        key = f"teachers.{name}.path"
        if not teacher.path:
            problems.append(f"{key} is not set: give the teacher's HF model directory")
            continue
        if teacher.path not in MODELS:
            try:
                read_arch(teacher.path)
            except ModelConfigError as err:
                problems.append(f"{key}={teacher.path}: {err}")
                continue
            problems += _tokenizer_problems(key, cfg.model.path, teacher.path)
    if arch is not None and cfg.distill.objective == "topk_forward_kl" and cfg.distill.top_k > arch.vocab_size:
        problems.append(f"distill.top_k={cfg.distill.top_k} is beyond the student's vocabulary of {arch.vocab_size} "
                        "tokens")
    return problems


def _route_problems(cfg: ExperimentConfig) -> list[str]:
    """Routes name defined teachers; several teachers need routes; each teacher serves some source."""
    routes, names = cfg.distill.routes, list(cfg.teachers)
    problems = [f"distill.routes.{source}={name!r} routes to a teacher that is not defined (teachers: "
                f"{', '.join(names)})" for source, name in routes.items() if name not in cfg.teachers]
    if not routes and len(names) > 1:
        problems.append(f"teachers {', '.join(names)}: with several teachers, distill.routes must say whose rows each "
                        f"scores (data_source -> teacher, '{ANY_SOURCE}' for every other source)")
    if routes:
        problems += [f"teachers.{name} is defined, and no distill.routes entry routes rows to it: route a data_source "
                     "to it, or remove it" for name in names if name not in routes.values()]
    return problems


def _setting_problems(d: DistillConfig) -> list[str]:
    """distill settings that the chosen objective would ignore."""
    default, problems = DistillConfig(), []
    if d.objective == "reverse_kl" and d.top_k != default.top_k:
        problems.append(f"distill.top_k={d.top_k} applies to distill.objective=topk_forward_kl only; unset it")
    if d.objective == "topk_forward_kl" and d.student_logprobs != default.student_logprobs:
        problems.append(f"distill.student_logprobs={d.student_logprobs} chooses the log-probs of the reverse-KL "
                        "advantage; distill.objective=topk_forward_kl reads the student's own in its loss: unset it")
    return problems


def _tokenizer_problems(key: str, student: str, teacher: str) -> list[str]:
    """The teacher's tokenizer must give the student's ids for every token (its vocabulary may add
    padding rows to the model, not tokens to the tokenizer): the first differing token is named."""
    if not Path(student).is_dir():
        return []  # a preset (the planner): no tokenizer to compare
    from orz.data.tokenizers import load_tokenizer

    try:
        theirs = load_tokenizer(teacher).get_vocab()
    except (OSError, ValueError) as err:
        return [f"{key}={teacher}: its tokenizer cannot be read ({err})"]
    ours = load_tokenizer(student).get_vocab()
    if ours == theirs:
        return []
    token = min(set(ours.items()) ^ set(theirs.items()), key=lambda item: (item[1], item[0]))[0]
    return [f"{key}={teacher}: its tokenizer gives other ids than the student's ({student}): token {token!r} is "
            f"{ours.get(token, 'absent')} for the student, {theirs.get(token, 'absent')} for the teacher; a teacher "
            "must share the student's tokenizer"]
