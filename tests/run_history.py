"""What the end-to-end tests read back from a run's output directory, and the processes of a run."""
import contextlib
import json
import os
import re
from pathlib import Path

import psutil

# Timings differ from run to run; everything else must not.
NONDETERMINISTIC = ("timing/", "throughput/", "reward/verify_", "cpu_s", "sync_seconds", "wall_s", "perf/peak_memory",
                    "goodput/", "mfu/", "perf/peak_flops", "perf/copy_gbps", "perf/timeline")


def history(out) -> list[dict]:
    """metrics.jsonl, a dict per line (step 0: the evaluation before training)."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without the figures that depend on the machine's speed."""
    return {k: v for k, v in row.items() if not any(part in k for part in NONDETERMINISTIC)}


def resume_problems(out, before: bytes, console: str, checkpoint: int) -> list[str]:
    """What tells a run that resumed from out/checkpoints/iter_`checkpoint` from a fresh rerun:
    one `orz:` line on its console naming that checkpoint; metrics.jsonl keeping the rows up to
    the checkpoint's step byte for byte as they were before (`before`: the file's bytes then,
    timings included, which a rerun would rewrite), dropping only the later ones (an iteration
    the checkpoint does not hold), and going on from the next step, each step once. [] if so."""
    problems, out = [], Path(out)
    expected = f"orz: resumed from {out / 'checkpoints' / f'iter_{checkpoint:06d}'} at iteration {checkpoint}"
    said = [line for line in console.splitlines() if line.startswith("orz: resumed")]
    if said != [expected]:
        problems.append(f"the console says {said}, not [{expected!r}]")
    kept = b"".join(line + b"\n" for line in before.splitlines() if json.loads(line)["step"] <= checkpoint)
    if [json.loads(line)["step"] for line in kept.splitlines()] != list(range(checkpoint + 1)):
        problems.append(f"the file before the resume lacks rows up to step {checkpoint}")
    after = (out / "metrics.jsonl").read_bytes()
    if not after.startswith(kept):
        problems.append(f"metrics.jsonl's rows up to step {checkpoint} were not kept byte for byte")
    steps = [json.loads(line)["step"] for line in after.splitlines()]
    if steps[: checkpoint + 1] != list(range(checkpoint + 1)) or steps != list(range(len(steps))):
        problems.append(f"metrics.jsonl's steps are {steps}")
    return problems


def prompts_by_iteration(out) -> list[list[str]]:
    """Each iteration's prompts, as its samples/iter_N_draws.jsonl lists them (one per sample)."""
    return [[json.loads(line)["prompt"] for line in path.read_text().splitlines()]
            for path in sorted((Path(out) / "samples").glob("iter_*_draws.jsonl"))]


def check_resumed(out, before: bytes, console: str, checkpoint: int, reference) -> None:
    """`out` resumed from its iter_`checkpoint` (resume_problems) and continued to the metrics of
    the uninterrupted run `reference` (its output directory)."""
    problems = resume_problems(out, before, console, checkpoint)
    assert not problems, "\n".join(problems)
    resumed, whole = history(out), history(reference)
    assert [row["step"] for row in resumed] == [row["step"] for row in whole]
    for mine, ref in zip(resumed[checkpoint + 1:], whole[checkpoint + 1:]):
        assert deterministic(mine) == deterministic(ref)


def ray_sessions(processes) -> set[str]:
    """The Ray session directories (…/session_<date>_<pid of the driver that started it>) these
    processes have files open in."""
    sessions = set()
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            sessions |= {m.group(1) for f in proc.open_files() if (m := re.match(r"(.*/session_[^/]+)/", f.path))}
    return sessions


def processes_of_run(tree, sessions) -> set:
    """What is left of a run: the processes of its tree as seen while it ran (psutil compares pid
    and start time, so a reused pid is not taken for one), every process with a file open in one
    of its Ray session directories (Ray renames its workers `ray::IDLE`, `ray::MegatronWorker…`:
    their command line does not say whose they are), and every process whose raylet was the run's."""
    raylets = {str(p.pid) for p in tree if title(p) == "raylet"}
    prefixes = tuple(f"{s}/" for s in sessions)
    left = set()
    for proc in [*tree, *psutil.process_iter()]:
        with contextlib.suppress(psutil.Error):
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc in tree or proc.environ().get("RAY_RAYLET_PID") in raylets \
                    or any(f.path.startswith(prefixes) for f in proc.open_files()):
                left.add(proc)
    return left


def joined(ray_cluster) -> str:
    """The override that runs a command on the suite's Ray cluster instead of a cluster of its own:
    a cluster's start costs a run ~15 s on two cores."""
    return f"trainer.ray_address={ray_cluster.get_runtime_context().gcs_address}"


def title(proc) -> str:
    """A process's name as its command line gives it (Ray's workers: `ray::VLLMEngine.serve`)."""
    with contextlib.suppress(psutil.Error, IndexError):
        return os.path.basename(proc.cmdline()[0])
    return "?"


def kill_run(proc) -> None:
    """SIGKILLs a run started with start_new_session, and every process of it: its Ray cluster if
    it started one (a session directory named after its pid); on a cluster it joined (joined),
    Ray ends the actors of a driver that died."""
    run = psutil.Process(proc.pid)
    tree = {run, *run.children(recursive=True)}
    sessions = {session for session in ray_sessions(tree) if session.endswith(f"_{proc.pid}")}
    for victim in [run, *processes_of_run(tree, sessions)]:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    proc.wait()


def _wandb_log_records(path: Path):
    """The protobuf payloads of a .wandb file: LevelDB's log format (32 KiB blocks of records, each
    a 7-byte header — checksum, little-endian length, type: full, first, middle, last) after a
    7-byte ':W&B' header. wandb 0.31 ships no Python reader of its own (wandb-core writes it)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding at the end of a block
            continue
        parts.append(payload)
        if kind in (1, 4):  # a full record, or the last part of one
            yield b"".join(parts)
            parts = []


def wandb_records(out):
    """(run ids, display names, config, history steps) from every offline run under out/wandb."""
    from wandb.proto import wandb_internal_pb2

    ids, names, config, steps = set(), set(), {}, []
    for path in sorted(Path(out).glob("wandb/offline-run-*/run-*.wandb")):
        for data in _wandb_log_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                names.add(record.run.display_name)
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
            elif kind == "history":
                steps.append(record.history.step.num)
    return ids, names, config, steps


def check_export_of_the_checkpoint(out, exported, model, iteration=2, like=None) -> None:
    """`orz convert mcore2hf` on iteration `iteration`'s checkpointed actor (saved by ranks that
    each held a TP shard, a stage or an EP rank's experts), with no `--like` unless `like` (a
    wrapper's vision tower, which a trainer's checkpoint does not hold), writes what
    trainer.export_hf wrote at that iteration, bit for bit and in the model's dtype; transformers
    loads it as the checkpoint's class, and its tokenizer is the starting model's (`model`): the
    same vocabulary and chat template, from the files the run kept (run/hf_files)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from orz.convert import main as convert

    assert convert(["mcore2hf", "--mcore", str(Path(out) / f"checkpoints/iter_{iteration:06d}/actor"), "--out",
                    str(exported), *(["--like", str(like)] if like else [])]) == 0
    ours, theirs = load_file(Path(exported) / "model.safetensors"), load_file(Path(out) / "hf/model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].dtype == theirs[name].dtype for name in ours)
    config = json.loads((Path(exported) / "config.json").read_text())
    [architecture] = config["architectures"]
    getattr(transformers, architecture).from_pretrained(exported)
    tokenizer, start = (transformers.AutoTokenizer.from_pretrained(path) for path in (exported, model))
    assert tokenizer.get_vocab() == start.get_vocab() and start.chat_template
    assert tokenizer.chat_template == start.chat_template
