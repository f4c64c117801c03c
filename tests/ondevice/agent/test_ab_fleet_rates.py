"""A fleet's A/B decision at the rates the test promises (issue 47): simulated devices whose two arms have
known task success rates, each conversation routed by a fair coin, rated by ``field simulate``'s own scripted
user (a share unrated, a share of thumbs flipped by noise), pooled as ``feedback ab`` pools stores (each
device capped, each conversation its own client, as the embedded router records it). Over seeds: a known
better candidate is promoted at least as often as the test's power promises and never reverted; a known equal
one is kept, with a false promote or revert at most 2 alpha. No model: the decision takes outcome streams."""

from slm_align.ondevice.agent.ab_fleet import MAX_PER_DEVICE, fleet_test
from slm_align.ondevice.agent.ab_sequential import Observation, SequentialTest, decide
from slm_align.ondevice.agent.field import ScriptedUser, device_rng

NOISE = 0.1
UNRATED = 0.3
TEST = fleet_test()


def fleet(success: dict, devices: int, turns: int, seed: int, test: SequentialTest = TEST) -> dict:
    """One fleet's decision: device ``d`` routes each of its ``turns`` conversations to an arm by a fair coin,
    the arm's answer is right with probability ``success[arm]``, and the device's scripted user rates it."""
    observations = []
    for device in range(1, devices + 1):
        rng = device_rng(seed, device)
        user = ScriptedUser(rng, NOISE, UNRATED)
        for turn in range(turns):
            arm = "candidate" if rng.random() < 0.5 else "current"
            rating = user.rate(rng.random() < success[arm])
            if rating.up is not None:
                conversation = f"d{device}c{turn}"
                observations.append(Observation(arm, rating.up, conversation, f"{turn:04d}.{device:04d}",
                                                conversation, str(device)))
    return decide(observations, test).to_dict()


def rates(success: dict, runs: int, devices: int = 150, turns: int = 30) -> dict:
    """Each decision's share over ``runs`` fleets (seeds 0..runs-1), and the paired conversations of the
    decided ones (the mean)."""
    found = [fleet(success, devices, turns, seed) for seed in range(runs)]
    shares = {decision: sum(e["decision"] == decision for e in found) / runs
              for decision in ("promote", "revert", "keep", "collecting")}
    decided = [2 * e["pairs"] for e in found if e["decision"] != "collecting"]
    return dict(shares, conversations=sum(decided) / max(1, len(decided)))


def success_for(thumbs_up: float) -> float:
    """The task success whose thumbs-up rate is ``thumbs_up`` after the noise: up = s (1 - n) + (1 - s) n."""
    return (thumbs_up - NOISE) / (1 - 2 * NOISE)


BETTER = {"current": success_for(0.5), "candidate": success_for(0.65)}
"""Better by the test's delta exactly: thumbs-up 0.65 against 0.5, p = 0.5 + delta (task success 0.5 against
0.6875)."""


def test_a_candidate_better_by_delta_is_promoted_at_the_tests_power_and_never_reverted():
    """The promise is about 1 - beta (Wald); 200 fleets measure it within about 0.04 (two standard errors)."""
    found = rates(BETTER, runs=200)
    assert found["promote"] >= 1 - TEST.beta - 0.05 and found["revert"] == 0, found
    assert found["conversations"] < 150 * MAX_PER_DEVICE / 4  # it stopped early: the fleet's cap was not the end


def test_a_candidate_worse_by_delta_is_reverted():
    found = rates({"current": BETTER["candidate"], "candidate": BETTER["current"]}, runs=100)
    assert found["revert"] >= 1 - TEST.beta - 0.05 and found["promote"] == 0, found


def test_a_known_equal_candidate_is_kept_and_wrongly_decided_at_most_2_alpha():
    """Equal arms (task success 0.6 each): a promote or a revert is a false decision, at most 2 alpha; each
    one-sided test accepts its null with probability at least 1 - alpha, so enough devices keep the current
    one at least 1 - 2 alpha - beta of the time (the rest still collecting)."""
    found = rates({"current": 0.6, "candidate": 0.6}, runs=300)
    assert found["promote"] + found["revert"] <= 2 * TEST.alpha, found
    assert found["keep"] >= 1 - 2 * TEST.alpha - TEST.beta, found


def test_without_the_device_cap_one_heavy_device_decides_alone():
    """The cap is what keeps one device from deciding: a single device's 400 conversations, its candidate
    always right and its current arm always wrong, decide nothing pooled under the cap; uncapped they do."""
    one = {"current": 0.0, "candidate": 1.0}
    assert fleet(one, devices=1, turns=400, seed=1)["decision"] == "collecting"
    uncapped = SequentialTest(max_per_client=None)
    assert fleet(one, devices=1, turns=400, seed=1, test=uncapped)["decision"] == "promote"


def test_the_simulation_routes_half_and_leaves_its_share_unrated():
    rated = [fleet({"current": 0.5, "candidate": 0.5}, devices=1, turns=1000, seed=seed,
                   test=SequentialTest(min_conversations=10 ** 6, max_per_client=None))["conversations"]
             for seed in range(3)]
    assert all(abs(count - 1000 * (1 - UNRATED)) < 60 for count in rated), rated
