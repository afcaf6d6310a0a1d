import pytest
import torch

from kvpool.common.errors import BadRequestError
from kvpool.engine.sampling import SamplingParams, make_generator, sample


def logits():
    row = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    return torch.stack([row, row.flip(0)])


def test_greedy_is_argmax():
    p = SamplingParams(temperature=0)
    assert sample(logits(), [p, p], [None, None]) == [1, 3]


def test_top_k_one_is_greedy_even_when_hot():
    p = SamplingParams(temperature=50.0, top_k=1)
    assert p.greedy
    assert sample(logits(), [p, p], [None, None]) == [1, 3]


def test_top_k_restricts_to_the_k_best():
    p = SamplingParams(temperature=100.0, top_k=2, seed=0)
    g = make_generator(0)
    seen = {sample(logits()[:1], [p], [g])[0] for _ in range(200)}
    assert seen == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities ~ [.47 (id 1), .43 (id 2), .06, ...]: top_p=0.5 keeps the two best tokens only
    p = SamplingParams(temperature=1.0, top_p=0.5)
    g = make_generator(1)
    seen = {sample(logits()[:1], [p], [g])[0] for _ in range(300)}
    assert seen == {1, 2}
    p = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample(logits()[:1], [p], [g])[0] for _ in range(50)} == {1}


def test_seed_reproduces_and_temperature_spreads():
    p = SamplingParams(temperature=5.0, seed=3)
    a = [sample(logits()[:1], [p], [g])[0] for g in [make_generator(3)] for _ in range(30)]
    b = [sample(logits()[:1], [p], [g])[0] for g in [make_generator(3)] for _ in range(30)]
    assert a == b
    assert len(set(a)) >= 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"n": 0},
        {"n": 17},
        {"n": True},
        {"logprobs": -1},
        {"logprobs": 21},
        {"prompt_logprobs": 21},
        {"logprobs": 1.5},
        {"seed": 2**64},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"min_tokens": -1},
    ],
)
def test_bad_params_are_rejected(kwargs):
    with pytest.raises(BadRequestError):
        SamplingParams(**kwargs)


def test_limits_are_accepted():
    p = SamplingParams(n=16, logprobs=20, prompt_logprobs=0, seed=-(2**63))
    assert (p.n, p.logprobs, p.prompt_logprobs) == (16, 20, 0)


def test_sequence_seeds_are_seed_plus_index_wrapped():
    from kvpool.engine.sampling import sequence_seed

    assert sequence_seed(None, 3) is None
    assert [sequence_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sequence_seed(2**64 - 1, 1) == 0  # torch takes seeds up to 2**64 - 1
    make_generator(sequence_seed(2**64 - 1, 2))


def test_stop_accepts_a_string():
    assert SamplingParams(stop="END").stop_strings == ("END",)
