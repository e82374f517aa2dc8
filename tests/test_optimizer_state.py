"""An optimizer's state allocated for a resize (``allocate_optimizer_state``) is the state its
first step creates, in form: once its values are set, training goes on bit for bit as
from the state the step made. An optimizer whose state it cannot read off is left alone."""

from __future__ import annotations

import pytest
import torch

from trainer.integrations.meta import allocate_optimizer_state

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adam-two-groups": lambda ps: torch.optim.Adam([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}], lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 4), (7,), (2, 3, 3))]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_allocated_state_has_the_form_a_first_step_gives_and_trains_on_identically(name: str) -> None:
    make = OPTIMIZERS[name]
    trained = _params(0)
    reference = make(trained)
    for seed in (1, 2):
        _step(reference, trained, seed)

    resized = [torch.nn.Parameter(torch.empty_like(p)) for p in trained]
    opt = make(resized)
    assert allocate_optimizer_state(opt)
    for p, q in zip(trained, resized):
        ref, got = reference.state[p], opt.state[q]
        assert list(got) == list(ref)
        for key in ref:
            assert (got[key].shape, got[key].dtype, got[key].device) == (ref[key].shape, ref[key].dtype,
                                                                          ref[key].device), key
        with torch.no_grad():  # what a resize does next: every value of the state overwritten
            q.copy_(p)
            for key in ref:
                got[key].copy_(ref[key])

    _step(reference, trained, 3)
    _step(opt, resized, 3)
    for p, q in zip(trained, resized):
        assert torch.equal(p, q)


def test_an_optimizer_whose_state_is_of_another_form_is_left_alone() -> None:
    params = _params(0)
    opt = torch.optim.Adafactor(params, lr=1e-2)  # factored moments: a row and a column vector
    assert not allocate_optimizer_state(opt)
    assert not opt.state


def test_a_group_of_mixed_dtypes_is_left_alone() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    opt = torch.optim.AdamW(params)
    assert not allocate_optimizer_state(opt)
    assert not opt.state


def test_an_optimizer_with_state_already_is_left_alone() -> None:
    params = _params(0)
    stepped = torch.optim.AdamW(params)
    _step(stepped, params, 1)
    before = {id(p): dict(st) for p, st in stepped.state.items()}
    assert not allocate_optimizer_state(stepped)
    assert {id(p): dict(st) for p, st in stepped.state.items()} == before
    adagrad = torch.optim.Adagrad(_params(1))  # makes its state when constructed
    assert not allocate_optimizer_state(adagrad)


def test_zeroed_state_is_zeros() -> None:
    params = _params(0)
    opt = torch.optim.AdamW(params)
    assert allocate_optimizer_state(opt, zeroed=True)
    for p in params:
        assert torch.count_nonzero(opt.state[p]["exp_avg"]) == 0
        assert torch.count_nonzero(opt.state[p]["exp_avg_sq"]) == 0
