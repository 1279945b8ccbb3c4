"""orz/timeline's parts on their own: the recorder, the file (cap, sub-lanes, a kill, a resume),
the clock offset, goodput from spans, and the picture. Expected figures are worked by hand
here; the file is read by the tests' own Chrome trace reader (timeline_checks.read_trace)."""
import json
import time

import pytest
from PIL import Image

from orz.timeline.figures import Resource, gaps, goodput, union_seconds
from orz.timeline.picture import draw, figure_size
from orz.timeline.record import SPAN, Recorder
from orz.timeline.trace import CAP_PER_LANE, Timeline, capped, load, offset_s
from timeline_checks import lane_names, read_trace


class Clock:
    """A clock a test moves by hand."""

    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_a_span_is_recorded_when_its_block_raises_and_an_open_one_is_cut_at_each_drain():
    rec, clock = Recorder(), Clock()
    rec.clock = clock
    with pytest.raises(ValueError):
        with rec.span("actor/rank 0", "update", tokens=8):
            clock.t = 103.0
            raise ValueError("a failed pass still took its time")
    token = rec.begin("engines/engine 0", "busy")
    clock.t = 105.0
    first = rec.drain()  # the open span's part so far: [103, 105)
    clock.t = 109.0
    rec.end(token)
    second = rec.drain()
    assert first == [(SPAN, "actor/rank 0", "update", 100.0, 3.0, {"tokens": 8}),
                     (SPAN, "engines/engine 0", "busy", 103.0, 2.0, {})]
    assert second == [(SPAN, "engines/engine 0", "busy", 105.0, 4.0, {})]
    rec.on = False
    rec.add("x/y", "z", 0.0, 1.0)
    assert rec.begin("x/y", "z") == 0 and rec.drain() == []


def test_beyond_its_cap_a_lane_merges_its_spans_per_name_and_keeps_its_last_counter():
    events = [(SPAN, "reward/math", "score", float(i), 0.5, {}) for i in range(CAP_PER_LANE + 3)]
    events += [("C", "reward/math", "queued", float(i), 0.0, {"value": i}) for i in range(CAP_PER_LANE, CAP_PER_LANE + 2)]
    events.append((SPAN, "trainer/phases", "step", 0.0, 1.0, {}))
    kept = capped(events)
    spans = [e for e in kept if e[1] == "reward/math" and e[0] == SPAN]
    # The cap counts a lane's events in start order: the first CAP_PER_LANE are spans 0..cap−1 (the
    # counters start at `cap`); the 3 spans and 2 counters left become one span and one counter.
    kept_spans = [e for e in spans if "×" not in e[2]]
    merged = [e for e in spans if "×" in e[2]]
    assert len(kept_spans) == CAP_PER_LANE and len(merged) == 1
    first, last = CAP_PER_LANE, CAP_PER_LANE + 2  # starts of the 3 merged spans
    assert merged[0][2:] == ("score ×3", float(first), last + 0.5 - first, {"calls": 3, "busy_s": 1.5})
    assert [e[5]["value"] for e in kept if e[0] == "C"] == [CAP_PER_LANE + 1]
    assert (SPAN, "trainer/phases", "step", 0.0, 1.0, {}) in kept


def test_the_file_loads_after_a_kill_cut_a_line_and_a_resume_appends_to_it_with_the_same_lanes(tmp_path):
    path = tmp_path / "timeline.json"
    timeline = Timeline(path, resume=False)
    overlapping = [(SPAN, "reward/math", "score", 10.0, 4.0, {}), (SPAN, "reward/math", "score", 11.0, 1.0, {}),
                   (SPAN, "reward/math", "score", 12.0, 5.0, {}), (SPAN, "trainer/phases", "step", 10.0, 8.0, {}),
                   (SPAN, "trainer/phases", "update", 11.0, 2.0, {})]
    timeline.add(overlapping)
    timeline.flush(1)
    first = read_trace(path)
    names = lane_names(first)
    lane_of = {(e["name"], e["ts"]): names[e["pid"], e["tid"]] for e in first if e["ph"] == "X"}
    # 11–12 nests in 10–14; 12–17 overlaps 10–14 without nesting: a sub-lane. Nested phases stay together.
    assert [lane_of["score", t * 1e6] for t in (10.0, 11.0, 12.0)] == ["reward/math", "reward/math", "reward/math #2"]
    assert lane_of["step", 10e6] == lane_of["update", 11e6] == "trainer/phases"
    with path.open("a") as f:
        f.write('{"ph": "X", "name": "cut by a ki')  # SIGKILL mid-line
    assert read_trace(path) == first and load(path) == first
    resumed = Timeline(path, resume=True)
    resumed.add([(SPAN, "trainer/phases", "step", 20.0, 1.0, {}), (SPAN, "sync/actor", "send", 20.5, 0.1, {})])
    resumed.flush(2)
    resumed.close(clock=lambda: 21.0)
    whole = json.loads(path.read_text())  # finished: strict JSON
    assert whole[: len(first)] == first  # the killed part as it was, then the resumed one
    steps = [e for e in whole if e["ph"] == "X" and e["name"] == "step"]
    assert len({(e["pid"], e["tid"]) for e in steps}) == 1  # one lane across both parts
    assert lane_names(whole)[steps[1]["pid"], steps[1]["tid"]] == "trainer/phases"
    again = Timeline(path, resume=True)  # a finished file reopened: its "]" gives way
    again.add([(SPAN, "trainer/phases", "step", 30.0, 1.0, {})])
    again.flush(3)
    assert [e["args"]["iteration"] for e in read_trace(path) if e["ph"] == "X" and e["name"] == "step"] == [1, 2, 3]


def test_a_clock_offset_is_measured_within_half_the_round_trip():
    local, skew = Clock(1000.0), 5.0

    def remote_now():  # answers mid-way through a call of 0.2 s (the shortest of three)
        local.t += 0.1
        reading = local.t + skew
        local.t += 0.1
        return reading

    assert offset_s(remote_now, local) == pytest.approx(skew, abs=1e-9)
    assert abs(offset_s(lambda: time.time() + 2.0) - 2.0) < 0.01


def test_goodput_is_the_union_of_useful_spans_over_the_window_weighed_by_devices():
    window = (10.0, 20.0)
    events = [(SPAN, "engines/engine 0", "busy", 8.0, 4.0, {}),  # 10–12 counts: 2 s
              (SPAN, "engines/engine 0", "busy", 15.0, 3.0, {}),  # 3 s
              (SPAN, "engines/engine 0", "weight sync", 18.0, 1.0, {}),  # not useful
              (SPAN, "actor/rank 0", "update", 11.0, 6.0, {}),  # 6 s, with a nested forward
              (SPAN, "actor/rank 0", "forward", 12.0, 1.0, {}),
              (SPAN, "actor/rank 1", "update", 11.0, 4.0, {}),
              (SPAN, "actor/rank 1", "update", 1011.0, 4.0, {})]  # a skewed clock's: outside, counts nothing
    resources = [Resource("engine_0", ("engines/engine 0",), 1, useful=("busy",)),
                 Resource("actor", ("actor/rank 0", "actor/rank 1"), 2)]
    figures = goodput(events, window, resources)
    assert figures["goodput/engine_0"] == pytest.approx(5 / 10)
    assert figures["goodput/actor"] == pytest.approx((6 + 4) / 2 / 10)
    # device-seconds: engine 1·5, actor 2·(6 + 4) over 1·10 + 2·2·10
    assert figures["goodput/machine"] == pytest.approx((5 + 20) / (10 + 40))
    assert union_seconds([(0, 2), (1, 3), (5, 6)], (0, 10)) == pytest.approx(4)
    assert union_seconds([(1, 2), (12, 13), (-5, -4)], (0, 10)) == pytest.approx(1)  # outside: nothing
    assert gaps([(3, 5), (1, 2), (4, 4.5), (9, 12)], (0, 10)) == [(0, 1), (2, 3), (5, 9)]  # an engine's idle spans


def test_the_picture_has_a_row_per_lane_of_the_last_iterations(tmp_path):
    path = tmp_path / "timeline.json"
    timeline = Timeline(path, resume=False)
    for i in range(1, 5):
        lanes = ["trainer/phases", "actor/rank 0", "engines/engine 0"] + (["environments/python"] if i == 1 else [])
        timeline.add([(SPAN, lane, "work", 10.0 * i, 2.0, {}) for lane in lanes])
        timeline.add([(SPAN, "engines/engine 0", "weight sync", 10.0 * i + 1, 2.0, {})])  # a sub-lane: its lane's row
        timeline.flush(i)
    assert "engines/engine 0 #2" in lane_names(read_trace(path)).values()
    shown = draw(path, tmp_path / "timeline.png", last=3)
    assert shown == ["trainer/phases", "actor/rank 0", "engines/engine 0"]  # iteration 1's extra lane is not shown
    image = Image.open(tmp_path / "timeline.png")
    assert image.format == "PNG" and image.size == figure_size(3) != figure_size(4)


def test_orz_plot_draws_both_pictures_and_refuses_a_directory_without_a_run(tmp_path, capsys):
    from orz.plot import main as plot

    assert plot([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"orz plot: {tmp_path} has no metrics.jsonl and no timeline.json (is it a run's output_dir? "
        "trainer.timeline=false writes no timeline.json)")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": i / 4}) + "\n" for i in range(3)))
    timeline = Timeline(tmp_path / "timeline.json", resume=False)
    timeline.add([(SPAN, "trainer/phases", "step", 1.0, 2.0, {})])
    timeline.flush(1)  # not closed: a run still going
    assert plot([str(tmp_path), "--last", "1"]) == 0
    assert Image.open(tmp_path / "curves.png").format == Image.open(tmp_path / "timeline.png").format == "PNG"
    assert "(1 lanes, the last 1 iterations)" in capsys.readouterr().out
