"""The sampler as a service (infra/vllm_server.py, infra/gloo_transfer.py): real vLLM servers on the
tiny model, started by the tests with the README's command (`python rollout.py serve`), no mock.

- the weight sync is exact with every weight changed, the embedding (tied to the LM head) included;
- train.py against a server repeats itself at K = 0 and K = 1 (one seed, the same rows);
- two servers share the prompts and one transfer group, and the rows stay the same;
- faults: no server at the URL, a server serving another model, a server that dies mid-run
  (stop, then --resume once one is back), a transfer that fails halfway (the server stays paused
  at the old version, and the next run's sync repairs it);
- two trainer processes against one server repeat themselves and leave it the final weights
  (each rank asks for its own prompts, rank 0 sends the weights);
- a run at K = 1 against a server, SIGKILLed in a checkpoint and resumed, trains the unbroken run's
  batches token for token.
"""
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ENV, LAUNCH_2, MP, PY, ROOT, free_port, metrics, ok, run, train_cmd, update_of

pytestmark = pytest.mark.slow

MAX_LEN = 256


class Served:
    """`python rollout.py serve MODEL --port P` in the background; stopped by its pid."""

    def __init__(self, model, log_dir, port=None):
        self.model, self.port = str(model), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"{log_dir}/serve-{self.port}.log", "w")
        env = {k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.proc = subprocess.Popen([PY, "rollout.py", "serve", self.model, "--port",
                                      str(self.port), "--max_model_len", str(MAX_LEN)], cwd=ROOT,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.wait()

    def wait(self, timeout=180):
        import requests
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, open(self.log.name).read()[-3000:]
            try:
                if requests.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        raise TimeoutError(f"no server at {self.url} after {timeout} s")

    def restart(self):
        self.stop()
        self.__init__(self.model, Path(self.log.name).parent, self.port)

    def stop(self):
        if self.proc.poll() is None:
            import os
            os.killpg(self.proc.pid, signal.SIGKILL)   # its engine and worker processes too
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Served(tiny / "model", tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


def server_logprobs(server, seq):
    """The server's log-prob of each token of `seq` after the first (prompt_logprobs)."""
    r = server.call("POST", "v1/completions", json={"model": server.model, "prompt": seq,
                                                    "max_tokens": 1, "prompt_logprobs": 0})
    lps = r["choices"][0]["prompt_logprobs"]
    return torch.tensor([lps[i][str(seq[i])]["logprob"] for i in range(1, len(seq))])


def trainer_logprobs(model, seq):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
    return logits.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_sync_is_exact_with_every_weight_changed(tiny, server):
    from transformers import AutoModelForCausalLM

    from infra.vllm_server import ServerRollout
    from rollout import weight_buckets
    engine = ServerRollout([server.url], str(tiny / "model"), max_model_len=MAX_LEN)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    assert model.config.tie_word_embeddings   # the case a sync of named_parameters() misses
    prompt = engine.tokenizer("max(7, 2, 0) = ?\n")["input_ids"]
    batch = engine.generate([prompt], n=2, max_tokens=16, seed=3)
    seq = prompt + batch.completion_ids[0]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # every weight, the embedding (= the LM head) included
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    before = (server_logprobs(engine.servers[0], seq) - trainer_logprobs(model, seq)).abs().max()
    assert before > 0.1    # the change is visible: the check below can fail
    engine.sync_weights(weight_buckets(model), version=7)
    after = (server_logprobs(engine.servers[0], seq) - trainer_logprobs(model, seq)).abs().max()
    print(f"max |log-prob diff| server vs trainer: {before:.3g} before the sync, {after:.3g} after")
    assert after < 1e-4
    assert engine.servers[0].call("GET", "weight_info")["weight_version"] == "7"
    again = engine.generate([prompt], n=2, max_tokens=16, seed=3)
    assert again.versions == [7, 7]


SHORT = ["--iters", "2", "--prompts_per_update", "4", "--max_new_tokens", "20",
         "--eval_data", "", "--max_model_len", str(MAX_LEN)]


@pytest.mark.parametrize("lag", [0, 1])
def test_runs_against_a_server_repeat(tiny, server, tmp_path, lag):
    """One seed twice, the same rows. At K = 0 the second run samples from two servers (the
    prompts split between them, both in the one transfer group): a prompt's samples are a
    function of its request's seed and the weights, whichever server draws them."""
    flags = ["--async_lag", str(lag)] + (["--mu_source", "vllm"] if lag else [])
    second = Served(tiny / "model", tmp_path) if lag == 0 else None
    try:
        rows = []
        for name, urls in (("a", server.url), ("b", f"{server.url},{second.url}" if second
                                                else server.url)):
            ok(run(train_cmd(tiny, tmp_path / name, *SHORT, "--vllm_server", urls, *flags))[0])
            rows.append(metrics(tmp_path / name))
        if second:   # both sampled, both hold iteration 2's weights
            import requests
            for s in (server, second):
                assert requests.get(f"{s.url}/weight_info").json()["weight_version"] == "2"
            assert "POST /v1/completions" in open(second.log.name).read()
    finally:
        if second:
            second.stop()
    assert len(rows[0]) == 2
    for x, y in zip(*rows):
        assert x["staleness"] == (0 if x["iter"] == 1 else lag)
        for k in x:
            if not k.startswith("time_") and k != "tokens_per_s":
                assert x[k] == y[k], (x["iter"], k, x[k], y[k])


def test_no_server_at_the_url(tiny, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc, _ = run(train_cmd(tiny, tmp_path / "none", *SHORT, "--vllm_server", url))
    assert proc.returncode == 2
    assert f"--vllm_server={url}" in proc.stderr and "python rollout.py serve" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_of_another_model_is_refused(tiny, server, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(tiny / "model", other)
    proc, _ = run(train_cmd(tiny, tmp_path / "o", *SHORT, "--model", str(other),
                            "--vllm_server", server.url))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "serves" in proc.stderr and str(other) in proc.stderr and "model" in proc.stderr


def test_a_server_of_another_vocabulary_is_refused(tiny, server, tmp_path):
    """A model folder whose tokenizer maps the digits 1 and 2 to each other's ids: the server's
    tokenization of the probe differs from the trainer's, and the start refuses it naming both
    (checked before the folders, whose names may differ across machines)."""
    import json

    from infra.vllm_server import ServerError, ServerRollout
    other = tmp_path / "model"
    shutil.copytree(tiny / "model", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ServerError) as e:
        ServerRollout([server.url], str(other), max_model_len=MAX_LEN)
    assert "another vocabulary" in str(e.value) and server.url in str(e.value), e.value
    assert str(other) in str(e.value)


def test_a_transfer_that_fails_halfway_leaves_the_server_paused(tiny, server, tmp_path):
    """The trainer dies in the middle of the broadcast: the server is left paused at the version
    it had (it samples nothing from half-updated weights); a run's first sync repairs it."""
    import requests
    script = tmp_path / "half.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from transformers import AutoModelForCausalLM
from infra.vllm_server import ServerRollout
from rollout import weight_buckets
engine = ServerRollout([{server.url!r}], {str(tiny / "model")!r}, max_model_len={MAX_LEN})
model = AutoModelForCausalLM.from_pretrained({str(tiny / "model")!r})
engine.sync_weights(weight_buckets(model), version=41)
def dies_halfway(buckets):
    yield next(buckets)
    os._exit(3)              # the trainer gone after the first bucket
engine.sync_weights(dies_halfway(weight_buckets(model, bucket_mb=0)), version=42)
""")
    proc = subprocess.run([PY, str(script)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    time.sleep(2)
    assert requests.get(f"{server.url}/is_paused").json()["is_paused"] is True
    assert requests.get(f"{server.url}/weight_info").json()["weight_version"] == "41"
    out = tmp_path / "after"      # the next run refuses it, naming the way out
    proc, _ = run(train_cmd(tiny, out, *SHORT, "--iters", "1", "--vllm_server", server.url))
    assert proc.returncode == 1 and "restart it" in proc.stderr, proc.stderr[-3000:]
    assert requests.get(f"{server.url}/weight_info").json()["weight_version"] == "41"
    server.restart()              # a restarted server then trains
    ok(run(train_cmd(tiny, out, *SHORT, "--iters", "1", "--overwrite",
                     "--vllm_server", server.url))[0])
    assert requests.get(f"{server.url}/is_paused").json()["is_paused"] is False
    assert requests.get(f"{server.url}/weight_info").json()["weight_version"] == "1"


def test_a_server_that_dies_mid_run_stops_it_and_resume_continues(tiny, server, tmp_path):
    served = server
    out = tmp_path / "dies"
    cmd = train_cmd(tiny, out, *SHORT, "--iters", "4", "--ckpt_every", "1",
                    "--vllm_server", served.url)
    trainer = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints").is_dir() or len(metrics(out)) < 2:
            assert trainer.poll() is None and time.time() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.5)
        served.stop()
        _, err = trainer.communicate(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 1, err[-3000:]
    assert "train.py: stopped:" in err and served.url in err and "--resume" in err
    assert "Traceback" not in err.split("train.py: stopped:")[-1]
    done = len(metrics(out))
    served.restart()                # a server is back at the same URL
    ok(run(train_cmd(tiny, out, *SHORT, "--iters", "4", "--resume", "--vllm_server",
                     served.url))[0])
    rows = metrics(out)
    assert [r["iter"] for r in rows] == [1, 2, 3, 4] and done >= 2


def test_two_processes_against_a_server_repeat_and_leave_it_the_final_weights(tiny, server, tmp_path):
    """Accelerate's 2 processes against one server: each rank samples its half of the prompts over
    HTTP, rank 0 alone sends the weights, and no rank samples before the server resumed. One seed
    twice gives the same rows (a rank sampling from weights half-sent would make them depend on
    timing), and after the run the server's log-probs are the final weights' (MP: 2 AdamW steps
    per iteration, the ranks holding 2 of a mini-batch's 4 groups). Not equal to one process's rows:
    each rank seeds its own requests, as the in-process engine does."""
    from transformers import AutoModelForCausalLM

    from infra.vllm_server import ServerRollout
    flags = [*MP, "--iters", "2", "--eval_data", "", "--max_model_len", str(MAX_LEN), "--vllm_server", server.url]
    for name in ("a", "b"):
        ok(run(LAUNCH_2 + train_cmd(tiny, tmp_path / name, *flags)[1:], timeout=300)[0])
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert len(a) == 2 and sum(r["updates"] for r in a) > 0
    for x, y in zip(a, b):
        for k in x:
            if not k.startswith("time_") and k != "tokens_per_s":
                assert x[k] == y[k], (x["iter"], k, x[k], y[k])
    engine = ServerRollout([server.url], str(tiny / "model"), max_model_len=MAX_LEN)
    seq = engine.tokenizer("max(7, 2, 0) = 7\nmin(4, 9) = 4\n")["input_ids"]
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    diff = (server_logprobs(engine.servers[0], seq) - trainer_logprobs(final, seq)).abs().max().item()
    moved = (trainer_logprobs(start, seq) - trainer_logprobs(final, seq)).abs().max().item()
    print(f"max |log-prob diff| server vs the final weights: {diff:.3g} (training moved them {moved:.3g})")
    assert moved > 1e-3 and diff < 1e-4
    assert engine.servers[0].call("GET", "weight_info")["weight_version"] == "2"


def test_resume_at_k_1_against_a_server_trains_the_batches_of_the_unbroken_run(tiny, server, tmp_path):
    """As tests/test_async.py's in-process test, against a server: SIGKILLed in the middle of iteration
    3's checkpoint (tests/kill_at.py), resumed from iteration 2's with the batch then in flight. The
    server has moved on meanwhile (the killed run synced iteration 3's weights and left requests
    behind), so the resume must put the checkpoint's weights back before it samples: the batches
    trained equal the unbroken run's token for token, the update to float32 noise."""
    flags = [*SHORT, "--iters", "4", "--async_lag", "1", "--mu_source", "vllm", "--vllm_server", server.url]
    for out, kill, more in (("straight", [], []), ("broken", ["during", "3"], ["--ckpt_every", "1"]),
                            ("broken", [], ["--resume"])):
        cmd = train_cmd(tiny, tmp_path / out, *flags, *more, "--save_rollouts", str(tmp_path / f"{out}-rollouts"))
        proc = run([cmd[0], "tests/kill_at.py", *kill, *cmd[2:]] if kill else cmd, timeout=300)[0]
        assert proc.returncode == -9 if kill else ok(proc)
    assert "(after iteration 2)" in proc.stdout
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "broken")
    assert [r["iter"] for r in b] == [1, 2, 3, 4] and [r["staleness"] for r in b] == [0, 1, 1, 1]
    for t in range(1, 5):
        name = f"iter_{t:06d}_rank000.json"
        assert (tmp_path / "straight-rollouts" / name).read_text() == \
            (tmp_path / "broken-rollouts" / name).read_text(), f"batch {t} differs"
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"], ra["iter"]
    one, two = update_of(tmp_path / "straight", tiny), update_of(tmp_path / "broken", tiny)
    assert one.abs().max().item() > 1e-4, "the update barely moved the weights"
    assert (one - two).abs().max().item() < 1e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
