"""data/probes.py: --answer_probe reads the policy's probability of each rule's one-token answer.

1. The probe's numbers equal a plain forward pass by hand (softmax at the last position).
2. Bad input is refused at load: a row of another task, an answer that is not one token, the flag
   without held-out data, --probe_every 0.
3. A run with the probe trains exactly as one without it (metrics rows equal but for the timers),
   and logs answer_prob at the iterations --probe_every names.
"""
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import ENV, PY, ROOT, metrics, ok

from data.loaders import load_rows
from data.probes import PROBES, AnswerProbe, ProbeRun

RARE = ROOT / "data" / "tiny_rare"
CPU = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def rare():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(RARE / "model")
    model = AutoModelForCausalLM.from_pretrained(RARE / "model", dtype=torch.float32)
    rows = load_rows("tiny-rare-math", "test", str(RARE), "plain", tok)[:40]
    return SimpleNamespace(tok=tok, model=model, rows=rows)


def test_probe_equals_a_forward_pass_by_hand(rare):
    probe = ProbeRun("letters", rare.rows, rare.tok, rare.tok.pad_token_id)
    got = probe.measure(rare.model, CPU, micro_batch_size=7)   # 7: batches mix lengths
    prefix = rare.tok("\\boxed{", add_special_tokens=False)["input_ids"]
    sums = {}
    with torch.no_grad():
        for row in rare.rows:
            ids = torch.tensor([row["prompt_ids"] + prefix])
            p = rare.model(input_ids=ids).logits[0, -1].softmax(-1)
            kind = row["problem"][:3]
            letters = sorted(row["problem"][4:11].split(", "))
            for rule, letter in (("right", row["ground_truth"]), ("smallest", letters[0]),
                                 ("middle", letters[1]), ("largest", letters[2])):
                sums.setdefault(kind, {}).setdefault(rule, []).append(
                    p[rare.tok.convert_tokens_to_ids(letter)].item())
    assert got.keys() == sums.keys() == {"max", "min"}
    for kind, rules in sums.items():
        assert got[kind].keys() == rules.keys()
        for rule, ps in rules.items():
            assert abs(got[kind][rule] - sum(ps) / len(ps)) < 1e-6, (kind, rule)
    # the right answer is the largest letter on max problems, the smallest on min problems
    assert got["max"]["right"] == got["max"]["largest"]
    assert got["min"]["right"] == got["min"]["smallest"]
    # the warm start says the right letter rarely and the two others often (the confused
    # demonstrator of data/prepare.py --variant rare): mean mu 0.039 on all 200 held-out problems
    for kind in got:
        right = got[kind]["right"]
        others = [v for r, v in got[kind].items() if r != "right" and v != right]
        assert right < 0.1 and min(others) > 3 * right, got


def test_probe_reads_the_policy_at_head_precision(rare):
    """--head_precision reaches the probe: at bf16 its numbers are the bf16 head's by hand (the
    decoder's last hidden state and the LM head rounded to bf16, float32 softmax), not fp32's.
    The premise is checked: on these rows the two precisions differ by more than the tolerance."""
    probe = ProbeRun("letters", rare.rows, rare.tok, rare.tok.pad_token_id)
    got = probe.measure(rare.model, CPU, micro_batch_size=7, head_precision="bf16")
    prefix = rare.tok("\\boxed{", add_special_tokens=False)["input_ids"]
    head = rare.model.get_output_embeddings().weight
    hand = {"bf16": {}, "fp32": {}}
    with torch.no_grad():
        for row in rare.rows:
            ids = torch.tensor([row["prompt_ids"] + prefix])
            h = rare.model.model(input_ids=ids).last_hidden_state[0, -1]
            logits = {"bf16": (h.bfloat16() @ head.bfloat16().t()).float(), "fp32": h @ head.t()}
            letters = sorted(row["problem"][4:11].split(", "))
            for precision, x in logits.items():
                p = x.log_softmax(-1).exp()
                for rule, letter in (("right", row["ground_truth"]), ("smallest", letters[0]),
                                     ("middle", letters[1]), ("largest", letters[2])):
                    hand[precision].setdefault(row["problem"][:3], {}).setdefault(rule, []).append(
                        p[rare.tok.convert_tokens_to_ids(letter)].item())
    mean = {pr: {(k, r): sum(ps) / len(ps) for k, rules in t.items() for r, ps in rules.items()}
            for pr, t in hand.items()}
    off = max(abs(got[k][r] - p) for (k, r), p in mean["bf16"].items())
    apart = max(abs(p - mean["fp32"][kr]) for kr, p in mean["bf16"].items())
    assert off < 1e-5 < 5e-5 < apart, (off, apart)


def test_probe_refuses_rows_and_answers_it_cannot_read(rare):
    row = dict(rare.rows[0], id="x-1", problem="max(1, 2, 3) = ?\n")
    with pytest.raises(ValueError, match=r"x-1.*'max\(a, b, c\) = \?'"):
        ProbeRun("letters", [row], rare.tok, 0)
    two_tokens = AnswerProbe(prefix="\\boxed{", kind=lambda r: "all",
                             rules=lambda r: {"right": r["ground_truth"] + "}"})
    with pytest.raises(ValueError, match="right answer 'b}' is not one token after"):
        two_tokens.tokens([dict(rare.rows[0], ground_truth="b")], rare.tok)
    import train
    with pytest.raises(ValueError, match="--answer_probe='letters'.*--eval_data"):
        train.parse_args(["--answer_probe", "letters", "--eval_data", ""])
    with pytest.raises(ValueError, match="--probe_every=0"):
        train.parse_args(["--probe_every", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--answer_probe", "nope"])
    assert set(PROBES) == {"letters"}


@pytest.mark.slow
def test_a_run_with_the_probe_trains_as_one_without(tmp_path):
    base = [PY, "train.py", "--model", str(RARE / "model"), "--data_dir", str(RARE),
            "--train_data", "tiny-rare-math", "--eval_data", "tiny-rare-math", "--backend", "hf",
            "--iters", "3", "--prompts_per_iter", "8", "--prompts_per_update", "4",
            "--max_new_tokens", "12", "--eval_k", "1", "--target_kl", "0", "--threads", "1"]
    runs = {"plain": [], "probe": ["--answer_probe", "letters", "--probe_every", "2"]}
    procs = {name: subprocess.Popen(base + ["--out_dir", str(tmp_path / name)] + extra, cwd=ROOT,
                                    env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name, extra in runs.items()}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        ok(SimpleNamespace(returncode=proc.returncode, stdout=text, stderr=""))
    plain, probed = metrics(tmp_path / "plain"), metrics(tmp_path / "probe")
    assert ["answer_prob" in r for r in probed] == [False, True, False]
    for a, b in zip(plain, probed):
        b = {k: v for k, v in b.items() if k not in ("answer_prob", "time_probe_s")}
        assert a.keys() == b.keys()
        for k in a:
            if not (k.startswith("time_") or k == "tokens_per_s"):
                assert a[k] == b[k], k
    probs = probed[1]["answer_prob"]
    assert set(probs) == {"max", "min"} and all(0 < p < 1 for d in probs.values()
                                                for p in d.values())


def test_shortcut_study_classifies_by_the_rule_above_half_on_both_kinds():
    from bench.rare_shortcut import first_pass, rule_of

    def probs(max_right, max_smallest, min_right, min_largest):
        return {"max": {"right": max_right, "largest": max_right, "smallest": max_smallest,
                        "middle": 0.0},
                "min": {"right": min_right, "smallest": min_right, "largest": min_largest,
                        "middle": 0.0}}
    assert rule_of(probs(0.9, 0.05, 0.8, 0.1)) == "right"
    assert rule_of(probs(0.97, 0.01, 0.002, 0.967)) == "largest-letter"   # issue 35's seed-2 run
    assert rule_of(probs(0.1, 0.8, 0.9, 0.05)) == "smallest-letter"
    assert rule_of(probs(0.9, 0.05, 0.45, 0.45)) == "other"               # min half undecided
    hist = [{"iter": 1, "answer_prob": probs(0.3, 0.3, 0.3, 0.3)}, {"iter": 2},
            {"iter": 3, "answer_prob": probs(0.6, 0.2, 0.2, 0.51)}]
    assert first_pass(hist, "min", "largest") == 3 and first_pass(hist, "min", "right") is None


def shortcut_probs(max_right, max_smallest, min_right, min_largest):
    """An answer_prob entry: on max problems right = largest, on min problems right = smallest."""
    return {"max": {"right": max_right, "largest": max_right, "smallest": max_smallest, "middle": 0.0},
            "min": {"right": min_right, "smallest": min_right, "largest": min_largest, "middle": 0.0}}


def test_shortcut_study_counts_exactly_half_as_not_passed():
    """Choice 1 and 2 of bench/rare_shortcut.py: a letter passes at p strictly above 0.5, so a
    probability of exactly 0.5 (half the problems' mass) is not a learnt rule nor a passing point."""
    from bench.rare_shortcut import first_pass, rule_of
    assert rule_of(shortcut_probs(0.5, 0.1, 0.5, 0.1)) == "other"
    assert rule_of(shortcut_probs(0.1, 0.5, 0.1, 0.5)) == "other"
    hist = [{"iter": 1, "answer_prob": shortcut_probs(0.5, 0.5, 0.5, 0.5)},
            {"iter": 2, "answer_prob": shortcut_probs(0.6, 0.5, 0.5, 0.5)}]
    assert first_pass(hist, "max", "right") == 2
    assert [first_pass(hist, k, r) for k, r in (("min", "right"), ("max", "smallest"),
                                                ("min", "largest"))] == [None, None, None]


def test_shortcut_study_a_run_that_never_learnt_the_max_half_is_not_counted_as_learnt(tmp_path):
    """bench/rare_shortcut.py on a sweep folder of two 3-iteration runs: one whose right letter
    passes 0.5 on max problems at its last iteration, one whose never does. The first learnt the
    max half at iteration 3; the second never did, counted as iteration 4 (last + 1), not 3."""
    from bench.rare_shortcut import classes_table, max_half_at, read_runs
    max_right = {0: [0.2, 0.4, 0.7], 1: [0.2, 0.3, 0.4]}       # seed -> p(right) on max, per iter
    for seed, ps in max_right.items():
        run = tmp_path / f"kl-atomic_s{seed}"
        run.mkdir()
        (run / "result.json").write_text(json.dumps({"name": "kl-atomic", "seed": seed,
                                                     "eval": {"all": 10.0 * seed}}))
        rows = [{"iter": it, "updates": 2, "answer_prob": shortcut_probs(p, 0.1, 0.1, 0.8)}
                for it, p in enumerate(ps, 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = read_runs(str(tmp_path))
    assert [(r["seed"], r["iters"], r["right_max"]) for r in runs] == [(0, 3, 3), (1, 3, None)]
    assert [max_half_at(r) for r in runs] == [3, 4]
    table = classes_table("paper", runs)
    assert "| kl-atomic | 2 | 0 | 1 | 0 | 0 | 1 | 3.5 (3-4) |" in table, table
    assert "| 3 | 1 | 0 | kl-atomic s0 (largest-letter) |" in table, table
    assert "| 4 | 1 | 0 | kl-atomic s1 (other) |" in table, table
