"""``mlxterm bench batch`` serves the same requests in both arms: the same prompts, each arm
from the same checkpoint store (emptied, then the template prefix), so the arms prefill the
same tokens and return the same replies -- the serial arm is neither helped by the batched
arm's checkpoints nor the other way round."""

from __future__ import annotations

from engine.runtime import Engine

from app.benches import batch as bench


def test_both_arms_serve_the_same_requests(tmp_path, tiny_llama_dir):
    from tests.tiny_models import write_profile

    profile = write_profile(
        tmp_path / "bench.yaml", tiny_llama_dir, cache={"ssd_dir": str(tmp_path / "ckpt")}
    )
    with Engine.load(str(profile)) as eng:
        prompts = bench._prompts(eng, 3)
        runs, fed = [], []
        for arm in ("serial", "batched", "serial"):
            bench._fresh_checkpoints(eng)
            before = eng.scheduler_stats()["prefill_tokens"]
            runs.append(bench._run_arm(eng, arm, 3, 6, prompts))
            fed.append(eng.scheduler_stats()["prefill_tokens"] - before)
    assert [r["lanes"] for r in runs] == [["serial"], ["batched"], ["serial"]]
    assert runs[0]["replies"] == runs[1]["replies"] == runs[2]["replies"]
    assert all(r["tokens"] > 3 for r in runs)
    # every arm restores the template prefix and nothing more (of an earlier arm's prompts, or
    # in the serial arm, of an earlier request's nonce)
    assert fed[0] == fed[1] == fed[2], fed
    assert runs[0]["cached"] == runs[1]["cached"] == runs[2]["cached"], [r["cached"] for r in runs]
    assert min(runs[0]["cached"]) > 0
    assert min(fed) > sum(len(p) for p in prompts) - 3 * 40, (fed, [len(p) for p in prompts])


def test_seed_makes_runs_serve_the_same_prompts(tmp_path, tiny_llama_dir):
    """--seed: two runs (two builds in an A/B) draw the same nonces, so the same prompts;
    without it every run draws fresh ones."""
    from tests.tiny_models import write_profile

    profile = write_profile(
        tmp_path / "bench.yaml", tiny_llama_dir, cache={"ssd_dir": str(tmp_path / "ckpt")}
    )
    with Engine.load(str(profile)) as eng:

        def draw(seed):
            bench._nonces.seed(seed)
            return bench._prompts(eng, 4)

        first, again, other = draw(7), draw(7), draw(8)
        fresh = [draw(None), draw(None)]
    assert first == again
    assert first != other
    assert fresh[0] != fresh[1]
    assert len({tuple(p) for p in first}) == 4  # each request its own prompt


def test_ignore_eos_gives_every_reply_max_tokens(tmp_path, tiny_llama_dir):
    """--ignore-eos: fixed reply lengths, so both arms time N x max_tokens tokens whatever
    end-of-sequence tokens the replies draw (one of the tiny model's end ids made frequent here)."""
    from tests.tiny_models import write_profile

    profile = write_profile(
        tmp_path / "bench.yaml", tiny_llama_dir, cache={"ssd_dir": str(tmp_path / "ckpt")}
    )
    with Engine.load(str(profile)) as eng:
        prompts = bench._prompts(eng, 3)
        free = bench._run_arm(eng, "batched", 3, 8, prompts, ignore_eos=True)
        # an end id that first appears at position k > 0 of some reply (a token repeated from
        # the start of the reply would end it earlier: the test used to take position 1 blindly)
        row, k = next((r, i) for r, reply in enumerate(free["replies"]) for i in range(1, len(reply))
                      if reply[i] not in reply[:i])
        eng.tokenizer.eos_ids = set(eng.tokenizer.eos_ids) | {free["replies"][row][k]}
        runs = [
            bench._run_arm(eng, arm, 3, 8, prompts, ignore_eos=True)
            for arm in ("serial", "batched")
        ]
        ended = bench._run_arm(eng, "serial", 3, 8, prompts)
    assert all(len(r) == 8 for run in [free, *runs] for r in run["replies"])
    assert runs[0]["replies"] == runs[1]["replies"] == free["replies"]
    assert runs[0]["tokens"] == runs[1]["tokens"] == 24
    assert len(ended["replies"][row]) == k + 1 and ended["tokens"] < 24
    # what batching could gain at most: N for fixed lengths, all tokens / the longest reply else
    assert runs[1]["decode_ceiling"] == 3.0
    lengths = [len(r) for r in ended["replies"]]
    assert ended["decode_ceiling"] == sum(lengths) / max(lengths) < 3.0
