"""LoRA through peft (--lora_rank): only the adapters train, vLLM samples base + adapters, a run
writes final/ (merged, a plain model folder) and adapter/ (peft's format), resume is exact, and bad
LoRA flags are refused at load time. train.py runs as a subprocess on the session's tiny model.

Run: .venv/bin/python -m pytest tests/test_lora.py -q   (CPU, no network, about 3 minutes)
"""
import json
import os

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import PY, ROOT, load_params, metrics, ok, run

import train
from infra.lora import add_adapters, policy_weights
from infra.models import load_policy

TIMERS = ("time_rollout_s", "time_reward_s", "time_logp_s", "time_update_s", "time_sync_s",
          "time_iter_s", "tokens_per_s")
# rank 4 on every linear layer of attention and MLP; lr 1e-2 so 2 steps move the adapters visibly
LORA = ["--lora_rank", "4", "--lr", "1e-2"]


def train_cmd(tiny, out, *flags):
    return [PY, "train.py", "--model", str(tiny / "model"), "--data_dir", str(tiny), "--threads",
            "1", "--prompts_per_iter", "8", "--prompts_per_update", "4", "--group_size", "4",
            "--max_new_tokens", "16", "--out_dir", str(out), *LORA, *flags]


def checkpoint_weights(out, it):
    """The policy's tensors as the checkpoint holds them (peft's names)."""
    return load_file(str(out / "checkpoints" / f"iter_{it:06d}" / "model.safetensors"))


@pytest.mark.slow
def test_only_the_adapters_train_and_vllm_samples_them(tiny, tmp_path):
    out = tmp_path / "lora"
    ok(run(train_cmd(tiny, out, "--iters", "2", "--kl_coef", "0.1"), timeout=300)[0])
    rows = metrics(out)
    # iteration 2 sampled from what the sync sent after iteration 1's update (base + adapters):
    # the trainer's recompute agrees with vLLM's log-probs to float32 noise (full sync: < 1e-6)
    assert rows[1]["logp_gap_vllm"] < 1e-6, rows[1]["logp_gap_vllm"]
    assert rows[1]["kl_ref"] > 0, "the reference (adapters off) equals the policy: no adapter moved"
    start, ckpt = load_params(tiny / "model"), checkpoint_weights(out, 2)
    base = {k: v for k, v in ckpt.items() if ".lora_" not in k}
    lora_b = [v for k, v in ckpt.items() if ".lora_B." in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b), "an adapter did not train"
    for name, t in base.items():   # every base weight bitwise the start model's
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(t, start[hf]), f"{hf} changed"
    # final/ is base + scale B A, merged; adapter/ loads with peft onto the base to the same weights
    final = load_params(out / "final")
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(model, str(out / "adapter"))
    merged = dict(policy_weights(adapted))
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_size < 1 << 20
    assert final.keys() <= merged.keys()
    # and peft's own merge (merge_and_unload) of the same adapter gives the same weights
    base = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32)
    peft_merged = peft.PeftModel.from_pretrained(base, str(out / "adapter")).merge_and_unload()
    peft_merged = peft_merged.state_dict()
    moved = 0
    for k, v in final.items():
        assert torch.equal(v, merged[k]), k
        torch.testing.assert_close(v, peft_merged[k], rtol=1e-6, atol=1e-7, msg=k)
        moved += not torch.equal(v, start[k])
    assert moved >= 7, f"only {moved} tensors of final/ differ from the start model"


@pytest.mark.slow
def test_resume_continues_exactly_and_eval_py_scores_final_as_the_trainer_did(tiny, tmp_path):
    """--backend hf (one generate call per evaluation, so eval.py's samples are the trainer's): a
    run stopped after iteration 1 and resumed equals the straight run, and eval.py on its final/
    gives the trainer's own end-of-run avg@k."""
    hf = ["--backend", "hf", "--eval_data", "tiny-math", "--eval_k", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ok(run(train_cmd(tiny, straight, "--iters", "2", *hf), timeout=300)[0])
    ok(run(train_cmd(tiny, resumed, "--iters", "1", *hf), timeout=300)[0])
    ok(run(train_cmd(tiny, resumed, "--iters", "2", "--resume", *hf), timeout=300)[0])
    a, b = metrics(straight), metrics(resumed)
    assert [r["iter"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        for k in ra:
            if k not in TIMERS:
                assert ra[k] == rb[k], f"iteration {ra['iter']} {k}: {ra[k]} vs {rb[k]}"
    pa, pb = checkpoint_weights(straight, 2), checkpoint_weights(resumed, 2)
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "the resumed run's adapters differ"
    ev = ok(run([PY, "eval.py", "--model", str(straight / "final"), "--data_dir", str(tiny),
                 "--data", "tiny-math", "--k", "2", "--seed", "0", "--backend", "hf", "--max_new_tokens", "16",
                 "--out", str(tmp_path / "eval.json")], timeout=300)[0])
    got = json.loads((tmp_path / "eval.json").read_text())["avg@2"]
    want = json.loads((straight / "eval.json").read_text())["avg@2"]
    assert got == want, (got, want, ev.stdout[-1000:])


def test_bad_lora_flags_are_refused_at_load_time(tiny, tmp_path):
    with pytest.raises(ValueError, match="--lora_rank=-1; accepted: 0 .off. or a positive rank"):
        train.parse_args(["--lora_rank", "-1"])
    with pytest.raises(ValueError, match="--lora_dropout=1.5"):
        train.parse_args(["--lora_rank", "4", "--lora_dropout", "1.5"])
    args = train.parse_args(["--lora_rank", "4", "--lora_target_modules", "q_proj,qkv"])
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32)
    with pytest.raises(ValueError, match="no linear layer named qkv; it has down_proj, gate_proj, "
                                         "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        add_adapters(model, args)
    # through train.py: refused after the model loads, before any engine starts or step is taken
    proc, _ = run(train_cmd(tiny, tmp_path / "bad", "--lora_target_modules", "attn"), timeout=120)
    assert proc.returncode != 0 and "no linear layer named attn" in proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    assert os.path.isdir(ROOT / "data" / "tiny" / "model")


def adapted_layers(model):
    """The names (their last part) of the linear layers that carry a LoRA adapter, and how many."""
    names = [n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, peft.tuners.lora.LoraLayer)]
    return {n: names.count(n) for n in names}


def test_lora_target_modules_choose_the_adapted_layers(tiny):
    """The policy train.setup loads (infra/models.load_policy) carries adapters on exactly the
    layers --lora_target_modules names, in every decoder layer, and only their adapters train;
    the default 'all-linear' adapts every linear layer of attention and MLP, not the LM head."""
    layers = AutoModelForCausalLM.from_pretrained(str(tiny / "model")).config.num_hidden_layers
    for targets, want in [("q_proj,v_proj", {"q_proj", "v_proj"}), ("down_proj", {"down_proj"}),
                          ("all-linear", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"})]:
        args = train.parse_args(["--model", str(tiny / "model"), "--lora_rank", "4",
                                 "--lora_target_modules", targets])
        model = load_policy(args)
        assert adapted_layers(model) == {n: layers for n in want}, targets
        trained = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters()
                   if p.requires_grad}
        assert trained == want, (targets, trained)


def test_weight_metadata_names_what_the_sync_sends_without_gathering(tiny):
    """vLLM's NCCL and IPC trainer engines (--vllm_server on GPUs) send every weight's name, dtype
    and shape before its bytes: infra/lora.policy_weight_meta must list exactly what
    policy_weights yields, in order, with adapters (merged) and without. Checked by vLLM's own
    check of a WeightSource against its metadata (NCCLTrainerWeightTransferEngine._checked_iter)
    on the source --vllm_server builds (infra/vllm_server.policy_source)."""
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from infra.lora import policy_weight_meta
    from infra.vllm_server import policy_source
    from rollout import weight_buckets
    for flags in ([], ["--lora_rank", "4"]):
        model = load_policy(train.parse_args(["--model", str(tiny / "model"), *flags]))
        sent = [(n, t.dtype, tuple(t.shape)) for n, t in policy_weights(model)]
        assert list(policy_weight_meta(model)) == sent, flags
        assert any(".lora_" in n for n, _ in model.named_parameters()) == bool(flags)
        rollout = SimpleNamespace(policy=model, _buckets=weight_buckets(model, bucket_mb=0))
        source = policy_source(rollout)
        checked = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
        assert [n for n, _ in checked] == [n for n, *_ in sent], flags
