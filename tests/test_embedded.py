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
    from rollout import VLLMRollout
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
