"""DAPO's dynamic sampling as both policies run it: `collection.informative_groups`."""

from stepcredit.batch import Trajectory
from stepcredit.train.collection import MAX_REFILL_ROUNDS, informative_groups


def _groups(*scores):
    return [Trajectory(steps=(), group_id=k, score=s) for k, group in enumerate(scores) for s in group]


def test_uniform_groups_are_replaced_by_fresh_ones_until_the_batch_is_full():
    rounds = []

    def play_round(round_):
        rounds.append(round_)
        return _groups((2.0, 3.0), (5.0, 5.0), (7.0, 8.0))

    kept, metrics = informative_groups(_groups((1.0, 1.0), (0.0, 1.0), (0.0, 0.0)), play_round,
                                       group_size=2, wanted=2)
    assert [t.score for t in kept] == [0.0, 1.0, 2.0, 3.0] and [t.group_id for t in kept] == [0, 0, 1, 1]
    assert rounds == [1] and metrics == {"dapo/groups_dropped": 3.0, "dapo/sampling_rounds": 2.0}


def test_when_no_group_differs_the_first_batch_is_kept_whole():
    first = _groups((1.0, 1.0), (0.0, 0.0))
    kept, metrics = informative_groups(first, lambda round_: _groups((4.0, 4.0)), group_size=2, wanted=2)
    assert kept == first and metrics["dapo/sampling_rounds"] == MAX_REFILL_ROUNDS + 1
    assert metrics["dapo/groups_dropped"] == 2 + MAX_REFILL_ROUNDS
