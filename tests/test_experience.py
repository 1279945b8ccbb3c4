"""orz.ppo.experience: Experience layout, batching, and gradient accumulation that
leaves the loss unchanged.

    .venv/bin/python -m pytest -q tests/test_experience.py
"""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orz.ppo import core_algos as ca
from orz.ppo.experience import Experience, MiniBatch

PROPERTY = settings(max_examples=30, deadline=None)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_experience(prompt_lengths, response_lengths, seed=0, holes=False):
    """Right-padded rows: prompt tokens, then response tokens, then 0s; random float fields."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    width = max(p + r for p, r in zip(prompt_lengths, response_lengths))
    response_width = max(max(response_lengths), 1)
    sequences = torch.zeros(batch, width, dtype=torch.long)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    response_mask = torch.zeros(batch, response_width)
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        sequences[row, :p + r] = torch.randint(1, 1000, (p + r,), generator=generator)
        attention_mask[row, :p + r] = 1
        response_mask[row, :r] = 1
    if holes:  # tool output inside a response: attended, not in the loss
        response_mask *= (torch.rand(batch, response_width, generator=generator) < 0.8).float()

    def per_token():
        return torch.randn(batch, response_width, generator=generator) * response_mask

    return Experience(sequences=sequences, attention_mask=attention_mask,
                      prompt_lengths=torch.tensor(prompt_lengths), response_mask=response_mask,
                      old_logprobs=per_token() - 1, ref_logprobs=per_token() - 1, values=per_token(),
                      advantages=per_token(), scores=torch.randint(0, 2, (batch,), generator=generator).float(),
                      group_index=torch.arange(batch) // 2, info={"row": torch.arange(batch)})


@st.composite
def experiences(draw, max_rows=8):
    rows = draw(st.integers(1, max_rows))
    prompts = draw(st.lists(st.integers(1, 5), min_size=rows, max_size=rows))
    responses = draw(st.lists(st.integers(0, 6), min_size=rows, max_size=rows))
    return make_experience(prompts, responses, seed=draw(st.integers(0, 10**6)), holes=draw(st.booleans()))


# ---------------------------------------------------------------------------------------------
# Layout


def test_response_positions_and_gather_response_by_hand():
    # row 0: prompt [11, 12], response [13, 14, 15]; row 1: prompt [21, 22, 23], response [24]
    experience = Experience(
        sequences=torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 0]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        prompt_lengths=torch.tensor([2, 3]),
        response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert experience.response_positions().tolist() == [[2, 3, 4], [3, 4, 4]]
    # a per-token result equal to the token id reads back the response ids, 0 on padding
    assert experience.gather_response(experience.sequences).tolist() == [[13, 14, 15], [24, 0, 0]]
    assert experience.sequence_lengths().tolist() == [5, 4]


@pytest.mark.parametrize("change, message", [
    (dict(response_mask=torch.ones(3, 3)), "response_mask has B = 3"),
    (dict(values=torch.zeros(2, 4)), "values has T = 4"),
    (dict(scores=torch.zeros(2, 1)), "scores must be a tensor with dims \\(B\\)"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])), "right-padded"),
    (dict(prompt_lengths=torch.tensor([3, 3])), "prompt_lengths"),
    (dict(prompt_lengths=torch.tensor([0, 3])), "prompt_lengths"),
    (dict(response_mask=torch.tensor([[1, 0.5, 1], [1, 0, 0]])), "response_mask must hold only 0 and 1"),
    (dict(info={"length": torch.zeros(3)}), "info\\['length'\\]"),
])
def test_experience_rejects_inconsistent_fields(change, message):
    fields = dict(sequences=torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 0]]),
                  attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
                  prompt_lengths=torch.tensor([2, 3]), response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]))
    with pytest.raises(ValueError, match=message):
        Experience(**(fields | change))


def test_select_concat_and_trim():
    short, long = make_experience([2, 1], [1, 2], seed=1), make_experience([3], [4], seed=2)
    joined = Experience.concat([short, long])
    assert joined.sequences.shape == (3, 7) and joined.response_mask.shape == (3, 4)
    assert torch.equal(joined.select([2]).sequences, long.sequences)
    assert torch.equal(joined.select([0, 1]).trim().sequences, short.sequences)  # padding trimmed back off
    assert torch.equal(joined.select([0, 1]).trim().advantages, short.advantages)
    assert joined.info["row"].tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="values is set in some"):
        Experience.concat([short, Experience(**{**short.__dict__, "values": None})])
    with pytest.raises(ValueError, match="info keys"):
        Experience.concat([short, Experience(**{**short.__dict__, "info": {}})])


@pytest.mark.parametrize("device", DEVICES)
def test_to_moves_every_tensor_including_info(device):
    moved = make_experience([2, 3], [3, 1]).to(device)
    assert all(value.device.type == device for _, _, value in moved.tensor_fields())
    assert moved.info["row"].device.type == device


@PROPERTY
@given(experiences())
def test_trim_keeps_every_real_token(experience):
    trimmed = experience.trim()
    assert torch.equal(trimmed.sequence_lengths(), experience.sequence_lengths())
    width = trimmed.response_mask.shape[1]
    assert torch.equal(trimmed.response_mask, experience.response_mask[:, :width])
    assert experience.response_mask[:, width:].sum() == 0


# ---------------------------------------------------------------------------------------------
# Mini-batches, micro-batches, gradient accumulation


def test_naive_mean_of_micro_batch_means_would_be_wrong_and_ours_is_right():
    # per-token losses: row 0 has three tokens [1, 2, 3], row 1 one token [10]; token-mean = 16/4 = 4.
    # Two micro-batches of one row: the mean of their means is (2 + 10)/2 = 6 — wrong. With the
    # mini-batch denominator 4: 6/4 + 10/4 = 4.
    loss = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    denominator = ca.aggregate_denominator(mask, "token-mean")
    naive = sum(ca.aggregate(loss[[row]], mask[[row]], "token-mean") for row in range(2)) / 2
    ours = sum(ca.aggregate(loss[[row]], mask[[row]], "token-mean", denominator=denominator) for row in range(2))
    assert float(naive) == 6.0 and float(ours) == 4.0 == float(ca.aggregate(loss, mask, "token-mean"))


def actor_loss(micro, features, theta, mode, denominator=None, norm_len=None):
    """Policy + value + entropy loss of a micro-batch, through a one-parameter "model"."""
    experience = micro if isinstance(micro, Experience) else micro.experience
    width = experience.response_mask.shape[1]
    feature = features[experience.info["row"]][:, :width]  # (b, T') this micro-batch's rows, trimmed
    logprob = experience.old_logprobs + theta * feature
    kwargs = dict(agg=mode, denominator=denominator, norm_len=norm_len)
    pg, _ = ca.ppo_policy_loss(experience.old_logprobs, logprob, experience.advantages, experience.response_mask,
                           clip_high=0.28, **kwargs)
    vf, _ = ca.value_loss(theta * feature, experience.values, experience.advantages, experience.response_mask,
                          **kwargs)
    entropy, _ = ca.entropy_bonus((theta * feature).square(), experience.response_mask, 0.01, **kwargs)
    return pg + vf + entropy


@PROPERTY
@given(experiences(), st.integers(1, 4), st.integers(1, 3), st.integers(0, 10))
def test_gradient_accumulation_does_not_change_loss_or_gradients(experience, micro_size, world_size, slack):
    features = torch.randn(experience.response_mask.shape, generator=torch.Generator().manual_seed(7))
    norm_len = experience.response_mask.shape[1] + 3
    minibatch = MiniBatch.of(experience, norm_len=norm_len)
    budget = int(experience.sequence_lengths().max()) + slack
    for mode in AGG_MODES:
        theta = torch.tensor(0.3, requires_grad=True)
        full = actor_loss(experience, features, theta, mode, norm_len=norm_len)
        full_gradient, = torch.autograd.grad(full, theta)
        splits = {
            "by size": minibatch.micro_batches(size=micro_size),
            "by token budget": minibatch.micro_batches(max_tokens=budget),
            "data parallel": [micro for rank in range(world_size)
                              for micro in minibatch.shard(rank, world_size).micro_batches(size=micro_size)],
        }
        for split, micro_batches in splits.items():
            rows = torch.cat([micro.experience.info["row"] for micro in micro_batches])
            assert sorted(rows.tolist()) == list(range(experience.batch_size)), split
            if float(minibatch.loss_denominators[mode]) == 0:  # no real token anywhere: nothing to learn
                continue
            accumulated = sum(actor_loss(micro, features, theta, mode, micro.denominator(mode))
                              for micro in micro_batches)
            gradient, = torch.autograd.grad(accumulated, theta)
            torch.testing.assert_close(accumulated, full, atol=1e-5, rtol=1e-5, msg=f"{mode} {split}")
            torch.testing.assert_close(gradient, full_gradient, atol=1e-5, rtol=1e-5, msg=f"{mode} {split}")


@PROPERTY
@given(experiences(max_rows=10), st.integers(1, 6))
def test_micro_batches_respect_the_token_budget(experience, slack):
    """The budget bounds the padded micro-batch (rows × width: what a pass computes and holds),
    and the bins follow length order, so that rows of like lengths pad together."""
    budget = int(experience.sequence_lengths().max()) + slack
    micro_batches = MiniBatch.of(experience).micro_batches(max_tokens=budget)
    assert all(micro.experience.sequences.numel() <= budget for micro in micro_batches)
    lengths = [micro.experience.sequence_lengths() for micro in micro_batches]
    assert all(int(a.max()) <= int(b.min()) for a, b in zip(lengths, lengths[1:]))
    assert sorted(torch.cat([micro.rows for micro in micro_batches]).tolist()) == list(range(experience.batch_size))
    sized = MiniBatch.of(experience).micro_batches(size=3)
    assert [micro.experience.batch_size for micro in sized][:-1] == [3] * (len(sized) - 1)


def test_a_token_budget_never_pads_a_short_row_to_a_long_one():
    """Lengths 8, 5, 2 in a budget of 10: first-fit on real tokens would put 8 and 2 together
    (16 padded tokens); the padded budget gives [2, 5] (10) and [8] (8)."""
    experience = make_experience([1, 1, 1], [7, 4, 1])
    micro_batches = MiniBatch.of(experience).micro_batches(max_tokens=10)
    assert [micro.rows.tolist() for micro in micro_batches] == [[2, 1], [0]]
    assert [tuple(micro.experience.sequences.shape) for micro in micro_batches] == [(2, 5), (1, 8)]


def test_micro_batches_need_exactly_one_way_to_split():
    minibatch = MiniBatch.of(make_experience([1, 2], [2, 2]))
    with pytest.raises(ValueError, match="exactly one"):
        minibatch.micro_batches()
    with pytest.raises(ValueError, match="exactly one"):
        minibatch.micro_batches(size=1, max_tokens=10)
    with pytest.raises(ValueError, match="valid"):
        minibatch.micro_batches(size=1)[0].denominator("mean")


# ---------------------------------------------------------------------------------------------
# Mini-batches of a joined batch


def test_minibatches_shuffle_by_seed_and_carry_their_denominators():
    buffer = Experience.concat([make_experience([2, 3, 1], [3, 1, 4], seed=1), make_experience([4, 2], [2, 5], seed=2)])
    order = [row for minibatch in buffer.minibatches(2, seed=3) for row in minibatch.experience.info["row"].tolist()]
    again = [row for minibatch in buffer.minibatches(2, seed=3) for row in minibatch.experience.info["row"].tolist()]
    assert order == again
    unshuffled = buffer.minibatches(2)
    assert [minibatch.experience.batch_size for minibatch in unshuffled] == [2, 2, 1]
    assert [row for minibatch in unshuffled for row in minibatch.experience.info["row"].tolist()] == [0, 1, 2, 0, 1]
    shuffled_orders = {tuple(torch.cat([m.experience.scores for m in buffer.minibatches(5, seed=seed)]).tolist())
                       for seed in range(6)}
    assert len(shuffled_orders) > 1
    first = unshuffled[0]
    width = buffer.response_mask.shape[1]
    for mode in AGG_MODES:
        expected = ca.aggregate_denominator(first.experience.response_mask, mode, norm_len=width)
        assert torch.equal(first.loss_denominators[mode], expected)


def test_a_mini_batch_without_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="mini_batch_size must be positive, got 0"):
        make_experience([2], [3]).minibatches(0)


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_dump_jsonl_for_inspection(tmp_path):
    experience = make_experience([2, 1], [3, 1], seed=5)
    path = tmp_path / "samples.jsonl"
    experience.dump_jsonl(str(path), tokenizer=CharTokenizer())
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["prompt"] == CharTokenizer().decode(experience.sequences[0, :2].tolist())
    assert first["response"] == CharTokenizer().decode(experience.sequences[0, 2:5].tolist())
    assert first["num_loss_tokens"] == 3 and second["info/row"] == 1
    assert first["advantages_mean"] == pytest.approx(float(experience.advantages[0].mean()), abs=1e-6)
    assert second["scores"] == float(experience.scores[1])
    experience.dump_jsonl(str(path), per_token=True)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["response"] == experience.sequences[0, 2:5].tolist()
    assert first["advantages"] == pytest.approx(experience.advantages[0].tolist(), abs=1e-6)


@PROPERTY
@given(experiences(max_rows=10), st.integers(1, 4), st.integers(0, 6))
def test_micro_batch_results_go_back_to_their_rows(experience, size, slack):
    """Row splits are sorted by length (each pads to its own), token budgets packed; either way
    in_row_order puts each micro-batch's per-row results back where its rows came from."""
    minibatch = MiniBatch.of(experience)
    budget = int(experience.sequence_lengths().max()) + slack
    for micro_batches in (minibatch.micro_batches(size=size), minibatch.micro_batches(max_tokens=budget)):
        for micro in micro_batches:
            assert micro.experience.info["row"].tolist() == micro.rows.tolist()
        results = [(micro.experience.info["row"][:, None] + 1) * micro.experience.response_mask
                   for micro in micro_batches]  # trimmed: each as wide as its own longest response
        expected = (torch.arange(experience.batch_size)[:, None] + 1) * experience.response_mask
        torch.testing.assert_close(minibatch.in_row_order(micro_batches, results), expected.to(results[0].dtype))
        assert sorted(torch.cat([m.rows for m in micro_batches]).tolist()) == list(range(experience.batch_size))
    lengths = [int(m.experience.sequence_lengths().max()) for m in minibatch.micro_batches(size=size)]
    assert lengths == sorted(lengths)


def test_dp_shards_balance_tokens_not_rows():
    """A long tail cut contiguously gives rank 0 both long rows (210 tokens against 30); the
    balanced cut, longest first to the emptier rank (on a tie the one with fewer rows, then rank
    0), gives each 120: 100 → 0, 90 → 1, 10 → 1 (100 | 100), 10 → 0 (fewer rows), 10 → 1, 10 → 0
    (fewer rows), 5 → 1, 5 → 1."""
    from orz.ppo.experience import balanced_shards

    lengths = torch.tensor([100, 90, 10, 10, 10, 10, 5, 5])
    shards = balanced_shards(lengths, 2)
    assert [s.tolist() for s in shards] == [[0, 3, 5], [1, 2, 4, 6, 7]]
    assert [int(lengths[s].sum()) for s in shards] == [120, 120]
    assert sorted(torch.cat(shards).tolist()) == list(range(8))  # every row once
    from orz.ppo.experience import experience_from_rollouts

    exp = experience_from_rollouts([[1]] * 8, [[2] * (n - 1) for n in lengths.tolist()])
    minibatch = MiniBatch.of(exp, rows=torch.arange(10, 18))  # the shards the workers take
    assert [int(minibatch.shard(r, 2).experience.sequence_lengths().sum()) for r in (0, 1)] == [120, 120]
    assert minibatch.shard(0, 2).rows.tolist() == [10, 13, 15]


def test_packed_bins_hold_real_tokens_within_the_budget():
    """First fit, longest first: 9 + 6 | 8 + 7 | 5 + 4 + 3 under 15 real tokens, where padded rows
    (rows × the longest ≤ 15) need four passes: 3, 4, 5 | 6, 7 | 8 | 9."""
    from orz.ppo.experience import _packed_bins, _padded_bins

    lengths = torch.tensor([3, 9, 4, 8, 5, 7, 6])
    bins = _packed_bins(lengths, 15)
    assert [sorted(lengths[b].tolist(), reverse=True) for b in bins] == [[9, 6], [8, 7], [5, 4, 3]]
    assert [sorted(lengths[b].tolist()) for b in _padded_bins(lengths, 15)] == [[3, 4, 5], [6, 7], [8], [9]]
    with pytest.raises(ValueError, match="row 1 has 9 tokens, more than max_tokens=8"):
        _packed_bins(lengths, 8)


def test_packed_inputs_restart_positions_at_each_row_and_unpack_in_place():
    from orz.models.inputs import ModelInputs

    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    inputs = ModelInputs(ids, lengths=torch.tensor([3, 2]))
    assert inputs.packed(ids).tolist() == [[5, 6, 7, 8, 9]]
    assert inputs.packed(inputs.position_ids).tolist() == [[0, 1, 2, 0, 1]]
    assert inputs.cu_seqlens.tolist() == [0, 3, 5]
    out = torch.arange(5.0).reshape(1, 5, 1)
    assert inputs.unpack(out)[..., 0].tolist() == [[0, 1, 2], [3, 4, 0]]
