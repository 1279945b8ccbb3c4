"""What every end-to-end run's timeline.json must satisfy (orz/timeline), read by a Chrome trace
reader of the tests' own (not orz's `load`): the checks of `check_timeline` hold for any run,
resumed or restarted, synchronous or not."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

TOLERANCE_S = 1e-3  # the bound between a timing/* figure and its spans
PASSES = ("update", "log-probs", "teacher log-probs", "values", "scores")  # a rank's work
LINE_UP_S = 0.05  # a worker's span within its trainer phase: the offset's error is half a round trip


def read_trace(path) -> list[dict]:
    """Chrome's JSON array format, parsed object by object: the closing "]" may be missing and the
    last object cut (a killed writer); everything up to the last whole object is read."""
    text, decoder, events = Path(path).read_text(), json.JSONDecoder(), []
    assert text.startswith("["), f"{path}: not a JSON array"
    at = 1
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return events
        try:
            event, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return events
        events.append(event)


def lane_names(events: list[dict]) -> dict[tuple[int, int], str]:
    party = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return {(e["pid"], e["tid"]): f"{party[e['pid']]}/{e['args']['name']}"
            for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def spans_by_iteration(events: list[dict]) -> dict[int, list[tuple[str, dict]]]:
    """iteration -> its (lane, span) pairs, from the last part of the run that logged it (a part
    begins at each "run started" instant; a killed part may have logged an iteration run again)."""
    names, parts, part = lane_names(events), [], None
    for e in events:
        if e["ph"] == "i" and e["name"] == "run started":
            part = defaultdict(list)
            parts.append(part)
        elif e["ph"] == "X" and part is not None:
            part[e["args"]["iteration"]].append((names[e["pid"], e["tid"]], e))
    merged = {}
    for part in parts:
        merged |= part
    return merged


def union_s(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    covered, total = [], 0.0
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi):
        if covered and a <= covered[-1][1]:
            covered[-1][1] = max(covered[-1][1], b)
        else:
            covered.append([a, b])
    return sum(b - a for a, b in covered)


def check_timeline(out, history: list[dict]) -> dict[int, list[tuple[str, dict]]]:
    """The file loads; lanes never overlap themselves; each iteration's timing/* figures are its
    spans' sums, its overlap and idle figures what the spans give, its goodput/* the spans' union
    over its `step`; every worker's span lies inside its iteration's `train` phase (clock offsets).
    Returns the spans by iteration."""
    events = read_trace(Path(out) / "timeline.json")
    assert events and all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    by_lane = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_lane[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans in by_lane.items():  # nested or apart, never half over each other (0.2 µs: rounding)
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends = []
        for start, end in spans:
            while open_ends and open_ends[-1] <= start + 0.2:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 0.2, f"lane {lane_names(events)[lane]} overlaps itself"
            open_ends.append(end)
    by_iteration = spans_by_iteration(events)
    for row in history[1:]:
        i, spans = row["step"], by_iteration[row["step"]]

        def seconds(lane, name, **args):
            return sum(e["dur"] for l, e in spans if l == lane and e["name"] == name
                       and all(e["args"].get(k) == v for k, v in args.items())) / 1e6

        for key in (k for k in row if k.startswith("timing/")):
            phase = key.removeprefix("timing/")
            if phase in ("rollout", "reward_wait"):  # the batch's, built here or in an iteration before
                batch = [e for l, e in by_iteration.get(i, []) + by_iteration.get(i - 1, [])
                         if l == "trainer/rollout" and e["name"] == phase and e["args"]["batch"] == i]
                assert abs(sum(e["dur"] for e in batch) / 1e6 - row[key]) < TOLERANCE_S, (i, key)
            elif phase not in ("overlap_rollout_train", "idle_engines", "idle_actor", "tool"):
                assert abs(seconds("trainer/phases", phase) - row[key]) < TOLERANCE_S, (i, key, row[key])
        phase = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for l, e in spans if l == "trainer/phases"}
        ahead = [e for l, e in spans if l == "trainer/pipeline" and e["args"]["batch"] == i + 1]
        passes = [phase[p] for p in ("forward", "update")]
        overlap = sum(union_s([(e["ts"], e["ts"] + e["dur"])], *p) for e in ahead for p in passes) / 1e6
        assert abs(overlap - row["timing/overlap_rollout_train"]) < TOLERANCE_S, i
        busy = sum(b - a for a, b in passes) / 1e6 - overlap
        assert abs(busy - row["timing/idle_engines"]) < TOLERANCE_S, i
        step = phase["step"]
        wall = (step[1] - step[0]) / 1e6
        for key in (k for k in row if k.startswith("goodput/") and k != "goodput/machine"):
            resource = key.removeprefix("goodput/")
            if resource.startswith("engine_"):  # its busy spans
                lanes, names = [f"engines/engine {resource.removeprefix('engine_')}"], ("busy",)
            else:  # a role: each rank's passes (not its saves), the mean over ranks
                lanes, names = sorted({l for l, _ in spans if l.startswith(f"{resource}/rank ")}), PASSES
            shares = [union_s([(e["ts"], e["ts"] + e["dur"]) for l, e in spans
                               if l == lane and e["name"] in names], *step) / 1e6 / wall
                      for lane in lanes]
            assert lanes and abs(sum(shares) / len(shares) - row[key]) < 1e-4, (i, key)
        train = phase["train"]
        for lane, e in spans:
            if "/rank " in lane and e["name"] in PASSES:
                assert train[0] - LINE_UP_S * 1e6 <= e["ts"] and e["ts"] + e["dur"] <= train[1] + LINE_UP_S * 1e6, \
                    f"iteration {i}: {lane}'s {e['name']} lies outside the trainer's train phase"
        assert any("/rank " in lane and e["name"] == "update" for lane, e in spans), f"iteration {i}: no update span"
    return by_iteration


def check_plan_vs_run(out, by_iteration: dict[int, list[tuple[str, dict]]], staleness: int) -> dict:
    """plan_vs_run.json, written at the run's end: a prediction for every phase, and as the
    measurement the median over iterations (the first left out) of what the spans give."""
    comparison = json.loads((Path(out) / "plan_vs_run.json").read_text())
    rollouts = {e["args"]["batch"]: e["dur"] / 1e6 for spans in by_iteration.values() for lane, e in spans
                if lane == "trainer/rollout" and e["name"] == "rollout"}
    rows = []
    for i, spans in sorted(by_iteration.items()):
        phase = defaultdict(float)
        for lane, e in spans:
            if lane == "trainer/phases":
                phase[e["name"]] += e["dur"] / 1e6
        if "step" not in phase:
            continue
        ahead = [(e["ts"], e["ts"] + e["dur"]) for lane, e in spans if lane == "trainer/pipeline"]
        passes = [(e["ts"], e["ts"] + e["dur"]) for lane, e in spans
                  if lane == "trainer/phases" and e["name"] in ("forward", "update")]
        overlap = sum(union_s([a], *p) for a in ahead for p in passes) / 1e6
        rows.append({"generation": rollouts[i], "log-probs": phase["forward"], "update": phase["update"],
                     "sync": phase["sync"], "idle_engines": phase["forward"] + phase["update"] - overlap,
                     "idle_actor": phase["wait_rollout"] + (0.0 if staleness else rollouts[i]),
                     "iteration": phase["step"]})
    used = rows[1:] if len(rows) > 1 else rows
    assert comparison["iterations_measured"] == len(used)
    for name, row in comparison["phases"].items():
        values = sorted(r[name] for r in used)
        middle = len(values) // 2
        median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
        assert abs(row["measured_s"] - median) < 1e-6, name
        assert row["predicted_s"] >= 0
    assert set(comparison["phases"]) == {"generation", "log-probs", "update", "sync", "idle_engines", "idle_actor",
                                         "iteration"}
    return comparison


def check_generation_mfu(out, rows: list[dict], by_iteration: dict, model_dir) -> int:
    """mfu/generation = F / (busy·peak), worked here by hand: F = (2·M + 2·L·a·d·s)·n for the n
    prompt and response tokens of the iteration's batch (its sample dump), s their mean per
    sequence, M every matmul weight of the HF checkpoint (the LM head's, or the tied embedding's,
    included), over the engine's busy seconds in the step times the run's measured peak of one
    thread (an engine computes on one). Returns how many iterations it checked."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    matmul = sum(w.numel() for name, w in weights.items() if w.dim() == 2 and "embed_tokens" not in name)
    if "lm_head.weight" not in weights:  # tied: the LM head is the embedding
        matmul += weights["model.embed_tokens.weight"].numel()
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    checked = 0
    for row in rows[1:]:
        if "mfu/generation" not in row:
            continue
        i = row["step"]
        dump = (Path(out) / "samples" / f"iter_{i:06d}.jsonl").read_text().splitlines()
        lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in map(json.loads, dump)]
        tokens, mean = sum(lengths), sum(lengths) / len(lengths)
        flops = (2 * matmul + 2 * layers * heads * head_dim * mean) * tokens
        step = next((e["ts"], e["ts"] + e["dur"]) for lane, e in by_iteration[i]
                    if lane == "trainer/phases" and e["name"] == "step")
        busy = union_s([(e["ts"], e["ts"] + e["dur"]) for lane, e in by_iteration[i]
                        if lane == "engines/engine 0" and e["name"] == "busy"], *step) / 1e6
        expected = flops / (busy * row["perf/peak_flops_per_thread"])
        assert abs(row["mfu/generation"] - expected) <= 1e-3 * expected, (i, row["mfu/generation"], expected)
        checked += 1
    return checked
