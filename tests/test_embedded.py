"""The committed embedded default (data/tiny): it loads, and it was made by the current recipe.

Run: .venv/bin/python -m pytest tests/test_embedded.py -q   (CPU, no network, ~30 s)

The warm-start model is committed so that every machine starts from the same weights (a rebuild on
another CPU gives other weights: its float arithmetic differs). So these tests check provenance,
not bitwise reproduction: the recipe fingerprint data/prepare.py records, the config that recipe
builds, and the task files it writes.
"""
import json
import sys

import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "data"))
import prepare  # noqa: E402

TINY = ROOT / "data" / "tiny"


def recorded():
    return json.loads((TINY / "model" / "warm_start.json").read_text())


def recipe_args():
    """The flags the committed model was built with, parsed as prepare.py parses them."""
    return prepare.parser().parse_args(recorded()["argv"])


def test_committed_model_was_made_by_the_current_recipe():
    rec = recorded()
    assert rec["recipe"] == prepare.recipe_hash(recipe_args()), (
        "data/prepare.py's recipe changed since data/tiny/model was built: rebuild it with "
        "`python data/prepare.py --force` and commit data/tiny")


def test_committed_config_and_tasks_are_what_the_recipe_builds():
    args = recipe_args()
    built = prepare.build_model(len(prepare.build_tokenizer()), args).config
    saved = json.loads((TINY / "model" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "eos_token_id"):
        assert saved[key] == getattr(built, key), key
    rows = prepare.make_tasks(args.seed, args.n_math_train, args.n_math_test, args.n_code_test)
    for task, splits in rows.items():
        for split, items in splits.items():
            lines = (TINY / f"{task}_{split}.jsonl").read_text().splitlines()
            assert [json.loads(line) for line in lines] == items, f"{task}_{split}.jsonl differs from the recipe's"


def test_committed_model_loads_in_transformers_and_vllm():
    """Both load it, decode the same greedy answers, and those answers show the warm start's skill
    (greedy decoding is right on most problems; one sample at temperature 1 much less often)."""
    import reward
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from infra.vllm_engine import VLLMRollout
    model = AutoModelForCausalLM.from_pretrained(str(TINY / "model"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(TINY / "model"))
    assert sum(p.numel() for p in model.parameters()) == recorded()["params"]
    rows = [json.loads(line) for line in (TINY / "math_test.jsonl").read_text().splitlines()[:16]]
    prompts = [tok(r["problem"], add_special_tokens=False)["input_ids"] for r in rows]
    engine = VLLMRollout(str(TINY / "model"), max_model_len=256, seed=0)
    out = engine.generate(prompts, n=1, max_tokens=16, temperature=0.0)
    with torch.no_grad():
        for p, got in zip(prompts, out.completion_ids):
            hf = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
            assert got == hf[:len(got)], "vLLM and transformers decode the committed model differently"
    solved = sum(reward.score("math", out.texts, [r["ground_truth"] for r in rows]))
    assert solved >= 10, f"greedy decoding solves {solved}/16 held-out problems: the warm start lost its skill"


# ----------------------------------------------------------------------------------------------
# the rare-answer variant (data/prepare.py --variant rare): data/tiny_rare

TINY_RARE = ROOT / "data" / "tiny_rare"


def rare_recorded():
    return json.loads((TINY_RARE / "model" / "warm_start.json").read_text())


def test_rare_model_was_made_by_the_current_recipe():
    rec = rare_recorded()
    args = prepare.parser().parse_args(rec["argv"])
    assert args.variant == "rare"
    assert rec["recipe"] == prepare.recipe_hash(args), (
        "data/prepare.py's rare recipe changed since data/tiny_rare/model was built: rebuild it with "
        f"`python data/prepare.py {' '.join(rec['argv'])} --force` and commit data/tiny_rare")
    # the default's fingerprint does not see the rare variant's functions and flags, and the reverse
    default = prepare.parser().parse_args(recorded()["argv"])
    assert prepare.recipe_hash(default) != prepare.recipe_hash(args)


def test_rare_config_and_tasks_are_what_the_recipe_builds():
    args = prepare.parser().parse_args(rare_recorded()["argv"])
    built = prepare.build_model(len(prepare.build_tokenizer()), args).config
    saved = json.loads((TINY_RARE / "model" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert saved[key] == getattr(built, key), key
    rows = prepare.rare_make_tasks(args.seed, args.n_rare_train, args.n_rare_test)
    assert list(rows) == ["math"]
    for split, items in rows["math"].items():
        lines = (TINY_RARE / f"rare_math_{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == items, f"rare_math_{split}.jsonl differs from the recipe's"
    test = {r["problem"] for r in rows["math"]["test"]}
    assert not test & {r["problem"] for r in rows["math"]["train"]}, "held-out problems leak into train"


def test_rare_loads_by_name_and_its_answer_starts_rare():
    """tiny-rare-math loads through data/loaders.py (and not from data/tiny's folder), and the committed
    warm start samples the right letter rarely but knows it: mean mu of the answer token on the
    held-out problems in 0.01-0.05 (bench/rare_mu.py's measurement), the answer below the problem's
    two other letters and above every letter not in the problem on most problems."""
    import pytest
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data.loaders import load_problems
    sys.path.insert(0, str(ROOT / "bench"))
    import rare_mu

    rows = load_problems("tiny-rare-math", "test")
    assert len(rows) == 200 and {r["task"] for r in rows} == {"math"} and rows[0]["source"] == "tiny-rare-math"
    assert load_problems("tiny-rare-math", "test", data_dir=str(ROOT / "data")) == rows
    with pytest.raises(FileNotFoundError):
        load_problems("tiny-rare-math", "test", data_dir=str(TINY))   # never tiny's math_test.jsonl
    tok = AutoTokenizer.from_pretrained(str(TINY_RARE / "model"))
    model = AutoModelForCausalLM.from_pretrained(str(TINY_RARE / "model"), dtype=torch.float32).eval()
    for r in rows:
        r["prompt_ids"] = tok(r["problem"], add_special_tokens=False)["input_ids"]
    mu = rare_mu.answer_mu(model, tok, rows)
    assert 0.01 <= sum(mu) / len(mu) <= 0.05, f"mean mu of the answer token {sum(mu) / len(mu):.4f}"
    _, knows = prepare.rare_stats(model, rows, tok)
    assert knows >= 0.8, f"the warm start ranks the answer third on only {knows:.0%} of held-out problems"
