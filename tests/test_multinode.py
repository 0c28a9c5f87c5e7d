"""Issue #50: `accelerate launch` across machines, at tiny scale on this CPU.

Run: .venv/bin/python -m pytest tests/test_multinode.py -q   (CPU, no network, ~2.5 min on 2 busy cores)

Two "machines" on this host: two `accelerate launch --num_machines 2 --machine_rank 0|1` of one
process each, started at once, meet at node 0's rendezvous (127.0.0.1 and a free port) and train
as ranks 0 and 1 of one world of 2 over gloo, under DDP and under FSDP2 (configs/accelerate_fsdp_cpu.yaml,
the 8-GPU presets' sharding). On the recorded batch (conftest.py, `recorded`) they
must make the update one process makes: test_scale.py's two-process test with the same samples,
metrics and bounds, only the launch differs. The second test checks that accelerate turns
configs/accelerate_fsdp_2nodes_8gpu.yaml into the torchrun launch README "Scaling up" shows.
"""
import os
import signal
import subprocess
import time

import pytest
import yaml

from conftest import ENV, MP, PY, ROOT, free_port, metrics, ok, run, train_cmd
from test_scale import assert_same_update


def launch_node(rank, port, config=None, nodes=2, per_node=1):
    """Machine `rank`'s launch. Without a config, --multi_gpu: accelerate's torchrun launcher (as
    conftest's LAUNCH_2; --cpu would take its simple launcher, which sets MASTER_ADDR/PORT but no
    RANK/WORLD_SIZE, leaving those to mpirun, so each machine would run a world of its own). With
    an FSDP config, accelerate takes torchrun for it."""
    how = ["--config_file", str(ROOT / "configs" / config)] if config else \
        ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [PY, "-m", "accelerate.commands.launch", *how, "--num_machines", str(nodes), "--machine_rank",
            str(rank), "--num_processes", str(nodes * per_node), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port)]


def run_machines(cmds, logs, timeout=300):
    """Start every machine's launch at once; wait for all. If one fails or time runs out, kill every
    launch's process group (the launcher and its workers) and fail with each machine's log."""
    procs = []
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            with open(log, "w") as f:   # a file, not a pipe: no machine blocks on a full pipe
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.time() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    texts = [open(log).read() for log in logs]
    report = "\n".join(f"--- machine {i}: exit {p.returncode}\n{t[-4000:]}" for i, (p, t) in enumerate(zip(procs, texts)))
    assert all(p.returncode == 0 for p in procs), f"a machine failed or timed out ({timeout} s):\n{report}"
    return texts


# DDP (gloo) and configs/accelerate_fsdp_cpu.yaml's FSDP2 full shard (the 8-GPU presets' sharding)
@pytest.mark.parametrize("config", [None, "accelerate_fsdp_cpu.yaml"], ids=["ddp", "fsdp2"])
@pytest.mark.slow
def test_two_machines_of_one_process_make_the_one_process_update(tiny, recorded, tmp_path, config):
    replay = ["--replay_rollouts", str(recorded / "rollouts")]
    ok(run(train_cmd(tiny, tmp_path / "one", *MP, *replay))[0])
    port, job = free_port(), train_cmd(tiny, tmp_path / "two", *MP, *replay)[1:]
    t = time.time()
    node0, node1 = run_machines([launch_node(r, port, config) + job for r in (0, 1)],
                                [tmp_path / "node0.log", tmp_path / "node1.log"])
    took = time.time() - t
    # one world of 2: rank 0 (node 0) logs the count; node 1's process is rank 1, so it logs nothing
    # of train.py's own (a machine that came up as a world of its own would be its rank 0 and say
    # "1 process(es)")
    assert "2 process(es)" in node0, f"node 0 did not run in a world of 2:\n{node0[-3000:]}"
    assert "process(es)" not in node1, f"node 1 ran its own world:\n{node1[-3000:]}"
    # and process 1 checkpointed with rank 0: save_state writes each rank's RNG state (FSDP: and its
    # shard of the weights) into the folder
    ckpt = tmp_path / "two" / "checkpoints" / "iter_000001"
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    if config:
        assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) == \
            ["__0_0.distcp", "__1_0.distcp"]
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(a) == len(b) == 1, "metrics.jsonl: one row, written by rank 0 alone"
    assert_same_update(a[0], b[0], tmp_path / "one", tmp_path / "two", tiny,
                       f"{config or 'ddp'}: 1 process vs 2 machines x 1 process ({took:.0f} s)")


def test_the_two_node_preset_is_the_8_gpu_preset_on_two_torchrun_nodes():
    """configs/accelerate_fsdp_2nodes_8gpu.yaml: the 8-GPU preset's FSDP2 settings, and accelerate
    resolves it, with each node's --machine_rank, into torchrun's 2 nodes x 8 processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    two = yaml.safe_load(open(ROOT / "configs" / "accelerate_fsdp_2nodes_8gpu.yaml"))
    one = yaml.safe_load(open(ROOT / "configs" / "accelerate_fsdp_8gpu.yaml"))
    assert (two["num_machines"], two["num_processes"]) == (2, 16)
    for k in ("distributed_type", "mixed_precision", "fsdp_config"):
        assert two[k] == one[k], f"{k}: 2 nodes {two[k]}, 1 node {one[k]}"
    port = free_port()   # node 0 checks that its port is free
    for rank in (0, 1):
        args = launch_command_parser().parse_args([
            "--config_file", str(ROOT / "configs" / "accelerate_fsdp_2nodes_8gpu.yaml"), "--machine_rank",
            str(rank), "--main_process_ip", "10.0.0.1", "--main_process_port", str(port), "train.py",
            f"@{ROOT / 'configs' / 'math_8gpu.args'}"])
        args = _validate_launch_command(args)[0]
        env = prepare_multi_gpu_env(args)
        assert args.use_fsdp and env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
        assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", rank)
        assert args.rdzv_backend == "static" and args.rdzv_endpoint == f"10.0.0.1:{port}"
