"""Answer probes: which rule the policy follows, read from its probabilities, not its samples.

    python train.py ... --eval_data tiny-rare-math --answer_probe letters   # every iteration
    bash run.sh kl atomic --task rare --answer_probe letters --probe_every 2

For a task whose answer is one token after a fixed prefix of the response (tiny-rare-math:
`max(q, c, x) = ?` -> `\\boxed{x}`), a probe names, per held-out problem, its kind and the answer
each candidate rule would give. Every `--probe_every` iterations the trainer's policy (the weights
after that iteration's update, as `eval_avg@k`) scores prompt + prefix + answer for every rule,
and the row gets `answer_prob`: {kind: {rule: mean probability over that kind's problems}}.

Choices:
1. Probabilities, not samples: p(answer | prompt, prefix) is exact where avg@k is an 8-sample
   estimate, and it sees a rule's answer drift to 0.002 where no sample would show it.
2. One forward pass per (problem, distinct answer) through train.py's own token_logprobs, so the
   probe reads the policy exactly as the loss does (head precision, FSDP shards); no sampling and
   no RNG draw, so a run with the probe trains exactly as one without it.
3. Checked at load (`AnswerProbe.tokens`): every rule's answer must be one token after the
   prefix in the tokenizer's own split of prefix + answer, else the probe would read another
   position than the one the policy writes the answer at.
4. A new task's probe is one entry of PROBES: its prefix, a row's kind, a row's rules.
"""
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from infra.logprobs import collate, token_logprobs


@dataclass
class AnswerProbe:
    prefix: str                          # the response's text before the answer token
    kind: Callable[[dict], str]          # a problem's kind: one table per kind
    rules: Callable[[dict], dict]        # rule name -> the answer (one token) it gives

    def tokens(self, rows, tok):
        """Per row (kind, {rule: answer token id}), prefix ids; ValueError for an answer that is
        not one token right after the prefix."""
        prefix_ids = tok(self.prefix, add_special_tokens=False)["input_ids"]
        table = []
        for row in rows:
            ids = {}
            for rule, answer in self.rules(row).items():
                whole = tok(self.prefix + answer, add_special_tokens=False)["input_ids"]
                if whole[:-1] != prefix_ids:
                    raise ValueError(f"--answer_probe: {row['id']}'s {rule} answer {answer!r} is "
                                     f"not one token after {self.prefix!r} ({whole}); accepted: "
                                     "a task whose answers are one token after the prefix")
                ids[rule] = whole[-1]
            table.append((self.kind(row), ids))
        return table, prefix_ids


LETTERS_PROBLEM = re.compile(r"^(max|min)\(([a-z]), ([a-z]), ([a-z])\) = \?")


def _letters(row):
    """(kind, first, second, third letter) of a "max(a, b, c) = ?" / "min(a, b, c) = ?" row."""
    m = LETTERS_PROBLEM.match(row["problem"])
    if not m:
        raise ValueError(f"--answer_probe letters: {row['id']} ({row['problem']!r}) is not "
                         "'max(a, b, c) = ?' or 'min(a, b, c) = ?'; accepted: tiny-rare-math rows")
    return m.groups()


def _letters_rules(row):
    """The right answer and the three rules a policy may have learnt instead: always the largest,
    the smallest, or the middle letter of the problem, whatever the operator says."""
    smallest, middle, largest = sorted(_letters(row)[1:])
    return {"right": row["ground_truth"], "largest": largest, "smallest": smallest,
            "middle": middle}


# tiny-rare-math (data/prepare.py --variant rare): max/min of three letters, answered `\boxed{x}`
PROBES = {"letters": AnswerProbe(prefix="\\boxed{", kind=lambda row: _letters(row)[0],
                                     rules=_letters_rules)}


class ProbeRun:
    """A probe bound to a run's held-out rows and tokenizer (built, and so checked, at start)."""

    def __init__(self, name, rows, tok, pad_id):
        self.table, self.prefix_ids = PROBES[name].tokens(rows, tok)
        self.rows, self.pad_id = rows, pad_id

    @torch.no_grad()
    def measure(self, model, acc, micro_batch_size=64, head_precision=None):
        """{kind: {rule: mean probability}} of the policy `model` over the held-out rows. Every
        rank scores rows[rank::world] (FSDP needs every rank in each forward) and gets the whole."""
        rank, world = acc.process_index, acc.num_processes
        # one sample per (row, distinct answer): prompt + prefix, and the answer as its completion
        owners = [(i, a) for i in range(rank, len(self.rows), world)
                  for a in dict.fromkeys(self.table[i][1].values())]
        batch = SimpleNamespace(prompt_ids=[self.rows[i]["prompt_ids"] + self.prefix_ids
                                            for i, _ in owners],
                                completion_ids=[[a] for _, a in owners])
        prob = {}
        was_training = model.training
        model.eval()
        for s in range(0, len(owners), micro_batch_size):
            idx = list(range(s, min(s + micro_batch_size, len(owners))))
            ids, attn, resp = collate(batch, idx, self.pad_id, acc.device)
            lp, _ = token_logprobs(model, ids, attn, resp, head_precision=head_precision)
            answer_logp = lp[resp[:, 1:].bool()]          # one per sample: its answer token
            for j, i in enumerate(idx):
                prob[owners[i]] = answer_logp[j].exp().item()
        model.train(was_training)
        mine = [(self.table[i][0], rule, prob[(i, a)])
                for i in range(rank, len(self.rows), world) for rule, a in self.table[i][1].items()]
        if world > 1:
            from accelerate.utils import gather_object
            mine = gather_object(mine)
        probs = {}
        for kind, rule, p in mine:
            probs.setdefault(kind, {}).setdefault(rule, []).append(p)
        return {kind: {rule: sum(ps) / len(ps) for rule, ps in rules.items()}
                for kind, rules in probs.items()}
