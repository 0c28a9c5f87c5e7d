"""Checkpoints, resume, the final policy, and a safe stop.

1. A checkpoint is accelerate's save_state (model, optimizer, every rank's RNG, the prompt sampler)
   written to iter_N.tmp and renamed once every rank's files and trainer_state.json exist: a kill
   at any moment (SIGKILL included) never leaves a half-written folder under a final name, and
   `checkpoints()` takes only `iter_<digits>` names. A folder is replaced or deleted by first
   renaming it aside (`.old`), so no complete name ever holds a half-deleted folder either. A
   write that fails (a full disk) removes its '.tmp', keeps the last checkpoint, and stops the
   run naming the folder and the space a checkpoint takes.
2. --resume restores the latest (or the given) complete checkpoint; flags that change the run must
   match the checkpoint's unless --resume_with_changes (infra/flags.py RUN_NEUTRAL; --iters too
   under a decaying --lr_schedule, whose length it sets). The lr schedule is a function of the
   step (train.learning_rate): the iteration and the flags saved here are its whole state.
3. A fresh run never overwrites an earlier one: an --out_dir that holds a run's metrics or
   checkpoints is refused at start unless --resume or --overwrite says what to do with it.
4. Ctrl-C / SIGTERM finish the running iteration, checkpoint and exit 130 (`StopRequest`).
"""
import json
import logging
import os
import re
import shutil
import signal

from infra.flags import FlagError, run_neutral
from infra.lora import is_lora, policy_weights

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "final", "adapter", "eval.json",
             "eval_start.json", "dynamics.png")


class RunFolderInUse(FlagError, FileExistsError):
    """--out_dir holds an earlier run and neither --resume nor --overwrite says what to do."""


def check_out_dir(args):
    """A fresh run in a folder holding an earlier run's metrics or checkpoints stops here, at
    start: nothing is lost silently."""
    earlier = [n for n in ("metrics.jsonl", "checkpoints")
               if os.path.exists(os.path.join(args.out_dir, n))]
    if earlier and not args.resume and not args.overwrite:
        raise RunFolderInUse(
            f"--out_dir {args.out_dir} already holds a run ({', '.join(earlier)}); continue it "
            "with --resume, start it afresh with --overwrite (deletes its files), or pick another "
            "--out_dir")


def prepare_out_dir(args, is_main):
    """Make out_dir; under --overwrite, delete the earlier run's files first."""
    if args.overwrite and is_main and os.path.isdir(args.out_dir):
        for name in os.listdir(args.out_dir):
            path, base = os.path.join(args.out_dir, name), re.sub(r"\.(tmp|old)$", "", name)
            if base not in RUN_FILES and not base.startswith("eval_iter_"):
                continue   # not the run's: a user's own file stays
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    os.makedirs(args.out_dir, exist_ok=True)


def resume(args, acc, ckpt_dir):
    """--resume: (the checkpoint restored, the iteration it followed, the metrics rows up to it;
    rows past it are redone)."""
    path, start = load_checkpoint(args, acc, ckpt_dir)
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    history = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            lines = f.read().splitlines()
        for k, line in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if k == len(lines) - 1:   # a row cut short by a kill: past the checkpoint, redone
                    break
                raise ValueError(f"{metrics_path}, line {k + 1}: not a JSON row: {line[:80]!r}")
            if row["iter"] <= start:
                history.append(row)
    return path, start, history


def checkpoints(ckpt_dir):
    """Complete checkpoints, oldest first: the iter_<digits> folders (an interrupted write is
    iter_N.tmp, a folder being replaced or deleted iter_N.old: both ignored)."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = sorted(n for n in os.listdir(ckpt_dir) if re.fullmatch(r"iter_\d+", n))
    return [os.path.join(ckpt_dir, n) for n in names]


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _not_tied_weights_notice(record):
    """save_state stores tied weights once (lm_head.weight is embed_tokens) and warns "Removed
    shared tensor ... while saving" at every checkpoint; load_state ties them again (resume is
    tested to be bitwise), so the warning says nothing here and is dropped."""
    return "Removed shared tensor" not in record.getMessage()


def save_checkpoint(args, acc, ckpt_dir, it):
    logging.getLogger("accelerate.utils.other").addFilter(_not_tied_weights_notice)   # once
    path = os.path.join(ckpt_dir, f"iter_{it:06d}")
    if acc.is_main_process and os.path.isdir(ckpt_dir):   # what killed runs left: not checkpoints
        for name in os.listdir(ckpt_dir):
            if re.fullmatch(r"iter_\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    acc.wait_for_everyone()
    try:
        acc.save_state(path + ".tmp")
        acc.wait_for_everyone()                      # every rank's files (RNG state, shards) exist
        if acc.is_main_process:
            with open(os.path.join(path + ".tmp", "trainer_state.json"), "w") as f:
                json.dump({"iter": it, "args": {k: v for k, v in vars(args).items()
                                                if k != "cell"}}, f)
                f.flush()
                os.fsync(f.fileno())
    except Exception as e:   # ENOSPC / EFBIG: OSError, torch.save's RuntimeError, SafetensorError
        written = folder_bytes(path + ".tmp") if os.path.isdir(path + ".tmp") else 0
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        raise CheckpointWriteError(ckpt_dir, written, e) from e
    if acc.is_main_process:
        # the commit point; a run resumed from an older checkpoint replaces the later ones it redoes
        _replace(path + ".tmp", path)
        for stale in checkpoints(ckpt_dir)[:-args.keep_last]:
            _remove(stale)
    acc.wait_for_everyone()


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file-size limit; its '.tmp' removed): the
    message names the folder, the space free there and what a checkpoint takes."""

    def __init__(self, ckpt_dir, written, error):
        done = checkpoints(ckpt_dir)
        need = f"about {folder_bytes(done[-1]) / 2**20:.1f} MB (as {done[-1]})" if done else \
            f"more than the {written / 2**20:.1f} MB written before the failure"
        free = shutil.disk_usage(ckpt_dir).free / 2**20
        last = f"the latest checkpoint is still {done[-1]}" if done else "no checkpoint was kept"
        super().__init__(f"could not write a checkpoint in {ckpt_dir} ({error}): a checkpoint "
                         f"needs {need}, {free:.1f} MB are free there; {last} (--resume "
                         "continues from it once there is room)")


def load_checkpoint(args, acc, ckpt_dir):
    """--resume: restore the latest (or the given) checkpoint; returns (its path, the iteration
    it followed). Flags that change the run must match the checkpoint's unless
    --resume_with_changes."""
    path = args.resume
    if path == "latest":
        if not checkpoints(ckpt_dir):
            raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir}")
        path = checkpoints(ckpt_dir)[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume={path!r} is not a complete checkpoint folder "
                                f"(no trainer_state.json); complete ones: {checkpoints(ckpt_dir)}")
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    now = json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "cell"}))   # tuples
    neutral = run_neutral(state["args"])
    changed = {k: (v, now.get(k)) for k, v in state["args"].items()
               if k not in neutral and now.get(k) != v}
    if changed and not args.resume_with_changes:
        why = f" (the lr schedule {state['args']['lr_schedule']} decays over the run's --iters: " \
            "another value reshapes the rest of it)" if "iters" in changed else ""
        raise FlagError(f"--resume: {path} was made with other flags: "
                         + ", ".join(f"--{k} {a!r} (now {b!r})" for k, (a, b) in changed.items())
                         + why + "; pass --resume_with_changes to continue anyway")
    acc.load_state(path)
    return path, state["iter"]


def save_policy(acc, model, tokenizer, path):
    """The policy alone, in Hugging Face format (loadable by eval.py, vLLM and transformers).
    Under LoRA that folder holds base + adapters merged, and `adapter/` beside it the adapters
    alone in peft's format (a few MB; load with peft.PeftModel.from_pretrained(base, dir))."""
    state = acc.get_state_dict(model)        # gathered from the shards under FSDP
    lora = is_lora(model)
    merged = dict(policy_weights(model)) if lora else state   # every rank: gathers under FSDP
    if acc.is_main_process:
        inner = acc.unwrap_model(model)
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        (inner.get_base_model() if lora else inner).save_pretrained(path + ".tmp",
                                                                    state_dict=merged)
        tokenizer.save_pretrained(path + ".tmp")
        _replace(path + ".tmp", path)
        if lora:
            adapter = os.path.join(os.path.dirname(path), "adapter")
            inner.save_pretrained(adapter + ".tmp", state_dict=state)
            _replace(adapter + ".tmp", adapter)
    acc.wait_for_everyone()


def _replace(tmp, path):
    """The finished folder `tmp` takes the place of `path`: an earlier one is removed first by
    `_remove`, so a kill at any moment leaves either the old folder or the new one under the
    name, or neither (then the checkpoint before it is the latest), never a half-deleted one."""
    if os.path.exists(path):
        _remove(path)
    os.replace(tmp, path)


def _remove(path):
    """Delete a folder without ever leaving a part of it under its own name."""
    shutil.rmtree(path + ".old", ignore_errors=True)
    os.replace(path, path + ".old")
    shutil.rmtree(path + ".old", ignore_errors=True)


class StopRequest:
    """Ctrl-C / SIGTERM (torchrun sends it to every worker, then SIGKILL 30 s later): finish the
    running iteration, checkpoint, exit 130. A second signal kills (once Python runs again: after
    the torch call under way), saying that the running iteration is lost. The handler only sets a
    flag and writes with os.write: print() inside a signal handler can raise on reentry."""

    def __init__(self, master):
        self.requested, self.master = False, master
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:   # the second: say what is lost, then die of the signal as without us
            if self.master:
                os.write(2, f"\n{name} again: aborting; this iteration is lost, and --resume "
                         "redoes it and any others after the last checkpoint\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        if self.master:
            os.write(2, f"\n{name}: stopping after this iteration (again to abort)\n".encode())
