"""Elastic sampler: world-size independent order, exact resume at any world size."""

from __future__ import annotations

import torch

from elastic_tools.training.sampler import Cursor, ElasticSampler


def _sampler() -> ElasticSampler:
    return ElasticSampler(num_samples=96, global_batch_size=24, micro_batch_size=4, seed=5)


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a, b = _sampler(), _sampler()
    assert torch.equal(a.permutation(0), b.permutation(0))
    assert not torch.equal(a.permutation(0), a.permutation(1))
    assert sorted(a.permutation(1).tolist()) == list(range(96))


def test_ranks_split_each_global_batch_exactly() -> None:
    sampler = _sampler()
    indices, _ = sampler.global_batch(Cursor())
    for world in (1, 2, 3, 6):
        parts = [
            i
            for r in range(world)
            for mb in sampler.for_rank(indices, r, world)
            for i in mb.tolist()
        ]
        assert sorted(parts) == sorted(indices.tolist())


def test_resized_resume_uses_each_sample_once_per_epoch() -> None:
    sampler, cursor, seen = _sampler(), Cursor(), []
    for world in (2, 3, 1, 2):  # one step per world size: 4 steps = one epoch
        indices, cursor = sampler.global_batch(cursor)
        for r in range(world):
            seen += [i for mb in sampler.for_rank(indices, r, world) for i in mb.tolist()]
        cursor = Cursor(**cursor.as_dict())  # as if restored from a checkpoint
    assert sorted(seen) == list(range(96))
    indices, cursor = sampler.global_batch(cursor)
    assert cursor == Cursor(1, 24)
    assert torch.equal(indices, sampler.permutation(1)[:24])


def test_tail_shorter_than_a_global_batch_rolls_over() -> None:
    sampler = ElasticSampler(num_samples=50, global_batch_size=24, micro_batch_size=4, seed=0)
    assert sampler.steps_per_epoch == 2
    _, cursor = sampler.global_batch(Cursor(0, 24))
    assert sampler.normalize(cursor) == Cursor(1, 0)
