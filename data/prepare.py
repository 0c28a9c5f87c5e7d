"""
Build the embedded default: synthetic tasks, a character tokenizer and a tiny warm-started model.

    python data/prepare.py              # writes data/tiny/ (about 2-3 minutes on 2 CPU cores)
    python data/prepare.py --force      # rebuild even if data/tiny/model exists
    python data/prepare.py --variant rare --steps 3000   # data/tiny_rare: the right answer starts rare
                                                        # (about 3 minutes on 1 thread; item 5)

Everything the CPU default needs is made here from a seed, so nothing is downloaded:
1. Two verifiable tasks with disjoint train / held-out ("test") splits, in the row schema of
   data/loaders.py ({"id", "task", "problem", "ground_truth", "source"}):
   - math: the max or min of three distinct digits ("max(3, 7, 1) = ?") answered as \\boxed{7},
     checked by math-verify (1,440 problems, 200 held out);
   - code: write "f(x) = 3x-4" as a Python function in a fenced block, checked by running hidden
     tests in the sandbox of reward.py (171 problems, 34 held out).
2. A character-level tokenizer built with `tokenizers` (byte-level BPE without merges, Qwen's
   format) and saved through `PreTrainedTokenizerFast`, so vLLM and transformers load it like
   any hub tokenizer.
3. A tiny Qwen2-architecture causal LM (about 0.7M parameters) saved with `save_pretrained`.
4. A supervised warm start that imitates a *noisy demonstrator*: it writes each answer
   character right with probability q (--q_math, --q_code) and otherwise a random one of the
   same kind. Stopped once greedy decoding solves --target of validation problems, the policy
   knows the skill (the right answer is its mode) but one sample at temperature 1 is right only
   about 20-35% of the time: room for RL to show its effect by sharpening, not by teaching.
5. --variant rare (data/tiny_rare, data set tiny-rare-math): where the right answer token starts
   rare, so that the trust region's treatment of rare tokens can matter. Math only: the max or
   min of three distinct letters a-z ("max(q, c, x) = ?" -> \\boxed{x}; 31,200 problems, 3,000
   train and 200 held out), and a *confused* demonstrator that knows the answer but writes it
   with probability --q_rare (0.02) only, else one of the problem's two other letters. The warm
   start learns the rule (it must find the answer to avoid it) and samples the answer letter
   with mu of about 0.04 on held-out problems (pass@8 about 22%; bench/rare_mu.py measures it).
   The same tokenizer, model and training loop settings; its own functions (rare_*) and flags
   enter its recipe hash only, so the default's hash is unchanged.
"""
import argparse
import hashlib
import inspect
import itertools
import json
import os
import random
import shutil
import sys
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
EOS = "<|endoftext|>"

# ----------------------------------------------------------------------------------------------
# tasks

def math_problems():
    """Every "max(a, b, c) = ?" and "min(a, b, c) = ?" over three distinct digits: 1,440 problems."""
    digits = range(10)
    out = []
    for kind, fn in (("max", max), ("min", min)):
        for a in digits:
            for b in digits:
                for c in digits:
                    if len({a, b, c}) == 3:
                        out.append((f"{kind}({a}, {b}, {c}) = ?\n", str(fn(a, b, c))))
    return out


def math_solution(answer):
    return f"\\boxed{{{answer}}}"


def code_problems():
    """Write f(x) = a*x + b, stated in the prompt, as a Python function: 171 problems.

    The reward runs hidden call-based tests at points the prompt does not show.
    """
    xs = [-7, 3, 11, 25]
    out = []
    for a in range(1, 10):
        for b in range(-9, 10):
            tests = {"fn_name": "f", "inputs": [[x] for x in xs], "outputs": [a * x + b for x in xs]}
            out.append((f"f(x) = {a}x{b:+d}. Write f.\n", json.dumps(tests), (a, b)))
    return out


def code_solution(a, b):
    return f"```python\ndef f(x):\n    return {a}*x{b:+d}\n```"


def make_tasks(seed, n_math_train, n_math_test, n_code_test):
    """Rows for both tasks, shuffled from a seed; held-out problems never appear in train."""
    rng = random.Random(seed)
    math = [{"problem": p, "ground_truth": a, "solution": math_solution(a)} for p, a in math_problems()]
    code = [{"problem": p, "ground_truth": t, "solution": code_solution(*ab)} for p, t, ab in code_problems()]
    rng.shuffle(math)
    rng.shuffle(code)
    if n_math_test + n_math_train > len(math):
        raise ValueError(f"--n_math_train {n_math_train} + --n_math_test {n_math_test} exceeds the "
                         f"{len(math)} distinct math problems")
    rows = {"math": {"test": math[:n_math_test], "train": math[n_math_test:n_math_test + n_math_train]},
            "code": {"test": code[:n_code_test], "train": code[n_code_test:]}}
    for task, splits in rows.items():
        for split, items in splits.items():
            for i, row in enumerate(items):
                row.update(id=f"tiny-{task}-{split}-{i}", task=task, source=f"tiny-{task}")
    return rows


# ----------------------------------------------------------------------------------------------
# tokenizer and model

def build_tokenizer():
    """A character-level tokenizer in the byte-level BPE format of Qwen's own tokenizer.

    One token per byte-level character and no merges, so every character is one token. The
    Qwen format matters: transformers 5 loads any tokenizer of a `qwen2` model as
    Qwen2Tokenizer, which re-installs Qwen's byte-level pre-tokenizer; a plain character
    vocabulary would then silently lose its spaces and newlines. EOS doubles as padding.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())      # the 256 byte-level characters
    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=512)


def build_model(vocab_size, args):
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config)


def collate(pairs, pad_id):
    """(prompt ids, solution ids) pairs -> right-padded ids, labels (solution only), mask."""
    T = max(len(p) + len(s) for p, s in pairs)
    ids = torch.full((len(pairs), T), pad_id)
    labels = torch.full((len(pairs), T), -100)
    attn = torch.zeros((len(pairs), T), dtype=torch.long)
    for i, (p, s) in enumerate(pairs):
        n = len(p) + len(s)
        ids[i, :n] = torch.tensor(p + s)
        labels[i, len(p):n] = torch.tensor(s)
        attn[i, :n] = 1
    return ids, labels, attn


def sft_batch(rows, tok, rng, batch_size):
    """Prompt + reference solution + EOS for random train problems, 30% code and 70% math."""
    pairs, tasks = [], []
    for _ in range(batch_size):
        task = "code" if rng.random() < 0.3 else "math"
        row = rng.choice(rows[task]["train"])
        pairs.append((tok(row["problem"])["input_ids"], tok(row["solution"])["input_ids"] + [tok.eos_token_id]))
        tasks.append(task)
    return collate(pairs, tok.pad_token_id) + (tasks,)


def noisy_demonstrator_loss(logits, labels, keep, char_sets):
    """Cross-entropy against a demonstrator that writes each answer character right with
    probability `keep` and otherwise a uniformly random character of its kind (a digit for a
    digit, a sign for a sign); every other character of the solution is always right.

    This is the demonstrator's *expected* loss, i.e. label smoothing restricted to the answer
    characters: target = keep * onehot(y) + (1 - keep) * uniform(kind of y). Sampling the noise
    instead makes the model memorise per-problem wrong answers and lose the skill (tried).
    logits (B, T, V) and labels (B, T) are already shifted; keep (B,) per row.
    """
    logp = logits.float().log_softmax(-1)
    valid = labels >= 0
    y = labels.clamp(min=0)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    k = keep[:, None]
    loss = nll
    for ids in char_sets:                                  # e.g. the ten digits, then + and -
        ids = torch.tensor(ids)
        is_kind = torch.isin(y, ids) & valid
        uniform_nll = -logp[..., ids].mean(-1)
        loss = torch.where(is_kind, k * nll + (1 - k) * uniform_nll, loss)
    return (loss * valid).sum() / valid.sum()


@torch.no_grad()
def solve_stats(model, items, tok):
    """(mean probability that one sample at temperature 1 is exactly the reference solution,
    fraction of problems whose greedy decoding is the reference solution)."""
    model.eval()
    prob, greedy = 0.0, 0
    for i in range(0, len(items), 100):
        chunk = items[i:i + 100]
        ids, labels, attn = collate([(tok(r["problem"])["input_ids"], tok(r["solution"])["input_ids"]
                                      + [tok.eos_token_id]) for r in chunk], tok.pad_token_id)
        logp = model(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)
        y = labels[:, 1:]
        tok_lp = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y >= 0)
        prob += tok_lp.sum(1).exp().sum().item()
        # teacher-forced argmax equals every reference token <=> greedy decoding writes it
        greedy += ((logp.argmax(-1) == y) | (y < 0)).all(1).sum().item()
    model.train()
    return prob / len(items), greedy / len(items)


def sft_loop(model, args, next_batch, loss_of, validate, done):
    """The warm start's loop, both recipes': AdamW with a linear warm-up, one clipped step per
    batch, validated every --eval_every steps and at the last, stopped once done(report).
    next_batch() -> (ids, labels, attention, *extra); loss_of(logits, labels, *extra) -> loss,
    both in the shifted coordinates (logits[:, t] predicts ids[t + 1]); validate() ->
    (report, its text for the log). Returns (steps taken, final loss, seconds, report)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # linear warm-up then constant: without it the loss spikes early at this learning rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    model.train()
    t0, report = time.time(), None
    for step in range(1, args.steps + 1):
        ids, labels, attn, *extra = next_batch()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        loss = loss_of(logits, labels[:, 1:], *extra)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            report, text = validate()
            print(f"warm start step {step}/{args.steps} | loss {loss.item():.3f} | val {text} | "
                  f"{time.time() - t0:.0f}s", flush=True)
            if done(report):
                break
    return step, loss.item(), time.time() - t0, report


def warm_start(model, rows, tok, args):
    """Supervised training on the noisy demonstrator (the docstring's item 4).

    It stops once greedy decoding is right on `target` of the validation problems of both tasks
    (slices of the train split; the held-out test split is never looked at), so the starting
    point does not depend on this machine's speed: the skill is learned and the correct answer
    is the policy's mode, while one sample at temperature 1 is right only about as often as the
    demonstrator (math: q_math + (1 - q_math) / 10).
    """
    rng = random.Random(args.seed + 1)
    val = {task: s["train"][:args.n_val] for task, s in rows.items()}
    train = {task: {"train": s["train"][args.n_val:]} for task, s in rows.items()}
    char_sets = [tok.convert_tokens_to_ids(list("0123456789")), tok.convert_tokens_to_ids(list("+-"))]
    keep_of = {"math": args.q_math, "code": args.q_code}

    def next_batch():   # each row's q: how often its demonstrator writes an answer character right
        ids, labels, attn, tasks = sft_batch(train, tok, rng, args.batch_size)
        return ids, labels, attn, torch.tensor([keep_of[t] for t in tasks])

    def validate():
        report = {task: solve_stats(model, items, tok) for task, items in val.items()}
        return report, " | ".join(f"{t} sample {p:.3f} greedy {g:.3f}" for t, (p, g) in report.items())

    step, loss, seconds, report = sft_loop(
        model, args, next_batch, lambda lg, lb, keep: noisy_demonstrator_loss(lg, lb, keep, char_sets),
        validate, lambda report: all(g >= args.target for _, g in report.values()))
    return {"steps": step, "final_loss": loss, "seconds": seconds,
            "val": {t: {"sample_solve": p, "greedy_solve": g} for t, (p, g) in report.items()}}


# ----------------------------------------------------------------------------------------------
# the rare-answer variant (--variant rare): data/tiny_rare, where the right answer starts rare

LETTERS = "abcdefghijklmnopqrstuvwxyz"
RARE_PREFIX = "\\boxed{"   # what the demonstrator writes before the answer letter


def rare_math_problems():
    """Every "max(a, b, c) = ?" and "min(a, b, c) = ?" over three distinct letters a-z in
    alphabetical order: 31,200 problems, each answered by one of 26 letters (one token each).
    Each item: (problem, answer, the two other letters of the problem)."""
    out = []
    for kind, fn in (("max", max), ("min", min)):
        for a, b, c in itertools.permutations(LETTERS, 3):
            answer = fn(a, b, c)
            out.append((f"{kind}({a}, {b}, {c}) = ?\n", answer, [x for x in (a, b, c) if x != answer]))
    return out


def rare_make_tasks(seed, n_train, n_test):
    """Math rows only (task "math", source "tiny-rare-math"), shuffled from a seed; held-out
    problems never appear in train. "others" (the problem's two other letters) is what the
    confused demonstrator writes instead of the answer; loaders and rewards ignore it."""
    rng = random.Random(seed)
    math = [{"problem": p, "ground_truth": a, "solution": math_solution(a), "others": o}
            for p, a, o in rare_math_problems()]
    rng.shuffle(math)
    if n_train + n_test > len(math):
        raise ValueError(f"--n_rare_train {n_train} + --n_rare_test {n_test} exceeds the {len(math)} problems")
    rows = {"math": {"test": math[:n_test], "train": math[n_test:n_test + n_train]}}
    for split, items in rows["math"].items():
        for i, row in enumerate(items):
            row.update(id=f"tiny-rare-math-{split}-{i}", task="math", source="tiny-rare-math")
    return rows


def rare_sft_batch(rows, tok, rng, batch_size):
    """Prompt + reference solution + EOS for random train problems, plus (in the shifted
    coordinates of the loss) each row's answer position and its two other letters' token ids."""
    pairs, pos, others = [], [], []
    n_prefix = len(tok(RARE_PREFIX)["input_ids"])
    for _ in range(batch_size):
        row = rng.choice(rows)
        p = tok(row["problem"])["input_ids"]
        pairs.append((p, tok(row["solution"])["input_ids"] + [tok.eos_token_id]))
        pos.append(len(p) + n_prefix - 1)       # logits[:, t] predicts ids[t + 1]
        others.append(tok.convert_tokens_to_ids(row["others"]))
    return collate(pairs, tok.pad_token_id) + (torch.tensor(pos), torch.tensor(others))


def confused_demonstrator_loss(logits, labels, pos, others, q):
    """Cross-entropy against a demonstrator that knows the answer but writes it with probability q
    only, and otherwise one of the problem's two other letters (uniformly): every other character
    of the solution is always right. Its expected loss, as noisy_demonstrator_loss: at the answer
    position the target is q * onehot(answer) + (1 - q) / 2 on each other letter. So the warm start
    learns the rule (it must find the answer to put little mass on it) and samples it with
    probability about q: the answer token starts rare (mu ~ q) while the policy knows it."""
    logp = logits.float().log_softmax(-1)
    valid = labels >= 0
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(len(pos))
    other_nll = -logp[rows, pos].gather(-1, others).mean(-1)
    at_answer = torch.zeros_like(valid)
    at_answer[rows, pos] = True
    nll = torch.where(at_answer, q * nll + (1 - q) * other_nll[:, None], nll)
    return (nll * valid).sum() / valid.sum()


@torch.no_grad()
def rare_stats(model, items, tok):
    """(mean probability of the answer token at the answer position, i.e. the mu of the answer
    after the prompt and "\\boxed{", fraction of problems where the policy "knows" the answer: it
    ranks third, below the two other letters and above every letter not in the problem)."""
    model.eval()
    mu, knows = 0.0, 0
    for i in range(0, len(items), 100):
        chunk = items[i:i + 100]
        ids, _, attn, pos, others = rare_sft_batch(chunk, tok, _Cycle(chunk), len(chunk))
        probs = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().softmax(-1)
        rows = torch.arange(len(chunk))
        at = probs[rows, pos]                                       # (B, V) at the answer position
        y = torch.tensor(tok.convert_tokens_to_ids([r["ground_truth"] for r in chunk]))
        p_y = at[rows, y]
        letters = torch.tensor(tok.convert_tokens_to_ids(list(LETTERS)))
        rest = at[:, letters].clone()
        rest[(letters[None, :] == y[:, None]) | (letters[None, :, None] == others[:, None, :]).any(-1)] = 0
        knows += ((at.gather(-1, others).min(-1).values > p_y) & (p_y > rest.max(-1).values)).sum().item()
        mu += p_y.sum().item()
    model.train()
    return mu / len(items), knows / len(items)


class _Cycle:
    """A stand-in for random.Random whose choice() walks a list in order (rare_stats scores each
    item once through rare_sft_batch)."""
    def __init__(self, items):
        self.it = iter(items)

    def choice(self, _):
        return next(self.it)


def rare_warm_start(model, rows, tok, args):
    """warm_start for the rare variant: the confused demonstrator (q = --q_rare) on math only.

    It stops once, on validation problems (a slice of train), the policy knows the answer on
    `target` of them (rare_stats) and the answer's mean probability is within 1.5 x q, so the
    start is the demonstrator's: the skill learned, the answer sampled about q of the time.
    """
    rng = random.Random(args.seed + 1)
    val, train = rows["math"]["train"][:args.n_val], rows["math"]["train"][args.n_val:]

    def validate():
        mu, knows = rare_stats(model, val, tok)
        return (mu, knows), f"answer mu {mu:.4f} knows {knows:.3f}"

    step, loss, seconds, (mu, knows) = sft_loop(
        model, args, lambda: rare_sft_batch(train, tok, rng, args.batch_size),
        lambda lg, lb, pos, others: confused_demonstrator_loss(lg, lb, pos, others, args.q_rare),
        validate, lambda report: report[1] >= args.target and report[0] <= 1.5 * args.q_rare)
    return {"steps": step, "final_loss": loss, "seconds": seconds,
            "val": {"math": {"answer_mu": mu, "knows": knows}}}


# the functions and flags that decide what the model is; threads, output folder and --force do not
RECIPE_FUNCTIONS = ("math_problems", "math_solution", "code_problems", "code_solution", "make_tasks",
                    "build_tokenizer", "build_model", "collate", "sft_batch", "noisy_demonstrator_loss",
                    "solve_stats", "sft_loop", "warm_start")
NOT_RECIPE = ("out", "threads", "force")
# the rare variant's: part of its recipe, and absent from the default's (whose hash predates them)
RARE_FUNCTIONS = ("rare_math_problems", "rare_make_tasks", "rare_sft_batch", "confused_demonstrator_loss",
                  "rare_stats", "_Cycle", "rare_warm_start")
RARE_FLAGS = ("variant", "q_rare", "n_rare_train", "n_rare_test")


def recipe_hash(args):
    """A fingerprint of the recipe: the source of the functions that build the tasks, tokenizer
    and model, and every flag that changes them. The committed data/tiny/model records it, and a
    test checks it against this file, so the committed weights are known to come from this code
    (not that a rebuild reproduces them bitwise: another CPU's float arithmetic would not)."""
    rare = args.variant == "rare"
    names = RECIPE_FUNCTIONS + (RARE_FUNCTIONS if rare else ())
    source = "".join(inspect.getsource(globals()[name]) for name in names)
    flags = {k: v for k, v in sorted(vars(args).items())
             if k not in NOT_RECIPE and (rare or k not in RARE_FLAGS)}
    return hashlib.sha256((source + json.dumps(flags)).encode()).hexdigest()[:16]


def parser():

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", default=None, help="output folder (default data/tiny, or data/tiny_rare for --variant rare)")
    p.add_argument("--variant", default="default", choices=("default", "rare"),
                   help="rare: math only, max/min of three letters a-z, written right with probability "
                        "--q_rare by the demonstrator (data/tiny_rare: the answer token starts rare)")
    p.add_argument("--q_rare", type=float, default=0.02,
                   help="rare variant: how often the demonstrator writes the answer letter (else one of "
                        "the problem's two other letters)")
    p.add_argument("--n_rare_train", type=int, default=3000, help="rare variant: train problems (incl. validation)")
    p.add_argument("--n_rare_test", type=int, default=200, help="rare variant: held-out problems")
    p.add_argument("--seed", type=int, default=0, help="seed for tasks and model init")
    p.add_argument("--n_math_train", type=int, default=1240, help="math train problems (incl. validation)")
    p.add_argument("--n_math_test", type=int, default=200, help="held-out math problems")
    p.add_argument("--n_code_test", type=int, default=34, help="held-out code problems (of 171)")
    p.add_argument("--q_math", type=float, default=0.25,
                   help="how often the demonstrator writes each math answer character right")
    p.add_argument("--q_code", type=float, default=0.6,
                   help="how often the demonstrator writes each code coefficient character right")
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--steps", type=int, default=1500, help="warm-start optimizer steps at most")
    p.add_argument("--target", type=float, default=0.9,
                   help="stop once greedy decoding solves this fraction of validation problems")
    p.add_argument("--n_val", type=int, default=40, help="train problems per task held for validation")
    p.add_argument("--batch_size", type=int, default=64, help="warm-start sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="warm-start learning rate")
    p.add_argument("--eval_every", type=int, default=10, help="validate every this many steps")
    p.add_argument("--warmup", type=int, default=50, help="warm-start lr warm-up steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    return p


def main():
    args = parser().parse_args()
    rare = args.variant == "rare"
    args.out = args.out or os.path.join(HERE, "tiny_rare" if rare else "tiny")
    model_dir = os.path.join(args.out, "model")
    if os.path.exists(os.path.join(model_dir, "config.json")) and not args.force:
        print(f"{model_dir} exists; nothing to do (--force rebuilds)")
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    if rare:
        rows = rare_make_tasks(args.seed, args.n_rare_train, args.n_rare_test)
    else:
        rows = make_tasks(args.seed, args.n_math_train, args.n_math_test, args.n_code_test)
    os.makedirs(args.out, exist_ok=True)
    for task, splits in rows.items():
        for split, items in splits.items():
            # rare_math_*.jsonl: a name of its own, so no --data_dir can mistake tiny's files for it
            with open(os.path.join(args.out, f"{'rare_' if rare else ''}{task}_{split}.jsonl"), "w") as f:
                for row in items:
                    f.write(json.dumps(row) + "\n")

    tok = build_tokenizer()
    model = build_model(len(tok), args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen2: {n_params / 1e6:.2f}M parameters, vocab {len(tok)}")
    report = (rare_warm_start if rare else warm_start)(model, rows, tok, args)

    # written to a temporary folder and renamed, so an interrupted build never looks complete
    tmp = model_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump({**report, "params": n_params, "argv": sys.argv[1:], "recipe": recipe_hash(args),
                   "threads": torch.get_num_threads()}, f, indent=1)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    print(f"wrote {args.out} (tasks, tokenizer, model) after {report['seconds']:.0f}s of warm start")


if __name__ == "__main__":
    main()
