"""reasoning-gym data sets for data/loaders.py: `rg:<name>[?key=value&...]` generated, not fetched.

    from data.loaders import load_problems
    rows = load_problems("rg:chain_sum?min_digits=2&max_digits=2", "test")

Each row's ground truth is JSON {"dataset", "config", "entry"}, what reward.py needs to run the
data set's own checker; every row also carries the shot pool in row["shots"] (for the "fewshot"
template of data/loaders.py).

Choices:
1. The keys of a name are the data set's config fields (values read as Python literals, else
   strings) plus ours: `seed` (default 0), `size` (problems generated for train, default 1000;
   the RG_SHOTS shots are taken out of them), `test_size` (default 200).
2. Its generators draw item i from Random(seed + i), so the test split uses seed + 2^31 (far from
   any train index) and also drops every problem whose text is in the train split (shots
   included) or already in the test split. It generates until it has test_size problems, giving
   up after 20 x test_size + 100 tries: then it warns and returns fewer, or raises ValueError if
   it found none (too few distinct problems).
3. The shots are RG_SHOTS distinct train problems picked with a fixed seed and withheld from the
   train rows (a training problem never has its answer in its own prompt); every row, train or
   test, carries the same pool, so the trainer and eval pass nothing extra and all few-shot
   prompts share one prefix (vLLM's prefix cache reuses it).
"""
import ast
import functools
import json
import random
import sys

RG_SIZES = {"train": 1000, "test": 200}  # default problems per split (choice 1)
RG_SHOTS = 8                             # the shot pool attached to every row (choice 3)
RG_TEST_SEED = 1 << 31                   # the test split's seed offset (choice 2)
RG_INSTALL = "pip install reasoning-gym==0.1.25  (or: bash setup.sh)"


def _parse(name: str):
    """"rg:<dataset>?k=v&..." -> (dataset, config dict, seed, {split: size}); ValueError if bad."""
    try:
        from reasoning_gym.factory import DATASETS
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{name} needs reasoning-gym: {RG_INSTALL}") from e
    import dataclasses
    dataset, _, query = name[3:].partition("?")
    if dataset not in DATASETS:
        from importlib.metadata import version  # (its __version__ still says 0.1.19 in 0.1.25)
        raise ValueError(f"unknown reasoning-gym data set {dataset!r} in {name!r}; reasoning-gym "
                         f"{version('reasoning-gym')} has: {', '.join(sorted(DATASETS))}")
    fields = [f.name for f in dataclasses.fields(DATASETS[dataset][1]) if f.name not in ("seed", "size")]
    config, ours = {}, {"seed": 0, "size": RG_SIZES["train"], "test_size": RG_SIZES["test"]}
    for part in filter(None, query.split("&")):  # not parse_qsl: it reads "+" as a space
        key, eq, value = part.partition("=")
        if not eq or key not in (*fields, *ours):
            raise ValueError(f"bad option {part!r} in {name!r}: use key=value with keys from "
                             f"{', '.join(fields + list(ours))}")
        try:
            value = ast.literal_eval(value)  # 2, True, ('+', '-'); anything else stays a string
        except (ValueError, SyntaxError):
            pass
        (ours if key in ours else config)[key] = value
    if not all(isinstance(ours[k], int) and ours[k] >= 0 for k in ours) or ours["size"] <= RG_SHOTS:
        raise ValueError(f"{name!r}: seed, size and test_size must be integers >= 0, size > {RG_SHOTS}")
    return dataset, config, ours["seed"], {"train": ours["size"], "test": ours["test_size"]}


@functools.lru_cache(16)
def _splits(dataset: str, config_json: str, seed: int, sizes: tuple) -> tuple:
    """(train entries, test entries, shot entries) of one data set and config (choices 2, 3)."""
    import reasoning_gym
    config, (n_train, n_test) = json.loads(config_json), sizes

    def make(seed, size):
        try:
            return reasoning_gym.create_dataset(dataset, **config, seed=seed, size=size)
        except (AssertionError, TypeError, ValueError) as e:  # its configs validate with asserts
            raise ValueError(f"reasoning-gym refused config {config} for {dataset!r}: {e!r}") from None

    train = list(make(seed, n_train))
    firsts = list({e["question"]: e for e in train}.values())  # distinct problems, in order
    shots = random.Random(seed).sample(firsts, min(RG_SHOTS, len(firsts)))
    shot_qs = {e["question"] for e in shots}
    train = [e for e in train if e["question"] not in shot_qs]
    seen, test = {e["question"] for e in train} | shot_qs, []
    source = make(seed + RG_TEST_SEED, 20 * n_test + 100)
    for i in range(len(source)):
        if len(test) >= n_test:
            break
        entry = source[i]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            test.append(entry)
    if n_test and not test:
        raise ValueError(f"rg:{dataset} {config}: every test problem is also a train problem: the data set "
                         f"has too few distinct problems for size={n_train}; lower size or make it harder")
    if len(test) < n_test:
        print(f"loaders: rg:{dataset} {config}: only {len(test)} of test_size={n_test} test problems differ "
              f"from the train problems (size={n_train})", file=sys.stderr)
    _check_shots(dataset, config, shots, make(seed, 1))
    return train, test, shots


def _check_shots(dataset, config, shots, ds):
    """The shots must show a one-line answer that the checker, after a JSON round trip, accepts:
    else the few-shot format or the reward (which sees the entry as JSON) cannot work."""
    for e in shots:
        answer, entry = e.get("answer"), json.loads(json.dumps(e, default=str))
        if not (isinstance(answer, str) and answer.strip() and "\n" not in answer) or \
                ds.score_answer(answer, entry) < 1.0:
            raise ValueError(f"rg:{dataset} {config} cannot be served with the 'Answer: ...' line format: "
                             f"its answers are not one line that its checker accepts after a JSON round "
                             f"trip (answer {answer!r})")


def load_rg(name: str, split: str) -> list[dict]:
    """Rows of `rg:NAME`, split "train" or "test", in the schema of data/loaders.py."""
    dataset, config, seed, sizes = _parse(name)
    if split not in sizes:
        raise ValueError(f"{name} has splits {list(sizes)}, not {split!r}")
    train, test, shots = _splits(dataset, json.dumps(config, sort_keys=True), seed,
                                 (sizes["train"], sizes["test"]))
    pool = [{"problem": e["question"], "answer": e["answer"]} for e in shots]  # one list, shared
    return [{"id": f"{dataset}-{split}-{i}", "task": "rg", "problem": e["question"],
             "ground_truth": json.dumps({"dataset": dataset, "config": config, "entry": e}, default=str),
             "source": name, "shots": pool}
            for i, e in enumerate(train if split == "train" else test)]
