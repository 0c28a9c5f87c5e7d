"""
Build the embedded default: synthetic tasks, a character tokenizer and a tiny warm-started model.

    python data/prepare.py              # writes data/tiny/ (about 2-3 minutes on 2 CPU cores)
    python data/prepare.py --force      # rebuild even if data/tiny/model exists

Everything the CPU default needs is made here from a seed, so nothing is downloaded:
1. Two verifiable tasks with disjoint train / held-out ("test") splits, in the row schema of
   data/loaders.py ({"id", "task", "problem", "ground_truth", "source"}):
   - math: small expressions ("max(37, 5, 81) = ?") answered as \\boxed{81}, checked by
     math-verify;
   - code: infer a linear function from two values ("f(0)=3, f(1)=5") and write it as a Python
     function in a fenced block, checked by running hidden tests in the sandbox of reward.py.
2. A character-level tokenizer built with `tokenizers` (byte-level BPE without merges, Qwen's
   format) and saved through `PreTrainedTokenizerFast`, so vLLM and transformers load it like
   any hub tokenizer.
3. A tiny Qwen2-architecture causal LM (about 0.7M parameters) saved with `save_pretrained`.
4. A short supervised warm start on train-split solutions, stopped once one sample at
   temperature 1 solves `--target` (30%) of validation problems: the starting policy solves a
   useful fraction of held-out problems, so that RL has room to show its effect.
"""
import argparse
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

def math_problem(rng):
    """The max or min of three numbers below 100.

    (One-digit sums were tried too: with only 100 of them, held-out sums share no problem with
    the train split and the warm start never learns them, so they only diluted the signal.)
    """
    kind = rng.choice(["max", "min"])
    xs = [rng.randint(0, 99) for _ in range(3)]
    return f"{kind}({xs[0]}, {xs[1]}, {xs[2]}) = ?\n", str(max(xs) if kind == "max" else min(xs))


def math_solution(answer):
    return f"\\boxed{{{answer}}}"


def code_problem(a, b):
    """Infer f(x) = a*x + b from f(0) and f(1); hidden call-based tests at other points."""
    problem = f"f(0)={b}, f(1)={a + b}. Write f.\n"
    xs = [-7, 3, 11, 25]
    tests = {"fn_name": "f", "inputs": [[x] for x in xs], "outputs": [a * x + b for x in xs]}
    return problem, json.dumps(tests)


def code_solution(a, b):
    return f"```python\ndef f(x):\n    return {a}*x{b:+d}\n```"


def make_tasks(seed, n_math_train, n_math_test):
    """Rows for both tasks; held-out problems never appear in train."""
    rng = random.Random(seed)
    rows = {"math": {"train": [], "test": []}, "code": {"train": [], "test": []}}
    seen = set()
    while len(rows["math"]["test"]) < n_math_test or len(rows["math"]["train"]) < n_math_train:
        problem, answer = math_problem(rng)
        if problem in seen:
            continue
        seen.add(problem)
        split = "test" if len(rows["math"]["test"]) < n_math_test else "train"
        rows["math"][split].append({"problem": problem, "ground_truth": answer,
                                    "solution": math_solution(answer)})
    pairs = [(a, b) for a in range(1, 10) for b in range(0, 10)]
    rng.shuffle(pairs)
    n_code_test = len(pairs) // 5                         # 18 held-out functions, 72 train
    for i, (a, b) in enumerate(pairs):
        problem, tests = code_problem(a, b)
        split = "test" if i < n_code_test else "train"
        rows["code"][split].append({"problem": problem, "ground_truth": tests,
                                    "solution": code_solution(a, b)})
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
    """Prompt + solution + EOS, loss on the solution tokens only; 30% code, 70% math."""
    pairs = []
    for _ in range(batch_size):
        row = rng.choice(rows["code" if rng.random() < 0.3 else "math"]["train"])
        pairs.append((tok(row["problem"])["input_ids"],
                      tok(row["solution"])["input_ids"] + [tok.eos_token_id]))
    return collate(pairs, tok.pad_token_id)


@torch.no_grad()
def solve_prob(model, items, tok):
    """Mean probability that one sample at temperature 1 is exactly the reference solution."""
    model.eval()
    total = 0.0
    for i in range(0, len(items), 100):
        chunk = items[i:i + 100]
        ids, labels, attn = collate([(tok(r["problem"])["input_ids"], tok(r["solution"])["input_ids"]
                                      + [tok.eos_token_id]) for r in chunk], tok.pad_token_id)
        logp = model(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)
        y = labels[:, 1:]
        tok_lp = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y >= 0)
        total += tok_lp.sum(1).exp().sum().item()
    model.train()
    return total / len(items)


def warm_start(model, rows, tok, args):
    """A short supervised pass so the starting policy is partly right (see docstring, item 4).

    It stops as soon as one sample solves `target` of the *validation* math problems on average
    (a slice of the train split; the held-out test split is never looked at), so the starting
    accuracy does not depend on how fast this machine is or on small changes to the tasks.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # linear warm-up then constant: without it the loss spikes early at this learning rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    rng = random.Random(args.seed + 1)
    val = rows["math"]["train"][:args.n_val]
    train = {task: {"train": s["train"][args.n_val:] if task == "math" else s["train"]}
             for task, s in rows.items()}
    model.train()
    t0, solved = time.time(), 0.0
    for step in range(1, args.steps + 1):
        ids, labels, attn = sft_batch(train, tok, rng, args.batch_size)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == args.steps:
            solved = solve_prob(model, val, tok)
            print(f"warm start step {step}/{args.steps} | loss {loss.item():.3f} | "
                  f"val solve {solved:.3f} | {time.time() - t0:.0f}s", flush=True)
            if solved >= args.target:
                break
    return {"steps": step, "final_loss": loss.item(), "val_solve": solved, "seconds": time.time() - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "tiny"), help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed for tasks and model init")
    p.add_argument("--n_math_train", type=int, default=20000, help="math train problems")
    p.add_argument("--n_math_test", type=int, default=200, help="held-out math problems")
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--steps", type=int, default=1500, help="warm-start optimizer steps at most")
    p.add_argument("--target", type=float, default=0.3, help="stop once validation solve rate reaches this")
    p.add_argument("--n_val", type=int, default=200, help="math train problems held for validation")
    p.add_argument("--batch_size", type=int, default=64, help="warm-start sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="warm-start learning rate")
    p.add_argument("--warmup", type=int, default=50, help="warm-start lr warm-up steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    args = p.parse_args()
    model_dir = os.path.join(args.out, "model")
    if os.path.exists(os.path.join(model_dir, "config.json")) and not args.force:
        print(f"{model_dir} exists; nothing to do (--force rebuilds)")
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = make_tasks(args.seed, args.n_math_train, args.n_math_test)
    os.makedirs(args.out, exist_ok=True)
    for task, splits in rows.items():
        for split, items in splits.items():
            with open(os.path.join(args.out, f"{task}_{split}.jsonl"), "w") as f:
                for row in items:
                    f.write(json.dumps(row) + "\n")

    tok = build_tokenizer()
    model = build_model(len(tok), args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen2: {n_params / 1e6:.2f}M parameters, vocab {len(tok)}")
    report = warm_start(model, rows, tok, args)

    # written to a temporary folder and renamed, so an interrupted build never looks complete
    tmp = model_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump({**report, "params": n_params, "argv": sys.argv[1:]}, f, indent=1)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    print(f"wrote {args.out} (tasks, tokenizer, model) after {report['seconds']:.0f}s of warm start")


if __name__ == "__main__":
    main()
