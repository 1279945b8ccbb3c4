"""PromptLoader: resuming from a checkpoint replays the uninterrupted sequence; epochs reshuffle."""
import json

import pytest

from orz.data.sampler import PromptLoader

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(23)]


def _take(loader, n):
    return [[row["answer"] for row in next(loader)] for _ in range(n)]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_at", [0, 1, 4, 5, 11])
def test_resume_matches_uninterrupted_run(drop_last, stop_at):
    uninterrupted = _take(PromptLoader(ROWS, batch_size=5, seed=3, drop_last=drop_last), 20)
    first = PromptLoader(ROWS, batch_size=5, seed=3, drop_last=drop_last)
    head = _take(first, stop_at)
    state = json.loads(json.dumps(first.state_dict()))  # as it would go through a checkpoint
    resumed = PromptLoader(ROWS, batch_size=5, seed=3, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 20 - stop_at) == uninterrupted


def test_epochs_cover_rows_once_and_reshuffle():
    loader = PromptLoader(ROWS, batch_size=5, seed=0, drop_last=False)
    assert loader.batches_per_epoch == 5
    epochs = [sum(_take(loader, 5), []) for _ in range(3)]
    assert all(sorted(e, key=int) == [r["answer"] for r in ROWS] for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert loader.epoch == 2


def test_drop_last_skips_the_remainder():
    loader = PromptLoader(ROWS, batch_size=5, seed=0)
    assert loader.batches_per_epoch == 4
    assert all(len(b) == 5 for b in _take(loader, 9))


def test_seed_decides_the_order():
    same = [_take(PromptLoader(ROWS, 5, seed=s), 4) for s in (1, 1, 2)]
    assert same[0] == same[1] != same[2]


def test_state_for_other_data_is_refused():
    state = PromptLoader(ROWS, 5, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_rows"):
        PromptLoader(ROWS[:-1], 5, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(ROWS, 5, seed=1).load_state_dict(state)


def test_too_few_rows_is_an_error():
    with pytest.raises(ValueError, match="at least one batch"):
        PromptLoader(ROWS[:3], batch_size=5, seed=0)
