"""gppo.ADVANTAGES (train.py --advantage): each estimator against values computed by hand, the
registry's names, the flag, and the default (grpo) being exactly gppo.group_advantages."""
import math
from types import SimpleNamespace

import pytest
import torch

import gppo
import train

NAMES = ("grpo", "rloo", "dr_grpo", "reinforce")


def adv(name, rewards, G):
    return gppo.ADVANTAGES[name](torch.tensor(rewards, dtype=torch.float32), G)


def close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_registry_holds_the_four():
    assert set(gppo.ADVANTAGES) == set(NAMES)
    assert gppo.ADVANTAGES["grpo"] is gppo.group_advantages


def test_all_equal_rewards():
    # two uniform groups: no signal within a group; reinforce's batch mean (0.5) still separates them
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    for name in ("grpo", "rloo", "dr_grpo"):
        close(adv(name, rewards, 3), [0.0] * 6)
    close(adv("reinforce", rewards, 3), [0.5, 0.5, 0.5, -0.5, -0.5, -0.5])


def test_group_of_two():
    std = math.sqrt(0.5)                 # unbiased std of [1, 0]
    close(adv("grpo", [1.0, 0.0], 2), [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)])
    close(adv("rloo", [1.0, 0.0], 2), [1.0, -1.0])
    close(adv("dr_grpo", [1.0, 0.0], 2), [0.5, -0.5])
    close(adv("reinforce", [1.0, 0.0], 2), [0.5, -0.5])


def test_two_groups_of_three():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]   # means 1/3 and 2/3, batch mean 1/2
    s = 1 / math.sqrt(3) + 1e-6                 # both groups: unbiased std sqrt((4+1+1)/9 / 2)
    close(adv("grpo", rewards, 3), [2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 1 / 3 / s, 1 / 3 / s, -2 / 3 / s])
    # leave-one-out: R_i - mean of the other two
    close(adv("rloo", rewards, 3), [1.0, -0.5, -0.5, 0.5, 0.5, -1.0])
    close(adv("dr_grpo", rewards, 3), [2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3])
    close(adv("reinforce", rewards, 3), [0.5, -0.5, -0.5, 0.5, 0.5, -0.5])


def test_rloo_is_scaled_dr_grpo():
    # R_i - (S - R_i)/(G-1) = G/(G-1) (R_i - mean): a random batch, P = 4, G = 5
    r = torch.rand(20, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gppo.ADVANTAGES["rloo"](r, 5), 5 / 4 * gppo.ADVANTAGES["dr_grpo"](r, 5))


def test_flag():
    assert train.parse_args([]).advantage == "grpo"
    for name in NAMES:
        assert train.parse_args(["--advantage", name]).advantage == name
    with pytest.raises(SystemExit):
        train.parse_args(["--advantage", "ppo"])


def test_train_advantages_default_is_group_advantages():
    # the default run's advantages are bitwise gppo.group_advantages' (metrics unchanged)
    args = train.parse_args([])
    G = args.group_size
    rewards = (torch.rand(3 * G, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    batch = SimpleNamespace(texts=[""] * (3 * G), completion_ids=[[1, 2, 3]] * (3 * G), truncated=[False] * (3 * G))
    shaped, got, _ = train.advantages(args, rewards, batch)
    assert torch.equal(got, gppo.group_advantages(shaped, G))
    args.advantage = "rloo"
    _, got, _ = train.advantages(args, rewards, batch)
    torch.testing.assert_close(got, gppo.rloo_advantages(shaped, G))
