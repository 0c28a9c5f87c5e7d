"""The rollout engines sample from the distribution whose log-probs they record (mu), at
temperature 1.

Run: .venv/bin/python -m pytest tests/test_sampling.py -q   (~25 s on 2 cores, mostly vLLM's start)

One prompt whose next token is uncertain under the committed tiny model (the answer digit after
"\\boxed{": ~2.2 nats of entropy), 2000 seeded samples of one token each: the empirical frequency of
every token value must fit exp(its recorded log-prob) (a chi-square test at p = 1e-6), and the
recorded log-probs must be the model's own temperature-1 ones. An engine that samples at another
temperature than the one its log-probs describe (e.g. 0.7 with temperature-1 mu) fails the fit by
far; an engine whose mu is not the model's distribution fails the second check.
"""
import math
from collections import Counter, defaultdict

import pytest
import torch

from conftest import ROOT

MODEL = str(ROOT / "data" / "tiny" / "model")
PROMPT = "max(8, 4, 6) = ?\n\\boxed{"
N = 2000


def chi2_bound(df, z=4.753):
    """The chi-square quantile of upper tail 1e-6 (z: the normal's), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check_first_tokens(batch, model_logp):
    """Chi-square of the first tokens' counts against N x exp(recorded log-prob): tokens expected at
    least 5 times each a cell, the rest of the probability one more cell. model_logp: (V,) the
    model's temperature-1 log-probs there. Returns (chi2, df) for the message."""
    counts, recorded = Counter(), defaultdict(list)
    for ids, lps in zip(batch.completion_ids, batch.logprobs):
        assert len(ids) == len(lps) == 1
        counts[ids[0]] += 1
        recorded[ids[0]].append(lps[0])
    assert sum(counts.values()) == N
    for t, lps in recorded.items():        # one token, one log-prob: the model's own
        assert max(lps) - min(lps) < 1e-5
        assert abs(lps[0] - model_logp[t].item()) < 1e-4, f"token {t}: mu is not the model's"
    p = {t: math.exp(lps[0]) for t, lps in recorded.items()}
    cells = [t for t in counts if N * p[t] >= 5]
    observed = [counts[t] for t in cells] + [N - sum(counts[t] for t in cells)]
    expected = [N * p[t] for t in cells] + [N * (1 - sum(p[t] for t in cells))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(cells)
    assert df >= 5, "want a spread distribution: the test would say little otherwise"
    assert chi2 < chi2_bound(df), f"samples do not follow the recorded mu: chi2 {chi2:.1f}, df {df}"
    return chi2, df


@pytest.fixture(scope="module")
def tiny():
    """The committed tiny model, its tokenizer, the prompt's ids and the next token's log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return model, ids, logp


def test_hf_rollout_samples_its_recorded_mu(tiny):
    from rollout import make_engine
    model, ids, logp = tiny
    engine = make_engine(MODEL, backend="hf", policy=model, max_model_len=64, seed=0)
    chi2, df = check_first_tokens(engine.generate([ids], n=N, max_tokens=1, seed=7), logp)
    print(f"\nhf: chi2 {chi2:.1f}, df {df} (bound {chi2_bound(df):.1f})")


def test_vllm_rollout_samples_its_recorded_mu(tiny):
    from rollout import make_engine
    model, ids, logp = tiny
    engine = make_engine(MODEL, backend="vllm", max_model_len=64, seed=0, kv_cache_sequences=256,
                         kv_cache_tokens=64)
    try:
        chi2, df = check_first_tokens(engine.generate([ids], n=N, max_tokens=1, seed=7), logp)
    finally:
        del engine
    print(f"\nvllm: chi2 {chi2:.1f}, df {df} (bound {chi2_bound(df):.1f})")
