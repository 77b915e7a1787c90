"""The sampler against independent computations: top-k / top-p masks, penalty formulas, min_tokens,
seeded draws that do not depend on batch mates, mixed parameters in one batch."""
from __future__ import annotations

import math

import pytest

import torch  # noqa: E402  (make test installs it)

from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.sampler import Row, Sampler, apply_top_k_top_p, compute_logprobs, make_generator  # noqa: E402

NEG_INF = float("-inf")


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in masked]


def expected_top_k(row: list[float], k: int) -> set[int]:
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, x in enumerate(row) if x >= kth}


def expected_top_p(row: list[float], p: float, allowed: set[int] | None = None) -> set[int]:
    """Smallest set of most likely tokens whose probability mass reaches p (float64, by hand)."""
    idx = sorted(allowed if allowed is not None else range(len(row)), key=lambda i: -row[i])
    m = max(row[i] for i in idx)
    z = sum(math.exp(row[i] - m) for i in idx)
    out, mass = set(), 0.0
    for i in idx:
        out.add(i)
        mass += math.exp(row[i] - m) / z
        if mass >= p:
            break
    return out


def test_top_k_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[5, :10] = 3.0  # ties at the k-th value are all kept
    k = torch.tensor([1, 5, 50, 17, 2, 4])
    got = kept(apply_top_k_top_p(logits.clone(), k, None))
    for i in range(6):
        assert got[i] == expected_top_k(logits[i].tolist(), int(k[i]))
    assert got[5] == set(range(10))


def test_top_p_mask_and_top_k_then_top_p():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=g) * 2
    p = torch.tensor([0.05, 0.5, 0.9, 0.999, 1.0])
    got = kept(apply_top_k_top_p(logits.clone(), None, p))
    for i in range(5):
        assert got[i] == expected_top_p(logits[i].tolist(), float(p[i]))
    assert len(got[0]) >= 1 and got[4] == set(range(40))
    # top-k first, then top-p over the renormalised top-k distribution (vLLM's order).
    k = torch.tensor([3, 10, 40, 5, 1])
    got = kept(apply_top_k_top_p(logits.clone(), k, p))
    for i in range(5):
        row = logits[i].tolist()
        assert got[i] == expected_top_p(row, float(p[i]), expected_top_k(row, int(k[i])))


def test_penalties_formulas():
    v = 12
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, v, generator=g) * 3
    prompt = [1, 2, 2, 5]
    output = [2, 3, 3, 3, 7]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=-0.4),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=1.1, presence_penalty=0.3),
    ]
    rows = [Row(sp, prompt, output) for sp in params]
    from engine.sampler import apply_penalties

    got = base.clone()
    apply_penalties(got, rows)
    counts = {t: output.count(t) for t in set(output)}
    for r, sp in enumerate(params):
        for t in range(v):
            x = float(base[r, t])
            if t in prompt or t in counts:
                rp = sp.repetition_penalty
                x = x / rp if x > 0 else x * rp
            x -= sp.frequency_penalty * counts.get(t, 0)
            x -= sp.presence_penalty * (1 if t in counts else 0)
            assert float(got[r, t]) == pytest.approx(x, abs=1e-5), (r, t)


def test_greedy_takes_the_first_of_tied_maxima():
    # Ties in a wide row (the kernel splits it across threads): the first maximal index wins, as
    # torch.argmax and vLLM's greedy sampler pick; mixed with a sampled row too.
    logits = torch.zeros(3, 49152)
    logits[0, [7, 9000, 40000]] = 2.0
    logits[1, [30000, 20000]] = float("inf")
    greedy = Row(SamplingParams(temperature=0))
    assert Sampler()(logits.clone(), [greedy, greedy, greedy]) == [7, 20000, 0]
    got = Sampler(make_generator(0))(logits.clone(), [greedy, Row(SamplingParams(temperature=1.0)), greedy])
    assert got[0] == 7 and got[2] == 0


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    sampler = Sampler()
    assert sampler(logits.clone(), [Row(SamplingParams(temperature=0))]) == [1]
    rep = Row(SamplingParams(temperature=0, repetition_penalty=1.2), prompt_token_ids=[1])
    assert sampler(logits.clone(), [rep]) == [2]
    freq = Row(SamplingParams(temperature=0, frequency_penalty=0.05), output_token_ids=[1, 1, 1])
    assert sampler(logits.clone(), [freq]) == [2]
    # frequency/presence count outputs only, not the prompt
    pres = Row(SamplingParams(temperature=0, presence_penalty=2.0), prompt_token_ids=[1])
    assert sampler(logits.clone(), [pres]) == [1]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]] * 3)
    sp = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
    rows = [Row(sp, [0], [], min_tokens_stop_ids=(2, 3)),       # eos 2 and stop id 3 masked
            Row(sp, [0], [4, 4], min_tokens_stop_ids=(2, 3)),   # still below min_tokens
            Row(sp, [0], [4, 4, 4], min_tokens_stop_ids=(2, 3))]  # reached: no mask
    assert Sampler()(logits.clone(), rows) == [4, 4, 2]
    # random rows too: a masked id is never drawn
    rnd = SamplingParams(temperature=1.0, min_tokens=5)
    draws = Sampler(make_generator(0))(torch.zeros(64, 5), [Row(rnd, [0], [], (2,))] * 64)
    assert 2 not in draws and len(set(draws)) > 1


def test_text_short_masks_stop_ids_like_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]] * 2)
    sp = SamplingParams(temperature=0, min_characters=10, stop_token_ids=[3])
    rows = [Row(sp, [0], [4], min_tokens_stop_ids=(2, 3), text_short=True),   # text still short
            Row(sp, [0], [4], min_tokens_stop_ids=(2, 3), text_short=False)]  # reached: no mask
    assert Sampler()(logits.clone(), rows) == [4, 2]
    with pytest.raises(ValueError, match="min_characters=-1"):
        SamplingParams(min_characters=-1)


def test_seeded_sampling_independent_of_batch_mates():
    g = torch.Generator().manual_seed(3)
    target = torch.randn(1, 100, generator=g)
    mates = torch.randn(5, 100, generator=g)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)

    def draws(batch_builder, steps=20):
        gen = make_generator(1234)
        sampler = Sampler(make_generator(99))
        got = []
        for _ in range(steps):
            logits, rows, pos = batch_builder(gen)
            got.append(sampler(logits, rows)[pos])
        return got

    def alone(gen):
        return target.clone(), [Row(sp, generator=gen)], 0

    def crowded(gen):
        other = [Row(SamplingParams(temperature=1.0)), Row(SamplingParams(temperature=0)),
                 Row(SamplingParams(temperature=0.5, seed=7), generator=make_generator(7)),
                 Row(SamplingParams(temperature=1.3, top_k=3))]
        logits = torch.cat([mates[:2], target, mates[2:4]])
        return logits.clone(), other[:2] + [Row(sp, generator=gen)] + other[2:], 2

    a, b = draws(alone), draws(crowded)
    assert a == b
    assert len(set(a)) > 1  # really sampling, not argmax
    assert draws(alone) == a  # same seed, same stream


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(make_generator(0))
    draws = sampler(logits, [Row(SamplingParams(temperature=1.0))] * 4000)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    # temperature sharpens: at T=0.25 the top token dominates
    cold = sampler(probs.log().repeat(2000, 1), [Row(SamplingParams(temperature=0.25))] * 2000)
    assert cold.count(0) / 2000 > 0.85


def test_mixed_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 30, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=0.01), SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=2.0, seed=5), SamplingParams(temperature=0)]
    rows = [Row(sp, [0], [], generator=make_generator(sp.seed) if sp.seed is not None else None)
            for sp in params]
    got = Sampler(make_generator(0))(logits.clone(), rows)
    am = logits.argmax(-1).tolist()
    assert got[0] == am[0] and got[1] == am[1] and got[2] == am[2] and got[5] == am[5]
    pen = logits[3].clone()
    pen[0] = pen[0] / 2.0 if pen[0] > 0 else pen[0] * 2.0
    assert got[3] == int(pen.argmax())
    assert 0 <= got[4] < 30


def test_logit_bias_adds_to_the_logits_before_sampling():
    from engine.sampler import apply_logit_bias
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    rows = [Row(SamplingParams(temperature=0, logit_bias={0: 2.5, 3: -1.0})), Row(SamplingParams(temperature=0))]
    apply_logit_bias(logits, rows)
    assert logits.tolist() == [[3.5, 2.0, 3.0, -0.5], [0.0, 0.0, 0.0, 0.0]]
    # greedy: +100 picks any token, -100 on the best one picks the runner-up
    sampler = Sampler()
    base = torch.tensor([[1.0, 2.0, 3.0, 0.5]] * 2)
    got = sampler(base.clone(), [Row(SamplingParams(temperature=0, logit_bias={3: 100})),
                                 Row(SamplingParams(temperature=0, logit_bias={2: -100}))])
    assert got == [3, 1]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 150.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_min_p_keeps_tokens_above_a_share_of_the_top_probability():
    # after temperature 1: probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.25 -> floor 0.125 keeps the
    # first three, renormalised to 0.5/0.95, 0.3/0.95, 0.15/0.95
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(make_generator(1))
    draws = sampler(probs.log().repeat(6000, 1), [Row(SamplingParams(temperature=1.0, min_p=0.25))] * 6000)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 6000
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3] / 0.95, atol=0.03), freq
    # min_p 1: only the most likely token survives, whatever the temperature
    got = sampler(torch.randn(50, 40, generator=torch.Generator().manual_seed(3)) * 0.1,
                  [Row(SamplingParams(temperature=5.0, min_p=1.0))] * 50)
    assert got == [int(x) for x in (torch.randn(50, 40, generator=torch.Generator().manual_seed(3)) * 0.1).argmax(-1)]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_allowed_token_ids_restrict_every_draw():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 50, generator=g)
    allowed = [3, 17, 41]
    sampler = Sampler(make_generator(2))
    got = sampler(logits.clone(), [Row(SamplingParams(temperature=1.0, allowed_token_ids=allowed))] * 300)
    assert set(got) == set(allowed)  # each drawn, nothing else
    greedy = sampler(logits.clone()[:5], [Row(SamplingParams(temperature=0, allowed_token_ids=allowed))] * 5)
    assert greedy == [allowed[int(r[allowed].argmax())] for r in logits[:5]]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_pinned_logprob_ids_replace_the_top_k():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [2.0, 0.0, 0.0, 1.0]])
    ref = logits.log_softmax(-1)
    out = compute_logprobs(logits, [2, 0], [2, 2], [[0, 1], None])
    # pinned row: the sampled token first (not among the pinned), then the pinned ids in order
    assert [t for t, _ in out[0].top] == [2, 0, 1]
    assert [v for _, v in out[0].top] == pytest.approx([ref[0, 2].item(), ref[0, 0].item(), ref[0, 1].item()])
    assert [t for t, _ in out[1].top] == [0, 3]  # the natural top 2
    assert [t for t, _ in compute_logprobs(logits, [1], [1], [[1, 3]])[0].top] == [1, 3]  # sampled among them
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[1])  # needs logprobs
